"""The (name, tensor) view of the trainer's weights for one version, read fresh every time.

Only indexes are cached between versions (the ``BucketPlan``, and where each tensor lives in the
module); the tensors are looked up again for every version, so a parameter object replaced between
syncs is what gets sent. The view is read on the trainer's thread, at ``publish``, by a
``WeightsReader``: never through ``state_dict()`` (its hooks may issue collectives: FSDP's do) and
never from the sync's own threads (FSDP swaps a module's registered parameters between sharded and
unsharded forms while it computes; at ``publish``, after the optimizer step, they are the sharded ones).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.nn.modules import module as nn_module

from asyncsync.protocol.specs import BucketPlan, distinct_tensors

Weights = torch.nn.Module | Mapping[str, torch.Tensor]


class LayoutChanged(ValueError):
    """The weights' names, dtypes or shapes no longer match the plan made at ``connect``."""


def module_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers by their ``state_dict`` names, in ``state_dict`` order, with
    tied (shared) ones under every name, as ``state_dict(keep_vars=True)`` lists them but without its hooks."""
    out: dict[str, torch.Tensor] = {}
    for prefix, m in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for name, p in m._parameters.items():
            if p is not None:
                out[dot + name] = p
        for name, b in m._buffers.items():
            if b is not None and name not in m._non_persistent_buffers_set:
                out[dot + name] = b
    return out


class WeightsReader:
    """Reads the view of one module (or of mappings) on the trainer's thread, in O(tensors) lookups.

    For a module, one walk of the tree finds which tensors are sent under which names and which
    module attribute holds each (tied ones once); every ``read`` then looks each tensor up again from
    its module. The walk is redone only after the tree changed: torch's global registration hooks
    report any submodule, parameter or buffer (re)registered on a module of the tree, including a
    parameter replaced by attribute assignment. A mapping is read as a shallow copy; its ties are
    resolved by ``WeightsView.tensors`` on whichever thread packs it.
    """

    def __init__(self) -> None:
        self._module: torch.nn.Module | None = None
        self._index: list[tuple[str, dict[str, Any], str]] = []  # (name, module._parameters/_buffers, key)
        self._members: set[int] = set()
        self._stale = True
        self._hooks: list[Any] = []

    def _on_registration(self, module: torch.nn.Module, name: str, value: Any) -> None:
        if id(module) in self._members:
            self._stale = True

    def read(self, weights: Weights) -> WeightsView:
        if not isinstance(weights, torch.nn.Module):
            return WeightsView(dict(weights), resolved=False)
        if weights is not self._module or self._stale:
            self._walk(weights)
        return WeightsView({name: table[key] for name, table, key in self._index}, resolved=True)

    def _walk(self, module: torch.nn.Module) -> None:
        if not self._hooks:
            self._hooks = [register(self._on_registration) for register in (
                nn_module.register_module_parameter_registration_hook, nn_module.register_module_buffer_registration_hook,
                nn_module.register_module_module_registration_hook)]
        kept = named_tensors(module)
        index, members = [], set()
        for prefix, m in module.named_modules(remove_duplicate=False):
            members.add(id(m))
            dot = f"{prefix}." if prefix else ""
            for table in (m._parameters, m._buffers):
                for key in table:
                    name = dot + key
                    if name in kept and kept[name] is table[key]:
                        index.append((name, table, key))
        self._module, self._index, self._members, self._stale = module, index, members, False

    def close(self) -> None:
        """Remove the global hooks; the next ``read`` of a module walks it again."""
        for handle in self._hooks:
            handle.remove()
        self._hooks, self._module, self._members, self._stale = [], None, set(), True


class WeightsView:
    """The tensors of one version as read at ``publish``; ``tensors()`` gives the name -> tensor map sent."""

    def __init__(self, named: dict[str, torch.Tensor], resolved: bool):
        self._named, self._resolved = named, resolved

    def tensors(self) -> dict[str, torch.Tensor]:
        if not self._resolved:
            self._named, self._resolved = distinct_tensors(self._named), True
        return self._named


def named_tensors(weights: Weights) -> dict[str, torch.Tensor]:
    """Fresh name -> tensor map of a module or a mapping; tensors tied to an earlier name are dropped
    (sent once, see ``distinct_tensors``)."""
    return distinct_tensors(module_tensors(weights) if isinstance(weights, torch.nn.Module) else weights)


def check_layout(plan: BucketPlan, named: Mapping[str, torch.Tensor]) -> None:
    """Raise ``LayoutChanged`` unless ``named`` matches the plan: the one policy of both modes. Servers
    verify every version against the model they serve, so a changed layout is refused, not re-planned."""
    problem = plan.mismatch(named)
    if problem is not None:
        raise LayoutChanged(f"the weights changed since connect(): {problem}; servers only accept the layout "
                            "they serve, so call connect() again if the model really changed")


def weights_device(named: Mapping[str, torch.Tensor]) -> torch.device:
    """The one device every tensor lives on: it picks the data-plane backend and the pack backend."""
    devices = {t.device for t in named.values()}
    if len(devices) != 1:
        raise ValueError(f"the weights are spread over {sorted(map(str, devices))}; asyncsync sends weights that "
                         "live on one device (move them, or pass a mapping of tensors on one device)")
    return devices.pop()
