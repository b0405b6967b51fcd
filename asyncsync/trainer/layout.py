"""The layout servers load, from the tensors the trainer holds: decided at ``connect``, produced per version.

Engines load checkpoints: vLLM's and SGLang's ``load_weights`` take the names, dtypes and shapes
``save_pretrained`` writes. What a trainer holds differs in three ways, each undone here by the
library that introduced it, never by a table per model family:

1. **PEFT LoRA** (``peft.get_peft_model``): ``...q_proj.base_layer.weight`` plus ``lora_A`` /
   ``lora_B``. The engine gets the merged weight (``PeftMerge``: the base plus each active adapter's
   ``get_delta_weight``, as ``merge_and_unload`` computes it), and the trainer's module is never
   merged or changed.
2. **Wrappers** (``Unwrap``): ``torch.compile``'s ``_orig_mod.``, DDP's ``module.``, activation
   checkpointing's ``_checkpoint_wrapped_module.``, FSDP1's ``_fsdp_wrapped_module.``, PEFT's
   ``base_model.model.`` and ``.base_layer``, ``modules_to_save``: one place strips them all, by
   the module types that add them (FSDP2's ``fully_shard`` adds none).
3. **transformers' in-memory layouts** (``asyncsync.checkpoint.CheckpointStage``): fused MoE experts
   and the like, reverted by transformers' own ``revert_weight_conversion``.

Lifecycle (``WeightSync`` does this)::

    layout = WeightLayout.of(model, all_tensors(model))   # connect: planned on meta tensors
    plan = BucketPlan.from_groups(layout.target_groups(), ...)   # the plan holds checkpoint names
    for version in versions:
        named = layout.view(sources)        # a mapping of checkpoint names, produced lazily:
        pack(bucket, named)                 # each group converted when its first target is packed,
                                            # its copies dropped once its last one is

A plain rename costs nothing per version (the source tensor is sent under its checkpoint name);
a converted group allocates ``Group.scratch_bytes`` while its bucket is packed
(``WeightLayout.scratch_bytes``: the most at once, counted in the sync's memory metrics).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from asyncsync.checkpoint import CheckpointStage, Conversion, Group, LayoutError, Stage, Tensors, is_transformers_model, meta_tensors
from asyncsync.protocol.specs import Bucket, BucketPlan, TensorSpec

log = logging.getLogger(__name__)

# (module path prefix of the defining library, class name in the MRO, the attribute holding the
# wrapped module): a child under that attribute keeps its parent's name.
_WRAPPERS = (
    ("torch._dynamo", "OptimizedModule", "_orig_mod"),                   # torch.compile
    ("torch.nn.parallel", "DistributedDataParallel", "module"),
    ("torch.nn.parallel", "DataParallel", "module"),
    ("torch.distributed.algorithms._checkpoint", "ActivationWrapper", "_checkpoint_wrapped_module"),
    ("torch.distributed.fsdp", "FullyShardedDataParallel", "_fsdp_wrapped_module"),  # FSDP1
    ("deepspeed", "DeepSpeedEngine", "module"),
    ("peft", "PeftModel", "base_model"),
    ("peft", "BaseTuner", "model"),            # LoraModel & co.
    ("peft", "BaseTunerLayer", "base_layer"),  # a LoRA-wrapped Linear's own layer
)


def is_class(module: torch.nn.Module, library: str, cls: str) -> bool:
    return any(c.__name__ == cls and c.__module__.startswith(library) for c in type(module).__mro__)


def _wrapped_attribute(module: torch.nn.Module) -> str | None:
    return next((attr for library, cls, attr in _WRAPPERS if is_class(module, library, cls)), None)


def clean_paths(module: torch.nn.Module, base_only: bool = False) -> dict[str, str | None]:
    """Every submodule's path -> its path without wrapper segments (None: not sent, such as PEFT's
    ``original_module`` beside ``modules_to_save``, or an inactive adapter's copy there). With
    ``base_only`` (``lora: adapter``: the base the adapters apply to) PEFT's additions are not sent:
    a LoRA layer's adapter modules, and ``modules_to_save`` copies (the ``original_module`` is)."""
    out: dict[str, str | None] = {"": ""}
    for path, m in module.named_modules(remove_duplicate=False):
        clean = out[path]
        wrapped = _wrapped_attribute(m)
        dot = f"{path}." if path else ""
        if base_only and clean is not None and is_class(m, "peft.tuners.lora", "LoraLayer"):
            out.update({f"{dot}{attr}": None for attr in m._modules if attr != "base_layer"})
        if is_class(m, "peft", "ModulesToSaveWrapper"):  # original_module, modules_to_save.{adapter}
            out[f"{dot}original_module"] = clean if base_only else None
            out[f"{dot}modules_to_save"] = None if base_only else clean
            for adapter in m.modules_to_save:
                out[f"{dot}modules_to_save.{adapter}"] = clean if adapter in _active_adapters(m) and not base_only else None
        for attr in m._modules:
            child = f"{dot}{attr}"
            if child not in out:
                out[child] = None if clean is None else clean if attr == wrapped else f"{clean}.{attr}" if clean else attr
    return out


