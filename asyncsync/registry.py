"""Lazy registries of module paths: a name maps to ``"package.module:Attribute"``, imported on first use.

Configuration checks names against a registry when it loads, before anything behind a name is
imported (importing a pack backend may compile code; importing an engine client pulls in its HTTP
stack). The registries sit below everything that uses them: ``config`` validates against them,
``engines`` and ``packing`` load from them, and this module imports nothing of asyncsync.
"""

from __future__ import annotations

import importlib
from typing import Any


class LazyRegistry:
    """Names of one kind of plug-in (``what``, for messages) and where each lives."""

    def __init__(self, what: str, targets: dict[str, str]):
        self.what = what
        self.targets = dict(targets)

    def register(self, name: str, target: str) -> None:
        """Register ``name`` as ``"package.module:Attribute"``; nothing is imported now."""
        if not name or ":" not in target:
            raise ValueError(f"registering {self.what} {name!r} -> {target!r}: expected a name and "
                             "'package.module:Attribute'")
        self.targets[name] = target

    def names(self) -> list[str]:
        return sorted(self.targets)

    def load(self, name: str) -> Any:
        """Import what ``name`` points at; ``KeyError`` for a name that is not registered."""
        module, attribute = self.targets[name].split(":")
        return getattr(importlib.import_module(module), attribute)


# The engine clients by ``servers[].kind`` (asyncsync.engines builds them; config checks the kinds).
ENGINES = LazyRegistry("engine kind", {
    "reference": "asyncsync.engines.reference:ReferenceEngine",
    "vllm": "asyncsync.engines.vllm:VllmEngine",
    "sglang": "asyncsync.engines.sglang:SglangEngine",
})
