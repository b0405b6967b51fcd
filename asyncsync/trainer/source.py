"""The (name, tensor) view of the trainer's weights for one version, read fresh every time.

Only indexes are cached between versions (the ``BucketPlan``, which names are sent, and where each
tensor lives in the module); the tensors are looked up again for every version, so a parameter
object replaced between syncs is what gets sent. The view is read on the trainer's thread, at
``publish``, by a ``WeightsReader``: never through ``state_dict()`` (its hooks may issue collectives:
FSDP's do) and never from the sync's own threads (FSDP swaps a module's registered parameters
between sharded and unsharded forms while it computes; at ``publish``, after the optimizer step, they
are the sharded ones).

Which names are sent is decided once, at ``connect``, by ``TiedNames``: a tied weight
(``lm_head.weight`` tied to ``model.embed_tokens.weight``) is sent once, under the name the servers
load it by, whether a version is published as the module or as a detached copy of its state dict.

What the trainer hands ``connect`` and ``publish`` is checked, so that bad input raises a clear error
and never reaches a compiled pack:

- ``all_tensors`` (``connect``, ``publish`` itself): a module or a mapping, else ``TypeError``;
- ``check_tensors`` on every tensor of a version, once (about 2 us each): sharded tensors in a
  single-process sync (``check_not_sharded``; a sharded trainer's ranks check their local shards),
  then anything a pack could not read safely (``packing.checks.memory_problem``: tensor subclasses, meta tensors,
  freed or shrunk storages). It runs at ``connect``, when ``WeightsReader`` walks a module (once per
  module object and after any re-registration: in a single-process sync, ``fully_shard`` swapping in
  DTensors is refused at ``publish``, which otherwise stays O(1) beyond its lookups), and where a version is read for
  packing (``WeightsView.tensors``: the async snapshot, a blocking ``publish``), which is also where a
  mapping's tensors are checked, a mapping being usually a new object at each ``publish``;
- ``check_layout`` (right before a version is packed): the plan's names, dtypes and shapes, and the
  device the buffers live on.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.modules import module as nn_module

from asyncsync.packing.checks import UnpackableTensor, check_tensor
from asyncsync.protocol.specs import BucketPlan, storage_aliases
from asyncsync.trainer.layout import LayoutView, WeightLayout

log = logging.getLogger(__name__)

Weights = torch.nn.Module | Mapping[str, torch.Tensor]


class LayoutChanged(ValueError):
    """The weights' names, dtypes or shapes no longer match the plan made at ``connect``."""


class ShardedWeightsUnsupported(NotImplementedError):
    """The weights hold a DTensor, but this ``WeightSync`` runs in one process: a sharded trainer's
    weights are sent by all of its ranks together (``trainer_ranks: auto``)."""


Convert = Callable[[dict[str, torch.Tensor]], Mapping[str, torch.Tensor]]


def _dtensor_class() -> type | None:
    """DTensor, if anything imported it (a tensor cannot be one otherwise): importing it here would
    cost every trainer torch.distributed.tensor's start-up."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's data of a tensor of the view: a DTensor's local shard, or the tensor itself."""
    dtensor = _dtensor_class()
    return t.to_local() if dtensor is not None and isinstance(t, dtensor) else t


def check_not_sharded(named: Mapping[str, object]) -> None:
    """Refuse sharded weights in a single-process sync, naming the first DTensor and what to do.

    A DTensor holds only this rank's shard (its ``data_ptr()`` is 0): one process alone cannot send
    it. Every rank of the trainer can, together (``trainer.shards``)."""
    dtensor = _dtensor_class()
    if dtensor is None:
        return
    for name, t in named.items():
        if isinstance(t, dtensor):
            raise ShardedWeightsUnsupported(
                f"'{name}' is a DTensor (sharded over {t.device_mesh} as {list(t.placements)}), but this WeightSync runs "
                "in one process, which holds only its own shards. Sync from every rank of the trainer together: "
                "initialize torch.distributed on every rank, keep weight_sync.trainer_ranks: auto (the default), and "
                "call connect(), publish(), wait_snapshot() and close() on every rank, as a collective")


def check_tensors(named: Mapping[str, object], sharded: bool = False) -> None:
    """Every tensor of a version: ``ShardedWeightsUnsupported`` for a DTensor (unless ``sharded``: a
    sharded trainer's, whose local shards are checked), ``UnpackableTensor`` naming anything else a
    pack could not read safely. Before ties are looked for: they compare data pointers, which such
    tensors do not have."""
    if not sharded:
        check_not_sharded(named)
    for name, t in named.items():
        check_tensor(name, local_part(t) if sharded and isinstance(t, torch.Tensor) else t)


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