def _active_adapters(m: torch.nn.Module) -> list[str]:
    active = getattr(m, "active_adapters", None)
    if active is None:
        active = getattr(m, "active_adapter", [])
    return [active] if isinstance(active, str) else list(active)


class Unwrap(Stage):
    """Renames every tensor to its name without wrapper segments; drops what is not sent."""

    def __init__(self, module: torch.nn.Module, base_only: bool = False):
        paths = clean_paths(module, base_only)
        self.names: dict[str, str | None] = {}
        for path, m in module.named_modules(remove_duplicate=False):
            clean = paths.get(path)
            for table in (m._parameters, m._buffers):
                for key in table:
                    name = f"{path}.{key}" if path else key
                    self.names[name] = None if clean is None else (f"{clean}.{key}" if clean else key)

    @property
    def changes(self) -> bool:
        return any(new != old for old, new in self.names.items())

    def partition(self, meta: Tensors) -> list[tuple[str, ...]]:
        return [(n,) for n in meta]

    def __call__(self, tensors: Tensors) -> Tensors:
        out = {}
        for name, t in tensors.items():
            new = self.names.get(name, name)
            if new is not None:
                out[new] = t
        return out


class PeftMerge(Stage):
    """A PEFT LoRA layer's base weight merged with its active adapters (``base + get_delta_weight``
    per adapter, as PEFT's ``merge`` adds them), under the base weight's name; the adapters' own
    tensors are not sent. The layer itself is only read. Planned on meta tensors, where the merge
    has the base weight's dtype and shape."""

    def __init__(self, module: torch.nn.Module):
        self.layers: dict[str, torch.nn.Module] = {}  # base weight name -> its LoRA layer
        self.members: dict[str, tuple[str, ...]] = {}  # base weight name -> every tensor of the group
        for path, m in module.named_modules(remove_duplicate=False):
            if not is_class(m, "peft.tuners.lora", "LoraLayer"):
                continue
            dot = f"{path}." if path else ""
            base = f"{dot}base_layer.weight"
            variants = [a for a in _active_adapters(m) if a in getattr(m, "lora_variant", {})]
            biased = [a for a in _active_adapters(m) if getattr(m, "lora_bias", {}).get(a)]
            if variants or biased:
                raise LayoutError(f"'{path}': LoRA adapter(s) {variants or biased} use "
                                  f"{'a LoRA variant (DoRA, ...)' if variants else 'lora_bias'}, which asyncsync does not merge; "
                                  "send plain LoRA adapters, or pass convert= with your own merge")
            own = [f"{dot}{name}" for name, _ in m.named_parameters(recurse=True) if not name.startswith("base_layer.")]
            self.layers[base] = m
            self.members[base] = (base, *own)

    def partition(self, meta: Tensors) -> list[tuple[str, ...]]:
        grouped = {n for names in self.members.values() for n in names}
        out = [tuple(n for n in names if n in meta) for names in self.members.values()]
        return [g for g in out if g] + [(n,) for n in meta if n not in grouped]

    def __call__(self, tensors: Tensors) -> Tensors:
        out = {}
        drop = {n for base, names in self.members.items() if base in tensors for n in names[1:]}
        for name, t in tensors.items():
            if name in drop:
                continue
            layer = self.layers.get(name)
            out[name] = t if layer is None else self._merged(layer, t)
        return out

    @staticmethod
    def _merged(layer: Any, base: torch.Tensor) -> torch.Tensor:
        if base.is_meta:
            return torch.empty_like(base)
        with torch.no_grad():
            merged = base.detach().clone()
            if not layer.merged:  # a layer merged in place already holds its adapters in its base weight
                for adapter in _active_adapters(layer):
                    if adapter in layer.lora_A or adapter in getattr(layer, "lora_embedding_A", {}):
                        merged += layer.get_delta_weight(adapter)
            return merged


