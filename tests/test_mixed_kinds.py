"""Servers of different kinds in one config: each joins the data-plane group its protocol needs."""

from __future__ import annotations

import dataclasses
import urllib.request
from collections.abc import Iterator

import pytest
import torch

from asyncsync import WeightSync
from asyncsync.config import WeightSyncConfig
from asyncsync.models import build_model
from asyncsync.testing import ServerProcess, mixed_dtype_model, running

from conftest import TINY
from helpers import Trainer, digest


@pytest.fixture(scope="module")
def servers() -> Iterator[list[ServerProcess]]:
    with running([ServerProcess(build_model, (TINY,)) for _ in range(2)]) as started:
        yield started


def test_reference_and_sglang_kinds_sync_bit_exactly_through_two_groups(servers):
    native, via_sglang = servers
    cfg = WeightSyncConfig.from_dict({
        "servers": [{"url": native.url, "kind": "reference"}, {"url": via_sglang.url, "kind": "sglang"}],
        "bucket_bytes": "16KiB",
    })
    trainer = Trainer(cfg)
    try:
        assert [name for name, _ in trainer.groups] == ["asyncsync", "sglang"]
        model = build_model(TINY)
        g = torch.Generator().manual_seed(0)
        for version in (1, 2, 3):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * 0.05)
            named = dict(model.state_dict())
            assert trainer.publish(named, version) == {native.url: version, via_sglang.url: version}
            want = digest(named)
            for server in servers:
                assert server.get("/weights/digest") == {"version": version, "digest": want}
        assert via_sglang.get("/model_info")["weight_version"] == "3"
    finally:
        trainer.close()


@pytest.mark.slow
@pytest.mark.parametrize("async_weight_update", [False, True], ids=["blocking", "async"])
def test_weight_sync_mixes_kinds_with_one_dtype_per_bucket(async_weight_update):
    """WeightSync itself with a mixed-dtype model: SGLang's group makes the plan single-dtype, and
    both servers end bit-exact. Fresh servers: a version must be newer than the one served."""
    with ServerProcess(mixed_dtype_model, (TINY,)) as native, ServerProcess(mixed_dtype_model, (TINY,)) as via_sglang:
        cfg = WeightSyncConfig.from_dict({
            "async_weight_update": async_weight_update, "bucket_bytes": "16KiB",
            "servers": [{"url": native.url, "kind": "reference"}, {"url": via_sglang.url, "kind": "sglang"}],
        })
        model = mixed_dtype_model(TINY)
        g = torch.Generator().manual_seed(1)
        with WeightSync.from_config(cfg) as sync:
            sync.connect(model)
            assert all(len({s.dtype for s in b.specs}) == 1 for b in sync.plan.buckets)
            for version in (1, 2, 3):
                sync.wait_snapshot()
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_((torch.randn(p.shape, generator=g) * 0.05).to(p.dtype))
                sync.publish(model, version)
        want = digest(model)
        for server in (native, via_sglang):
            assert server.get("/weights/digest") == {"version": 3, "digest": want}


@pytest.mark.slow
def test_a_server_that_refuses_does_not_hold_back_the_others():
    """The refusing server is reported, the others still end their update (vLLM and SGLang would
    otherwise stay paused mid-update), and the refusing one resumes generation."""
    other_vocab = dataclasses.replace(TINY, vocab_size=TINY.vocab_size // 2)
    with ServerProcess(build_model, (TINY,)) as native, ServerProcess(build_model, (other_vocab,)) as mismatched:
        cfg = WeightSyncConfig.from_dict({
            "bucket_bytes": "16KiB",
            "servers": [{"url": native.url, "kind": "reference"}, {"url": mismatched.url, "kind": "sglang"}],
        })
        with WeightSync.from_config(cfg) as sync:
            sync.connect(build_model(TINY))
            result = sync.publish(build_model(TINY), 1)
            assert list(result.failures) == [mismatched.url]
            assert [(e.kind, e.server) for e in sync.events] == [("refused", mismatched.url)]
            assert sync.server_versions == {native.url: 1, mismatched.url: 0}
        assert native.get("/version")["version"] == 1
        assert mismatched.get("/model_info")["weight_version"] == "default"
        with urllib.request.urlopen(mismatched.url + "/ready", timeout=30) as ready:
            assert ready.status == 200, "generation resumed"
