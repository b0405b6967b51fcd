"""asyncsync.integrations.trl without TRL or a server: how a TRL run's weight_sync config is read, how
prompts are split over the servers, what a rollout record accepts, and that nothing loads TRL (or the
integration) before it is used. The runs against TRL and vLLM are in tests/test_trl_vllm.py."""

from __future__ import annotations

import time

import pytest

from asyncsync.config import ConfigError, ServerConfig, WeightSyncConfig
from asyncsync.integrations.trl import Rollouts, WeightTransfer, _assign, weight_sync_config, run_within

from test_architecture import imported_after

TRL_URL = "http://127.0.0.1:8000"


def test_without_servers_trls_own_server_is_synced():
    cfg = weight_sync_config({"async_weight_update": True}, TRL_URL + "/")
    assert [(s.base_url, s.kind) for s in cfg.servers] == [(TRL_URL, "vllm")]
    assert cfg.async_weight_update


def test_listed_servers_put_trls_first_and_must_include_it(tmp_path):
    other = "http://127.0.0.1:9000"
    path = tmp_path / "run.yaml"
    path.write_text(f"weight_sync:\n  servers:\n    - {{url: {other}, kind: vllm}}\n    - {{url: {TRL_URL}, kind: vllm}}\n")
    assert [s.base_url for s in weight_sync_config(path, TRL_URL).servers] == [TRL_URL, other]
    with pytest.raises(ConfigError, match="TRL generates from http://127.0.0.1:7 .*which is not listed"):
        weight_sync_config(path, "http://127.0.0.1:7")


def test_every_server_must_be_vllm():
    with pytest.raises(ConfigError, match="is a 'reference' server; TRL generates through vLLM"):
        weight_sync_config({"servers": [TRL_URL]}, TRL_URL)  # a bare URL is a reference server
    given = WeightSyncConfig(servers=(ServerConfig(TRL_URL, kind="vllm"),), max_staleness=2)
    assert weight_sync_config(given, TRL_URL) == given


def test_weight_transfer_refuses_async_updates():
    with pytest.raises(ConfigError, match="async_weight_update: AsyncGRPOTrainer tags rollouts"):
        WeightTransfer({"async_weight_update": True}, TRL_URL)
    assert WeightTransfer({}, TRL_URL).config.trainer_ranks == 1
    with pytest.raises(ConfigError, match="servers: list the vLLM servers to sync"):
        WeightTransfer({})


@pytest.mark.parametrize("prompts, servers", [(10, 3), (2, 3), (1, 1), (7, 2)])
def test_prompts_are_split_in_order_over_the_servers(prompts, servers):
    urls = [f"http://s{i}" for i in range(servers)]
    jobs = _assign([(0, prompts)], urls)
    spans = [span for _, span in jobs]
    assert spans[0][0] == 0 and spans[-1][1] == prompts and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert all(hi > lo for lo, hi in spans) and len({u for u, _ in jobs}) == len(jobs) == min(prompts, servers)
    retried = _assign([(0, 3), (5, 9), (9, 10)], urls)
    assert [span for _, span in retried] == [(0, 3), (5, 9), (9, 10)], "failed parts are retried whole"


def test_a_rollout_record_is_consistent():
    ok = Rollouts(((1,), (1,)), ((2, 3), (4, 5)), ((-1.0, -2.0), (-1.5, -2.5)), (3, 3), (3, 4), ("a", "b"))
    assert ok.exact == (True, False)
    with pytest.raises(ValueError, match="2 completions but fields of lengths"):
        Rollouts(((1,), (1,)), ((2,), (4,)), None, (3,), (3, 3), ("a", "b"))
    with pytest.raises(ValueError, match="older version after a request"):
        Rollouts(((1,),), ((2,),), None, (4,), (3,), ("a",))


def test_a_call_without_a_deadline_gets_one():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="connecting did not finish within 0.3s"):
        run_within(0.3, "connecting", time.sleep, 30)
    assert time.monotonic() - start < 5
    with pytest.raises(KeyError, match="gone"):
        run_within(5, "a lookup", {}.__getitem__, "gone")
    assert run_within(5, "a sum", sum, [1, 2]) == 3


def test_nothing_loads_trl_or_the_integration_before_it_is_used():
    loaded = imported_after("import asyncsync.trainer.sync, asyncsync.engines.vllm, asyncsync.cli")
    assert not [m for m in loaded if m.startswith("asyncsync.integrations")], "the core imports no integration"
    loaded = imported_after("import asyncsync.integrations.trl")
    assert not [m for m in loaded if m == "trl" or m.startswith("trl.")], "TRL loads only when GRPOTrainer is used"
