"""What vLLM's weight-update path leaves stale after a load, and the one list of fixes for it.

vLLM reports a version loaded once ``load_weights`` and its layerwise reload have run, but some of
what a model computes with is derived from its weights by steps that path skips or never had: the
post-load processing of a tied module the load did not reach (``ties.py``), an LM head bias the
model loads and never hands its logits processor (``head.py``), the MoE experts kernel's own
post-load step (``experts.py``: on CPU, the grouped-GEMM prepack). Bytes arrive verified either way;
only the tokens show it.

Every fix has one interface (``PostLoadFix``) and is declared once, in ``POST_LOAD_FIXES``:

* ``of(model)``: the fix this model needs, found once when the engine is created, or None where it
  needs none;
* ``refusal()``: why every version would be refused (a stale layer that cannot be repaired), or
  None; judged at the trainer's connect and again before each version touches the model, so the
  previous weights keep serving;
* ``repair(loaded)``: after each load (``loaded``: the parameter names ``load_weights`` returned,
  None where it does not say), bring what the fix keeps current up to the weights just loaded.

``PostLoadFixes`` holds the fixes one model needs; the engine (``transfer_engine.py``) knows only it.
Contract: a version this engine reports loaded is served by every module, each with the processing
derived from that version's weights; a version that cannot be is refused before the model is touched.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence, Set
from typing import Protocol

import torch

from asyncsync.protocol.admission import VersionRejected
from asyncsync.receivers.vllm.experts import ExpertKernels
from asyncsync.receivers.vllm.head import HeadBias
from asyncsync.receivers.vllm.ties import TiedModules

log = logging.getLogger(__name__)


class PostLoadFix(Protocol):
    """One kind of state vLLM leaves stale after a load, kept current (the module doc)."""

    @classmethod
    def of(cls, model: torch.nn.Module) -> PostLoadFix | None: ...

    def refusal(self) -> str | None: ...

    def repair(self, loaded: Set[str] | None) -> None: ...


# Found in this order when the engine is created, and repaired in it after every load (each touches
# state of its own: a tied module's derived state, the logits processor's call, a MoE kernel's layout).
POST_LOAD_FIXES: tuple[type[PostLoadFix], ...] = (TiedModules, HeadBias, ExpertKernels)


class PostLoadFixes:
    """The post-load fixes one model needs (``of``: looked up once, when the engine is created)."""

    def __init__(self, fixes: Sequence[PostLoadFix]):
        self.fixes = tuple(fixes)

    @classmethod
    def of(cls, model: torch.nn.Module, kinds: Iterable[type[PostLoadFix]] = POST_LOAD_FIXES) -> PostLoadFixes:
        """Every fix of ``kinds`` that ``model`` needs; logs at once when every version will be refused."""
        found = cls([fix for fix in (kind.of(model) for kind in kinds) if fix is not None])
        refusal = found.refusal()
        if refusal is not None:
            log.warning("asyncsync: every version will be refused: %s", refusal)
        return found

    def refusal(self) -> str | None:
        """Why every version would be refused, or None."""
        reasons = [r for r in (fix.refusal() for fix in self.fixes) if r is not None]
        return "; ".join(reasons) if reasons else None

    def check_plan(self) -> None:
        """At the trainer's ``connect``: raise ``VersionRejected`` when no version could ever be applied."""
        refusal = self.refusal()
        if refusal is not None:
            raise VersionRejected(f"this engine refuses every version: {refusal}")

    def check(self, version: int) -> None:
        """Raise ``VersionRejected`` when the model could not follow ``version``: called before the
        model is touched, so the previous weights keep serving."""
        refusal = self.refusal()
        if refusal is not None:
            raise VersionRejected(f"version {version} rejected: {refusal}")

    def repair(self, loaded: Iterable[str] | None) -> None:
        """After a load: every fix brought up to the weights just loaded, in ``POST_LOAD_FIXES`` order."""
        names = None if loaded is None else frozenset(loaded)
        for fix in self.fixes:
            fix.repair(names)
