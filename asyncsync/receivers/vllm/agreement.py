"""An engine's workers load one version or none: each worker's outcome is gathered before any reports.

A vLLM engine runs every weight-update RPC on each of its workers (tensor- and pipeline-parallel
ranks), and each loads its own shards. A worker that cannot stage a version another worker staged (it
cannot map the stager's arena, its own receive failed) or whose load raises half-way (``load_weights``
or a post-load fix) would leave the workers on different versions, serving logits of no version under
the old version's number. So every worker meets its peers twice per version, over vLLM's CPU group of
the engine's workers (``receivers/vllm/node.py``'s group)::

    agreement = EngineAgreement(group)
    staged = agreement.ready(version, stage)   # every worker staged it, or every worker refuses it
    agreement.loaded(version, load)            # every worker loaded it, or the engine holds mixed weights

``ready`` refuses on every worker what any worker could not stage: none of them has touched its weights
yet, so the engine serves its previous version whole. ``loaded`` finds any failure after the load
began: the weights of the failed worker are partly the new version's, so the engine is *mixed*; every
worker raises a refusal that names ``MIXED`` and keeps ``mixed`` set until a later version loads on
every worker. The engine core stops serving meanwhile (``receivers/vllm/hold.py``: every request is
answered with an error) and the trainer, told by the refusal, sends its next version whole.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from asyncsync.protocol.admission import VersionRejected

log = logging.getLogger(__name__)

# Every refusal of a version that left the engine's workers on different weights says this, so the
# engine core (``hold.py``), the trainer and an operator reading a log can tell it from a plain refusal.
MIXED = "the engine's workers hold different weights"

T = TypeVar("T")


class EngineAgreement:
    """The two meetings of one worker with the others of its engine (the module doc). ``group`` is
    vLLM's coordinator of the engine's workers (``rank_in_group``, ``world_size``, ``cpu_group``); an
    engine of one worker meets nobody."""

    def __init__(self, group: Any):
        self.group = group
        self.mixed: str | None = None  # why this engine serves no whole version, until one loads everywhere

    def ready(self, version: int, stage: Callable[[], T]) -> T:
        """``stage()`` here; its result once every worker staged ``version``. A worker that could not
        raises its own error; the others refuse the version naming it. Every worker gets here,
        failed or not, so nobody waits out vLLM's group timeout."""
        result, error = _outcome(stage)
        failures = self._gather(error)
        if error is not None:
            raise error
        failed = _first(failures)
        if failed is not None:
            raise VersionRejected(f"version {version} refused by every worker of this engine: worker {failed[0]} "
                                  f"could not stage it ({failed[1]}); the previous version serves on, whole")
        return result  # type: ignore[return-value]

    def loaded(self, version: int, load: Callable[[], None]) -> None:
        """``load()`` here, then every worker's outcome: all loaded ``version`` (the engine is whole
        again), or ``VersionRejected`` naming ``MIXED`` on every worker."""
        _, error = _outcome(load)
        failures = self._gather(error)
        failed = [(rank, why) for rank, why in enumerate(failures) if why is not None]
        if not failed:
            if self.mixed is not None:
                log.warning("asyncsync: every worker loaded version %d: the engine serves one version again", version)
            self.mixed = None
            return
        where = "; ".join(f"worker {rank}: {why}" for rank, why in failed)
        self.mixed = (f"{MIXED}: version {version} failed to load on {len(failed)} of {len(failures)} worker(s) after "
                      f"it was verified ({where}); the engine answers every request with an error until a whole "
                      "version loads on every worker: send the next version whole")
        log.error("asyncsync: %s", self.mixed)
        raise VersionRejected(self.mixed) from error

    def _gather(self, error: BaseException | None) -> list[str | None]:
        """Every worker's failure (its message) or None, in rank order."""
        mine = None if error is None else f"{type(error).__name__}: {error}"
        if self.group is None or self.group.world_size == 1:
            return [mine]
        out: list[str | None] = [None] * self.group.world_size
        torch.distributed.all_gather_object(out, mine, group=self.group.cpu_group)
        return out


def _outcome(step: Callable[[], T]) -> tuple[T | None, BaseException | None]:
    """``step()``'s result, or what it raised (anything: a peer must still be met)."""
    try:
        return step(), None
    except BaseException as e:  # re-raised by the caller once every worker met
        return None, e


def _first(failures: list[str | None]) -> tuple[int, str] | None:
    return next(((rank, why) for rank, why in enumerate(failures) if why is not None), None)
