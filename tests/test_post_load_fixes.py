"""``receivers/vllm/fixes.py``: vLLM's post-load fixes as one list with one interface, without vLLM.
Each fix is asked once whether the model needs it; a fix's refusal refuses every version, at the
trainer's connect and before each version touches the model; after each load every fix is repaired
in the list's order with the names the load returned. The real fixes run against vLLM in
``tests/test_vllm_integration.py`` (in-process) and ``tests/test_vllm_models.py`` (served)."""

from __future__ import annotations

import logging
from collections.abc import Set

import pytest
import torch

from asyncsync.protocol.admission import VersionRejected
from asyncsync.receivers.vllm.experts import ExpertKernels
from asyncsync.receivers.vllm.fixes import POST_LOAD_FIXES, PostLoadFixes
from asyncsync.receivers.vllm.head import HeadBias
from asyncsync.receivers.vllm.ties import TiedModules

calls: list[tuple[str, frozenset[str] | None]] = []


class Repaired:
    """A fix every model needs, which records its repairs."""

    name = "repaired"
    why: str | None = None

    @classmethod
    def of(cls, model: torch.nn.Module) -> Repaired | None:
        return cls()

    def refusal(self) -> str | None:
        return self.why

    def repair(self, loaded: Set[str] | None) -> None:
        calls.append((self.name, None if loaded is None else frozenset(loaded)))


class Unneeded(Repaired):
    name = "unneeded"

    @classmethod
    def of(cls, model: torch.nn.Module) -> Repaired | None:
        return None


class Refusing(Repaired):
    name = "refusing"
    why = "a stale layer that cannot be repaired"


def test_the_list_declares_every_fix_once_each_with_the_one_interface():
    assert POST_LOAD_FIXES == (TiedModules, HeadBias, ExpertKernels)
    for kind in POST_LOAD_FIXES:
        assert all(callable(getattr(kind, method, None)) for method in ("of", "refusal", "repair")), kind


def test_only_the_fixes_a_model_needs_are_kept_and_repaired_in_order_with_the_loaded_names():
    calls.clear()
    fixes = PostLoadFixes.of(torch.nn.Linear(2, 2), (Repaired, Unneeded, Repaired))  # type: ignore[arg-type]
    assert [type(f) for f in fixes.fixes] == [Repaired, Repaired]
    assert fixes.refusal() is None
    fixes.check_plan()
    fixes.check(3)
    fixes.repair(iter(["w", "b"]))  # load_weights may return any iterable: read once, shared by every fix
    fixes.repair(None)
    assert calls == [("repaired", frozenset({"w", "b"}))] * 2 + [("repaired", None)] * 2


def test_a_refusal_refuses_every_version_at_connect_and_before_each_load(caplog):
    with caplog.at_level(logging.WARNING, logger="asyncsync.receivers.vllm.fixes"):
        fixes = PostLoadFixes.of(torch.nn.Linear(2, 2), (Repaired, Refusing, Refusing))  # type: ignore[arg-type]
    assert "every version will be refused: a stale layer" in caplog.text, "said at start-up"
    assert fixes.refusal() == "a stale layer that cannot be repaired; a stale layer that cannot be repaired"
    with pytest.raises(VersionRejected, match="^this engine refuses every version: a stale layer"):
        fixes.check_plan()
    with pytest.raises(VersionRejected, match="^version 7 rejected: a stale layer"):
        fixes.check(7)


def test_a_model_with_no_tie_and_no_head_bias_needs_neither_fix():
    """Both are judged without vLLM (the experts fix asks vLLM for its method class)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    assert TiedModules.of(model) is None
    assert HeadBias.of(model) is None