class Prefixed(Stage):
    """``stage`` on the tensors under ``prefix`` (names relative to it), the others passed through."""

    def __init__(self, stage: Stage, prefix: str):
        self.stage, self.prefix = stage, prefix

    def _split(self, tensors: Tensors) -> tuple[Tensors, Tensors]:
        inner = {n[len(self.prefix):]: t for n, t in tensors.items() if n.startswith(self.prefix)}
        rest = {n: t for n, t in tensors.items() if not n.startswith(self.prefix)}
        return inner, rest

    def partition(self, meta: Tensors) -> list[tuple[str, ...]]:
        inner, rest = self._split(meta)
        groups = self.stage.partition(inner) if inner else []
        return [tuple(self.prefix + n for n in g) for g in groups] + [(n,) for n in rest]

    def __call__(self, tensors: Tensors) -> Tensors:
        inner, rest = self._split(tensors)
        converted = self.stage(inner) if inner else {}
        return {**rest, **{self.prefix + n: t for n, t in converted.items()}}


def conversion_for(module: torch.nn.Module, base_only: bool = False) -> Conversion:
    """The stages that take ``module``'s tensors to its engines' layout (none for a plain module);
    ``base_only``: the base model under a PEFT adapter, without merging it (``lora: adapter``)."""
    stages: list[Stage] = []
    peft = PeftMerge(module)
    if peft.layers and not base_only:
        stages.append(peft)
    unwrap = Unwrap(module, base_only)
    if unwrap.changes:
        stages.append(unwrap)
    paths = clean_paths(module, base_only)
    outer: list[str] = []
    for path, m in module.named_modules():
        clean = paths.get(path)
        if clean is None or not is_transformers_model(m) or any(clean.startswith(o) for o in outer):
            continue
        prefix = f"{clean}." if clean else ""
        outer.append(prefix)
        stages.append(Prefixed(CheckpointStage(m), prefix) if prefix else CheckpointStage(m))
    return Conversion(stages)


