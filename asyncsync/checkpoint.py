"""Layouts: how the tensors a model holds map to the tensors an engine loads, in conversion groups.

transformers >= 5 holds some weights in another layout than its checkpoints: MoE experts fused into
one ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` and one ``down_proj`` ``[E, H, I]`` per layer, where
the checkpoint, and every engine's ``load_weights``, have ``mlp.experts.{e}.gate_proj.weight`` and
friends (``conversion_mapping.py`` lists about thirty families). Both directions here are
transformers' own code, so nothing in asyncsync knows a family:

* ``CheckpointStage`` (to the checkpoint): ``revert_weight_conversion``, what ``save_pretrained``
  runs. It follows the conversions the model was loaded with (``model._weight_conversions``), so a
  model loaded from an already-fused checkpoint keeps its fused names.
* ``to_memory`` (to the model's memory layout: how the reference server applies a version): the
  same function over the reversed conversions, i.e. the reverse of the reverse.

A ``Conversion`` chains stages and is planned once, on meta tensors (no memory, no copy): which
source tensors must be converted together (a ``Group``: one layer's fused experts), the names,
dtypes and shapes they become, whether a group is a plain rename (sent as the source tensor itself,
never called per version) and how many bytes converting it allocates (``scratch_bytes``: the
gate/up split of fused experts copies, ``down_proj``'s per-expert slices are views). Every version
then runs ``apply`` per group on the live tensors: nothing converted is kept between versions
(SkyRL #1345: a conversion cache kept across syncs served stale weights), only the plan is.
"""

from __future__ import annotations

import logging
import types
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from asyncsync.protocol.specs import TensorSpec

log = logging.getLogger(__name__)

Tensors = dict[str, torch.Tensor]


class LayoutError(ValueError):
    """A model's layout cannot be planned (its conversion fails or does not split into groups that
    reproduce it); the message says which tensors and what to do."""


@dataclass(frozen=True)
class Group:
    """Source tensors converted together, and what they become.

    ``renamed``: one source that is sent as it is under ``targets[0].name`` (the tensor itself, no
    conversion call per version). ``scratch_bytes``: what one ``apply`` of this group allocates
    beyond views of its sources (copies), freed once its targets are packed."""

    sources: tuple[str, ...]
    targets: tuple[TensorSpec, ...]
    renamed: bool
    scratch_bytes: int

    @property
    def target_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.targets)


class Stage(ABC):
    """One step of a conversion: a function of a dict of tensors that works on any union of whole
    groups of its input names (``partition``), returning the converted dict."""

    @abstractmethod
    def __call__(self, tensors: Tensors) -> Tensors: ...

    def partition(self, meta: Tensors) -> list[tuple[str, ...]]:
        """The groups of input names this stage converts together. The default runs the stage once
        on everything: a name whose tensor comes out as it went in is a group of its own (kept or
        renamed). The others are run alone: names whose lone runs produce a common output name
        belong together (the reverse of a concatenation, say), and names that cannot be converted
        alone form one group. ``Conversion.plan`` checks that the groups reproduce the whole run."""
        passed = {id(t) for t in self(dict(meta)).values()}
        groups = [(n,) for n, t in meta.items() if id(t) in passed]
        rest = _Sets([n for n, t in meta.items() if id(t) not in passed])
        producer: dict[str, str] = {}
        needy: list[str] = []
        for name in rest.names:
            try:
                outputs = self({name: meta[name]})
            except Exception:  # noqa: BLE001 - a conversion that needs its partners raises anything
                needy.append(name)
                continue
            for out in outputs:
                rest.join(producer.setdefault(out, name), name)
        for a, b in zip(needy, needy[1:]):
            rest.join(a, b)
        return groups + [tuple(g) for g in rest.groups()]


class _Sets:
    """Disjoint sets of names (union-find): which names are converted together."""

    def __init__(self, names: list[str]):
        self.names = names
        self._parent = {n: n for n in names}

    def _root(self, n: str) -> str:
        while self._parent[n] != n:
            self._parent[n] = self._parent[self._parent[n]]
            n = self._parent[n]
        return n

    def join(self, a: str, b: str) -> None:
        self._parent[self._root(b)] = self._root(a)

    def groups(self) -> list[list[str]]:
        """Every set, each in the names' order, ordered by its first name."""
        out: dict[str, list[str]] = {}
        for name in self.names:
            out.setdefault(self._root(name), []).append(name)
        return list(out.values())


