"""End to end on loopback: a trainer (this process) and two reference servers (child processes)."""

from __future__ import annotations


import torch

from asyncsync import WeightSync, WeightSyncConfig
from asyncsync.models import generate
from asyncsync.testing import mixed_dtype_model

from conftest import TINY
from helpers import digest

PROMPT = [3, 14, 15, 92, 65]



def perturb(model: torch.nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for p in model.parameters():
            p.add_((torch.randn(p.shape, generator=g) * 0.05).to(p.dtype))
        model.token_counts += torch.arange(TINY.vocab_size) * step
        model.temperature_scale.fill_(1.0 + step / 10)


def test_five_blocking_syncs_are_bit_exact(two_servers):
    model = mixed_dtype_model(TINY)
    cfg = WeightSyncConfig.from_dict({"servers": [s.url for s in two_servers], "bucket_bytes": "16KiB"})
    sizes = {t.nbytes for t in model.state_dict().values()}
    assert max(sizes) > cfg.bucket_bytes, "the test model must have a tensor larger than a bucket"
    dtypes = {t.dtype for t in model.state_dict().values()}
    assert {torch.bfloat16, torch.float32, torch.int64} <= dtypes
    assert any(t.dim() == 0 for t in model.state_dict().values())

    with WeightSync.from_config(cfg) as sync:
        sync.connect(model)
        before = two_servers[0].post("/generate", {"prompt": PROMPT, "max_new_tokens": 12})["completions"]
        for version in range(1, 6):
            perturb(model, version)
            sync.wait_snapshot()
            result = sync.publish(model, version)
            assert set(result.server_versions.values()) == {version}
            expected = digest(model)
            want_tokens = generate(model, PROMPT, 12)
            for server in two_servers:
                got = server.get("/weights/digest")
                assert got["version"] == version
                assert got["digest"] == expected
                assert server.get("/version")["version"] == version
                out = server.post("/generate", {"prompt": PROMPT, "max_new_tokens": 12})
                assert out["weight_version"] == version
                assert out["completions"] == want_tokens
        assert before != want_tokens, "the weights changed, so greedy tokens must have changed"