class WeightLayout:
    """Which source tensors (the trainer's names) make which target tensors (the engines'), in groups.

    ``identity``: every target is its source under the same name (nothing to do per version: the
    layout of a plain model, or ``layout: trainer``)."""

    def __init__(self, conversion: Conversion, groups: tuple[Group, ...], sources: Mapping[str, TensorSpec]):
        self.conversion, self.groups = conversion, groups
        self.source_specs = dict(sources)
        self.group_of = {name: i for i, g in enumerate(groups) for name in g.target_names}
        self.identity = all(g.renamed and g.sources[0] == g.targets[0].name for g in groups)

    @classmethod
    def of(cls, weights: Any, named: Mapping[str, torch.Tensor], convert_layout: bool = True,
           base_only: bool = False) -> WeightLayout:
        """The layout of ``named`` (every tensor of ``weights``, by its name in ``weights``); the
        identity for a mapping or with ``convert_layout`` off. ``base_only``: a PEFT model's base,
        its adapters left out (``conversion_for``). Raises ``LayoutError``."""
        convert = convert_layout and isinstance(weights, torch.nn.Module)
        conversion = conversion_for(weights, base_only) if convert else Conversion([])
        meta = meta_tensors(named)
        layout = cls(conversion, conversion.plan(meta), {n: TensorSpec.of(n, t) for n, t in meta.items()})
        if not layout.identity:
            changed = [g for g in layout.groups if not g.renamed]
            log.info("sending the engines' layout: %d tensor(s) in %d converted group(s), %d renamed, %.1f MB scratch "
                     "at most per group", sum(len(g.targets) for g in layout.groups), len(changed),
                     sum(g.renamed and g.sources[0] != g.targets[0].name for g in layout.groups),
                     max((g.scratch_bytes for g in changed), default=0) / 1e6)
        return layout

    def keeping(self, names: Mapping[str, Any]) -> WeightLayout:
        """Only the groups whose sources are all in ``names`` (tied aliases that are not sent drop out)."""
        kept = tuple(g for g in self.groups if all(s in names for s in g.sources))
        partial = [g for g in self.groups if g not in kept and any(s in names for s in g.sources)]
        if partial:
            raise LayoutError(f"the tensors {list(partial[0].sources)} are converted together, but only some are sent")
        return WeightLayout(self.conversion, kept, {n: s for n, s in self.source_specs.items() if n in names})

    def renamed_sources(self, targets: frozenset[str]) -> frozenset[str]:
        """The sources sent as they are under one of ``targets``' names (a server's expected names,
        in terms of the trainer's: whether it expects a tied weight's second name)."""
        return frozenset(g.sources[0] for g in self.groups if g.renamed and g.targets[0].name in targets)

    def target_groups(self) -> list[list[TensorSpec]]:
        """Each group's targets, in the sources' order: what ``BucketPlan.from_groups`` plans."""
        return [list(g.targets) for g in self.groups]

    def view(self, sources: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """The targets of one version, from ``sources`` (this version's tensors, by source name)."""
        if self.identity:
            return sources
        return LayoutView(self, sources)

    def produce(self, group: Group, sources: Mapping[str, torch.Tensor]) -> Tensors:
        """One group's targets from its sources (views where the conversion allows, else copies)."""
        inputs = {n: sources[n] for n in group.sources}
        if group.renamed:
            return {group.targets[0].name: inputs[group.sources[0]]}
        return self.conversion.apply(inputs)

    def source_bucket(self, bucket: Bucket) -> Bucket:
        """The sources of ``bucket``'s groups, laid out as a bucket (item size descending): what a
        sharded trainer's owner assembles before converting it into ``bucket``. The bucket itself
        for the identity layout."""
        if self.identity:
            return bucket
        names = dict.fromkeys(n for s in bucket.specs for n in self.groups[self.group_of[s.name]].sources)
        specs = sorted((self.source_specs[n] for n in names), key=lambda s: -s.itemsize)
        offsets, at = [], 0
        for s in specs:
            offsets.append(at)
            at += s.nbytes
        return Bucket(bucket.index, tuple(specs), tuple(offsets), at)

    def scratch_bytes(self, plan: BucketPlan) -> int:
        """The most bytes conversions allocate at once while a version is packed: the converted
        groups of one bucket (a group spanning buckets is kept until its last target is packed)."""
        most = 0
        for bucket in plan.buckets:
            groups = {self.group_of[s.name] for s in bucket.specs if not self.identity}
            most = max(most, sum(self.groups[g].scratch_bytes for g in groups))
        return most

    def source_mismatch(self, sources: Mapping[str, torch.Tensor]) -> str | None:
        """None when ``sources`` has exactly the planned sources' names, dtypes and shapes."""
        for name, spec in self.source_specs.items():
            t = sources.get(name)
            if t is None:
                return f"tensor '{name}' is missing"
            if t.dtype != spec.dtype or tuple(t.shape) != spec.shape:
                return f"'{name}' is {t.dtype} {tuple(t.shape)}, planned as {spec.dtype} {spec.shape}"
        if len(sources) != len(self.source_specs):
            extra = sorted(set(sources) - set(self.source_specs))
            return f"tensor '{extra[0]}' was not in the plan"
        return None


class LayoutView(Mapping[str, torch.Tensor]):
    """The targets of one version as a mapping, each group produced when one of its targets is
    first looked up and dropped once all of them were: packing bucket by bucket holds at most one
    bucket's converted groups. Looking a target up again after its group was dropped produces the
    group again (from the same sources)."""

    def __init__(self, layout: WeightLayout, sources: Mapping[str, torch.Tensor]):
        self.layout, self.sources = layout, sources
        self._made: dict[int, Tensors] = {}
        self._left: dict[int, set[str]] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        index = self.layout.group_of[name]
        group = self.layout.groups[index]
        if group.renamed:
            return self.sources[group.sources[0]]
        made = self._made.get(index)
        if made is None:
            made = self._made[index] = self.layout.produce(group, self.sources)
            self._left[index] = set(group.target_names)
        left = self._left[index]
        left.discard(name)
        if not left:
            del self._made[index], self._left[index]
        return made[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.layout.group_of)

    def __len__(self) -> int:
        return len(self.layout.group_of)
