"""The (name, tensor) view of the trainer's weights for one version, read fresh every time.

Only the bucket index is cached between versions (``BucketPlan``); the tensors are looked up again
for every version, so a parameter object replaced between syncs is what gets sent. A module is read
by walking its tree (parameters and persistent buffers under their ``state_dict`` names), not through
``state_dict()``: state-dict hooks may issue collectives (FSDP's do), and this view is also read
from the sync's own threads, which must never join the trainer's collectives.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

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