def all_tensors(weights: Weights) -> dict[str, torch.Tensor]:
    """Every tensor of a module (``module_tensors``) or a mapping, tied ones under each of their names;
    ``TypeError`` (``ShardedWeightsUnsupported`` for a DTensor) for anything else."""
    if isinstance(weights, torch.nn.Module):
        return module_tensors(weights)
    if isinstance(weights, Mapping):
        return dict(weights)
    check_not_sharded({"the weights": weights})
    raise TypeError(f"expected the weights as a torch.nn.Module or a mapping of name -> tensor, got a "
                    f"{type(weights).__name__}")


def declared_ties(module: torch.nn.Module) -> dict[str, str]:
    """alias -> target, for the ties the model declares: transformers >= 5 lists them in
    ``all_tied_weights_keys`` (empty when untied); older versions declare only
    ``config.tie_word_embeddings``, which ties the output embeddings to the input embeddings. Names
    are prefixed for a transformers model nested inside another module."""
    out: dict[str, str] = {}
    for prefix, m in module.named_modules():
        keys = getattr(m, "all_tied_weights_keys", None)
        if isinstance(keys, Mapping):
            pairs = dict(keys)
        elif getattr(getattr(m, "config", None), "tie_word_embeddings", False):
            pairs = _word_embeddings_tie(m)
        else:
            continue
        dot = f"{prefix}." if prefix else ""
        out.update({dot + alias: dot + target for alias, target in pairs.items()})
    return out


def _word_embeddings_tie(m: torch.nn.Module) -> dict[str, str]:
    try:
        source, tied = m.get_input_embeddings(), m.get_output_embeddings()  # type: ignore[operator]
    except (AttributeError, NotImplementedError):
        return {}
    names = {id(sub): name for name, sub in m.named_modules()}
    if tied is None or source is tied or id(source) not in names or id(tied) not in names:
        return {}
    return {f"{names[id(tied)]}.weight": f"{names[id(source)]}.weight"}


