"""The SGLang client end to end, against the reference server speaking SGLang's weight-update API."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
import torch

from asyncsync.config import WeightSyncConfig
from asyncsync.models import build_model
from asyncsync.receivers.reference.app import ReferenceServer
from asyncsync.testing import mixed_dtype_model

from conftest import TINY
from helpers import ThreadedServer, Trainer, digest



def weights(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """``model``'s state with every parameter redrawn from ``seed`` (buffers kept)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g).to(p.dtype))
    return dict(model.state_dict())


def get(url: str, path: str) -> dict:
    with urllib.request.urlopen(url + path, timeout=30) as resp:
        return json.loads(resp.read())


def sglang_config(url: str, bucket_bytes: int | str = "16KiB", **server: object) -> WeightSyncConfig:
    return WeightSyncConfig.from_dict({"servers": [{"url": url, "kind": "sglang", **server}], "bucket_bytes": bucket_bytes})


@pytest.mark.parametrize("sessions", [True, False], ids=["sglang>=0.5.21", "older-sglang-404"])
def test_sglang_client_syncs_versions_bit_exactly(sessions):
    with ThreadedServer(ReferenceServer(build_model(TINY), sglang_sessions=sessions)) as server:
        trainer = Trainer(sglang_config(server.url))
        try:
            assert get(server.url, "/get_weight_version") == {"weight_version": "default"}
            model = build_model(TINY)
            for version in (1, 2, 3):
                named = weights(model, version)
                assert trainer.publish(named, version) == {server.url: version}
                assert server.server.receiver.digest() == (version, digest(named))
                assert get(server.url, "/get_weight_version") == {"weight_version": str(version)}
                assert get(server.url, "/get_server_info")["paused"] is False, "generation resumed"
            assert trainer.groups == [("sglang", 2)]
        finally:
            trainer.close()


def test_update_outside_a_session_is_refused_when_sessions_exist():
    with ThreadedServer(ReferenceServer(build_model(TINY))) as server:
        body = {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[TINY.vocab_size, TINY.hidden_size]],
                "group_name": "weight_update_group", "load_format": "flattened_bucket"}
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(urllib.request.Request(
                server.url + "/update_weights_from_distributed", json.dumps(body).encode(),
                {"Content-Type": "application/json"}), timeout=30)
        assert err.value.code == 400
        answer = json.loads(err.value.read())
        assert answer["success"] is False and "not initialized" in answer["message"]


def test_refused_versions_leave_the_old_weights_serving():
    """One tensor per bucket keeps every bucket single-dtype even for a mixed-dtype model; 64 KiB
    buckets mix bf16 and fp32, which SGLang's flattened buckets do not portably support."""
    with ThreadedServer(ReferenceServer(mixed_dtype_model(TINY))) as server:
        trainer = Trainer(sglang_config(server.url, bucket_bytes=1))
        try:
            model = mixed_dtype_model(TINY)
            good = weights(model, 1)
            assert trainer.publish(good, 1) == {server.url: 1}
            served = server.server.receiver.digest()
            assert served == (1, digest(good))

            result = trainer.publish(weights(model, 2), 2, bucket_bytes=64 * 1024, single_dtype=False)[server.url]
            assert "mixes dtypes" in str(result)
            unknown = {**weights(model, 3), "no.such.tensor": torch.zeros(3)}
            result = trainer.publish(unknown, 3)[server.url]
            assert "unknown tensor 'no.such.tensor'" in str(result)

            assert server.server.receiver.digest() == served, "refused versions must not touch the weights"
            assert get(server.url, "/get_weight_version") == {"weight_version": "1"}
            assert get(server.url, "/get_server_info")["paused"] is False, "a failed update resumes generation"

            fresh = weights(model, 4)
            assert trainer.publish(fresh, 4) == {server.url: 4}
            assert server.server.receiver.digest() == (4, digest(fresh))
        finally:
            trainer.close()