class CheckpointStage(Stage):
    """A transformers model's tensors (names relative to it) to its checkpoint layout, by
    ``transformers.core_model_loading.revert_weight_conversion`` (what ``save_pretrained`` does)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def __call__(self, tensors: Tensors) -> Tensors:
        from transformers.core_model_loading import revert_weight_conversion

        with torch.no_grad():
            return dict(revert_weight_conversion(self.model, dict(tensors)))


def to_memory(model: torch.nn.Module, tensors: Tensors) -> Tensors:
    """Checkpoint tensors (one whole group of ``CheckpointStage``'s targets, or all of them) in the
    layout ``model`` holds in memory: the conversions ``revert_weight_conversion`` undoes for it, run
    by that same function once reversed, so that its reverse is the load."""
    conversions = loaded_conversions(model)
    if conversions is None:
        return dict(tensors)
    from transformers.core_model_loading import revert_weight_conversion

    reversed_model = types.SimpleNamespace(_weight_conversions=[c.reverse_transform() for c in conversions],
                                           config=model.config)
    with torch.no_grad():
        return dict(revert_weight_conversion(reversed_model, dict(tensors)))  # type: ignore[arg-type]


def loaded_conversions(model: torch.nn.Module) -> list[Any] | None:
    """The conversions ``revert_weight_conversion`` undoes for ``model``, chosen as it chooses them:
    those the model was loaded with, else its family's defaults without prefix changes (a model
    built from a config was never loaded, so no prefix was removed); None when there are none."""
    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange

        conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(c, PrefixChange)]
    return list(conversions) or None


def is_transformers_model(module: torch.nn.Module) -> bool:
    """True for a transformers ``PreTrainedModel`` (without importing transformers: a module cannot
    be one unless transformers was imported)."""
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.") for c in type(module).__mro__)


class Conversion:
    """Stages run in order; planned once on meta tensors into ``Group``s, applied per group."""

    def __init__(self, stages: Sequence[Stage]):
        self.stages = tuple(stages)

    def apply(self, tensors: Tensors) -> Tensors:
        """Every stage on ``tensors`` (a union of whole groups)."""
        for stage in self.stages:
            tensors = stage(tensors)
        return tensors

    def plan(self, meta: Tensors) -> tuple[Group, ...]:
        """The groups of ``meta`` (name -> meta tensor of the source's global dtype and shape), in
        the sources' order; each is checked to convert alone into exactly the specs the whole
        conversion gives its targets, so applying group by group equals applying it once."""
        if not self.stages:
            return tuple(Group((n,), (TensorSpec.of(n, t),), True, 0) for n, t in meta.items())
        order = {name: i for i, name in enumerate(meta)}
        origin = {name: name for name in meta}  # a stage's input name -> the source it comes from
        together = _Sets(list(meta))
        current = dict(meta)
        for stage in self.stages:
            produced: Tensors = {}
            for part in stage.partition(current):
                sources = [origin[n] for n in part]
                for s in sources[1:]:
                    together.join(sources[0], s)
                for name, t in stage({n: current[n] for n in part}).items():
                    if name in produced:
                        raise LayoutError(f"two conversion groups both produce '{name}': the layout cannot be "
                                          "converted group by group; pass convert= with your own conversion")
                    produced[name], origin[name] = t, sources[0]
            current = produced
        whole = self.apply(dict(meta))
        passed = {id(t): name for name, t in whole.items()}  # a source that came through every stage as it is
        groups = []
        for m in together.groups():
            sources = tuple(sorted(m, key=order.__getitem__))
            target = passed.get(id(meta[sources[0]])) if len(sources) == 1 else None
            if target is not None:
                groups.append(Group(sources, (TensorSpec.of(target, meta[sources[0]]),), True, 0))
            else:
                groups.append(self._group(sources, meta, whole))
        covered = [n for g in groups for n in g.target_names]
        if sorted(covered) != sorted(whole):
            missing = sorted(set(whole) ^ set(covered))[:3]
            raise LayoutError(f"converting group by group does not give the whole conversion (e.g. {missing}); "
                              "pass convert= with your own conversion")
        return tuple(sorted(groups, key=lambda g: order[g.sources[0]]))

    def _group(self, sources: tuple[str, ...], meta: Tensors, whole: Tensors) -> Group:
        inputs = {n: meta[n] for n in sources}
        out = self.apply(dict(inputs))
        for name, t in out.items():
            w = whole.get(name)
            if w is None or w.dtype != t.dtype or w.shape != t.shape:
                raise LayoutError(f"{list(sources)[:3]} convert alone to '{name}' {t.dtype} {tuple(t.shape)}, but the "
                                  "whole model's conversion gives it otherwise; pass convert= with your own conversion")
        targets = tuple(TensorSpec.of(n, t) for n, t in out.items())
        return Group(sources, targets, False, scratch_bytes(inputs.values(), out.values()))


def _root(t: torch.Tensor) -> torch.Tensor:
    while t._base is not None:
        t = t._base
    return t


def scratch_bytes(inputs: Iterable[torch.Tensor], outputs: Iterable[torch.Tensor]) -> int:
    """Bytes of the outputs that are not views of an input: the distinct tensors the conversion
    allocated (works on meta tensors, whose views keep their ``_base``)."""
    own = {id(_root(t)) for t in inputs}
    fresh = {id(r): r for r in map(_root, outputs) if id(r) not in own}
    return sum(r.numel() * r.element_size() for r in fresh.values())


def meta_tensors(named: Mapping[str, torch.Tensor]) -> Tensors:
    """Meta tensors of each tensor's global dtype and shape (a DTensor's, not its shard's)."""
    return {n: torch.empty(tuple(t.shape), dtype=t.dtype, device="meta") for n, t in named.items()}