@dataclass(frozen=True)
class TiedNames:
    """The names that are not sent because each is a tie of a sent tensor: alias -> that tensor's name.

    Decided once, at ``connect``. An alias is a name whose tensor is an earlier name's (``state_dict``
    lists a tied weight under each of its names), or one of a pair of equal dtype and shape that the
    model declares tied (``declared_ties``: known even in a detached copy of the state dict, where
    nothing shares storage). An alias is sent only when a server expects it by name (a checkpoint
    that stores the tied weight twice); ``expected`` is None when no server can tell, and then no
    alias is sent, as a checkpoint saved from a tied model stores none. Only aliases are ever left
    out: any other name is sent, and a server that does not know it refuses the version.
    """

    unsent: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def decide(cls, weights: Weights, expected: Collection[str] | None) -> TiedNames:
        named = all_tensors(weights)
        aliases = storage_aliases({name: local_part(t) for name, t in named.items()})  # a DTensor by its shard
        if isinstance(weights, torch.nn.Module):
            for alias, target in declared_ties(weights).items():
                target = aliases.get(target, target)  # the name that is sent
                if alias != target and alias not in aliases and _same_spec(named, alias, target):
                    aliases[alias] = target
        unsent = {alias: target for alias, target in aliases.items() if expected is None or alias not in expected}
        if unsent:
            log.info("tied weights sent once: %s", ", ".join(f"{a} -> {t}" for a, t in unsent.items()))
        return cls(unsent)

    def drop(self, named: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``named`` without the unsent aliases. An alias whose dtype or shape no longer equals its
        target's is kept: it is not that tie any more, and the layout check names it."""
        return {name: t for name, t in named.items()
                if name not in self.unsent or not _same_spec(named, name, self.unsent[name])}


def _same_spec(named: Mapping[str, torch.Tensor], a: str, b: str) -> bool:
    x, y = named.get(a), named.get(b)
    return x is not None and y is not None and x.dtype == y.dtype and x.shape == y.shape


class WeightsReader:
    """Reads the view of one module (or of mappings) on the trainer's thread, in O(tensors) lookups.

    For a module, one walk of the tree finds which tensors are sent under which names (all but the
    ``ties`` left out) and which module attribute holds each; every ``read`` then looks each tensor
    up again from its module. The walk is redone only after the tree changed: torch's global
    registration hooks report any submodule, parameter or buffer (re)registered on a module of the
    tree, including a parameter replaced by attribute assignment. A mapping is read as a shallow
    copy; its ties are left out by ``WeightsView.tensors`` on whichever thread packs it.

    With ``convert`` (a user function from the trainer's names and layouts to the servers': fused
    qkv to q/k/v, stacked experts, torch.compile's ``_orig_mod.`` prefix), every ``read`` runs it on
    every tensor, here, on the trainer's thread: whatever it builds is rebuilt for every version and
    nothing of it is cached (a stale conversion cache once served old weights); only the plan is.
    ``sharded``: a sharded trainer's rank, whose DTensors are checked by their local shards.
    """

    def __init__(self, ties: TiedNames = TiedNames(), sharded: bool = False, convert: Convert | None = None,
                 layout: WeightLayout | None = None) -> None:
        self.ties, self.sharded, self.convert = ties, sharded, convert
        self.layout = layout  # the engines' layout: before ``convert`` (over every tensor), else over the names sent
        self._module: torch.nn.Module | None = None
        self._index: list[tuple[str, dict[str, Any], str]] = []  # (name, module._parameters/_buffers, key)
        self._members: set[int] = set()
        self._stale = True
        self._hooks: list[Any] = []

    def _on_registration(self, module: torch.nn.Module, name: str, value: Any) -> None:
        if id(module) in self._members:
            self._stale = True

    def read(self, weights: Weights) -> WeightsView:
        """The view of ``weights``; raises what ``all_tensors`` raises, and what ``check_tensors``
        raises for a module being walked."""
        if self.convert is not None:
            return WeightsView(converted(weights, self.convert, self.layout), self.ties, self.sharded)
        if not isinstance(weights, torch.nn.Module):
            return WeightsView(all_tensors(weights), self.ties, self.sharded, self.layout)
        if weights is not self._module or self._stale:
            self._walk(weights)
        return WeightsView({name: table[key] for name, table, key in self._index}, None, self.sharded, self.layout)

    def _walk(self, module: torch.nn.Module) -> None:
        if not self._hooks:
            self._hooks = [register(self._on_registration) for register in (
                nn_module.register_module_parameter_registration_hook, nn_module.register_module_buffer_registration_hook,
                nn_module.register_module_module_registration_hook)]
        named = module_tensors(module)
        check_tensors(named, self.sharded)
        kept = self.ties.drop(named)
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
    """The tensors of one version as read at ``publish``; ``tensors()`` gives the name -> tensor map
    sent, every tensor checked (``check_tensors``) the first time, on the thread that packs it: in
    the engines' layout (``layout``), whose converted groups are produced only as they are packed."""

    def __init__(self, named: dict[str, torch.Tensor], ties: TiedNames | None = None, sharded: bool = False,
                 layout: WeightLayout | None = None):
        self._named, self._ties = named, ties  # ties: still to be left out of ``named`` (a mapping's)
        self._sharded, self._checked, self._layout = sharded, False, layout

    def tensors(self) -> Mapping[str, torch.Tensor]:
        if not self._checked:
            check_tensors(self._named, self._sharded)
            self._checked = True
        if self._ties is not None:
            self._named, self._ties = self._ties.drop(self._named), None
        return self._named if self._layout is None else self._layout.view(self._named)


def converted(weights: Weights, convert: Convert, layout: WeightLayout | None = None) -> dict[str, torch.Tensor]:
    """``convert`` applied to every tensor of ``weights`` (in the engines' ``layout`` first, when
    given); a ``TypeError`` names a result that is not a mapping of tensors."""
    named = all_tensors(weights)
    out = convert(dict(layout.view(named)) if layout is not None else named)
    if not isinstance(out, Mapping):
        raise TypeError(f"the conversion function returned a {type(out).__name__}; it must return a mapping of "
                        "name -> tensor (the names and layouts the servers load)")
    return dict(out)


def named_tensors(weights: Weights) -> dict[str, torch.Tensor]:
    """Fresh name -> tensor map of a module or a mapping as sent to servers that do not report the
    names they expect: tied weights once (``TiedNames``); every tensor checked (``check_tensors``)."""
    named = all_tensors(weights)
    check_tensors(named)
    return TiedNames.decide(weights, None).drop(named)


def check_layout(plan: BucketPlan, named: Mapping[str, torch.Tensor], device: torch.device) -> None:
    """Raise ``LayoutChanged`` unless ``named`` matches the plan: the one policy of both modes. Servers
    verify every version against the model they serve, so a changed layout is refused, not re-planned.
    A tensor that moved off ``device`` (where the buffers were allocated) raises ``UnpackableTensor``."""
    if isinstance(named, LayoutView):  # its targets are made from its sources as planned: check those
        named, problem = named.sources, named.layout.source_mismatch(named.sources)
    else:
        problem = plan.mismatch(named)
    if problem is not None:
        raise LayoutChanged(f"the weights changed since connect(): {problem}; servers only accept the layout "
                            "they serve, so call connect() again if the model really changed")
    for name, t in named.items():
        if t.device != device:
            raise UnpackableTensor(f"tensor '{name}' is on {t.device}, but the weights were on {device} at connect(); "
                                   "keep every tensor on that device (the sync's buffers live there)")


def weights_device(named: Mapping[str, torch.Tensor]) -> torch.device:
    """The one device every tensor lives on: it picks the data-plane backend and the pack backend."""
    devices = {t.device for t in named.values()}
    if len(devices) != 1:
        raise ValueError(f"the weights are spread over {sorted(map(str, devices))}; asyncsync sends weights that "
                         "live on one device (move them, or pass a mapping of tensors on one device)")
    return devices.pop()
