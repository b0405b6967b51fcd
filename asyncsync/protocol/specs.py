"""Tensor specs and the bucket plan: how a version's tensors are laid out in flat byte buckets.

Trainer and receivers both build ``Bucket``s from the same specs, so this module holds the one dtype
table of the project (wire names, and safetensors' codes for receivers that read checkpoints).
Only the index structure (``BucketPlan``) is cached between syncs; tensors are fetched fresh at
every sync (a cached tensor reference goes stale when a parameter object is replaced).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024

# Every dtype that can travel: wire name -> (torch dtype, safetensors code).
_DTYPES: dict[str, tuple[torch.dtype, str]] = {
    "float64": (torch.float64, "F64"), "float32": (torch.float32, "F32"), "float16": (torch.float16, "F16"),
    "bfloat16": (torch.bfloat16, "BF16"), "int64": (torch.int64, "I64"), "int32": (torch.int32, "I32"),
    "int16": (torch.int16, "I16"), "int8": (torch.int8, "I8"), "uint8": (torch.uint8, "U8"),
    "bool": (torch.bool, "BOOL"), "float8_e4m3fn": (torch.float8_e4m3fn, "F8_E4M3"),
    "float8_e5m2": (torch.float8_e5m2, "F8_E5M2"),
}
_BY_SAFETENSORS = {code: dtype for dtype, code in _DTYPES.values()}


def dtype_from_name(name: str) -> torch.dtype:
    """Parse a wire dtype name such as ``"bfloat16"``; errors list the supported names."""
    try:
        return _DTYPES[name.removeprefix("torch.")][0]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


def dtype_from_safetensors(code: str) -> torch.dtype:
    """A safetensors header's dtype code (``"BF16"``) as a torch dtype."""
    try:
        return _BY_SAFETENSORS[code]
    except KeyError:
        raise ValueError(f"unsupported safetensors dtype {code!r}; expected one of {sorted(_BY_SAFETENSORS)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def storage_aliases(named: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Names whose tensor is an earlier name's tensor (same storage, dtype, shape and strides), each
    mapped to that earlier name: how ``state_dict`` lists tied weights such as ``lm_head.weight``."""
    first: dict[tuple[int, torch.dtype, tuple[int, ...], tuple[int, ...]], str] = {}
    aliases: dict[str, str] = {}
    for name, t in named.items():
        if t.numel():
            earlier = first.setdefault((t.data_ptr(), t.dtype, tuple(t.shape), t.stride()), name)
            if earlier != name:
                aliases[name] = earlier
    return aliases


def distinct_tensors(named: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``named`` without its storage aliases: a tied weight once, under its first name, as a checkpoint
    saved from the model stores it (the names a receiver built from a model expects)."""
    aliases = storage_aliases(named)
    return {name: t for name, t in named.items() if name not in aliases}


@dataclass(frozen=True)
class TensorSpec:
    """Name, dtype and shape of one tensor: all a receiver needs to rebuild it from bytes."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        return cls(name, tensor.dtype, tuple(tensor.shape))


@dataclass(frozen=True)
class Bucket:
    """One flat buffer's worth of tensors, ordered by item size descending so offsets need no padding."""

    index: int
    specs: tuple[TensorSpec, ...]
    offsets: tuple[int, ...]
    nbytes: int

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.specs]


class BucketPlan:
    """Buckets of at most ``bucket_bytes``; a tensor larger than that gets a bucket of its own.

    Tensors keep the model's order across buckets; inside a bucket they are sorted by item size
    descending (stable), so every offset is a multiple of its tensor's item size (item sizes are
    powers of two) with no padding: the layout SGLang's ``flattened_bucket`` also requires.
    With ``single_dtype`` (SGLang's receivers need it) tensors are grouped by dtype first, keeping
    the model's order within a dtype, and no bucket holds two dtypes.

    ``from_groups`` plans tensors that are produced together (a layer's experts, converted from one
    fused tensor): a group that fits in a bucket is never split across two, so it is produced once
    per version, for one bucket; a larger one fills buckets tensor by tensor, or, with
    ``whole_groups``, gets a bucket of its own (a sharded trainer assembles a bucket's groups whole).
    """

    def __init__(self, specs: Iterable[TensorSpec], bucket_bytes: int = DEFAULT_BUCKET_BYTES, single_dtype: bool = False,
                 group_sizes: Iterable[int] | None = None, whole_groups: bool = False):
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.bucket_bytes = bucket_bytes
        self.single_dtype = single_dtype
        self.specs: tuple[TensorSpec, ...] = tuple(specs)
        names = [s.name for s in self.specs]
        if len(set(names)) != len(names):
            raise ValueError("tensor names must be unique within a plan")
        sizes = [1] * len(self.specs) if group_sizes is None else list(group_sizes)
        if sum(sizes) != len(self.specs) or any(n < 1 for n in sizes):
            raise ValueError("group_sizes must split the specs into non-empty groups")
        self.buckets: tuple[Bucket, ...] = tuple(self._build(sizes, whole_groups))

    @classmethod
    def from_groups(cls, groups: Iterable[Iterable[TensorSpec]], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                    single_dtype: bool = False, whole_groups: bool = False) -> BucketPlan:
        listed = [tuple(g) for g in groups]
        return cls((s for g in listed for s in g), bucket_bytes, single_dtype, [len(g) for g in listed if g], whole_groups)

    @classmethod
    def from_tensors(cls, named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                     single_dtype: bool = False) -> BucketPlan:
        return cls((TensorSpec.of(n, t) for n, t in named), bucket_bytes, single_dtype)

    def _build(self, sizes: list[int], whole_groups: bool) -> Iterator[Bucket]:
        groups: list[list[TensorSpec]] = []
        current: list[TensorSpec] = []
        used = 0
        if self.single_dtype:
            units = [[s] for s in sorted(self.specs, key=lambda s: (-s.itemsize, dtype_name(s.dtype)))]
        else:
            bounds = [0, *itertools.accumulate(sizes)]
            units = [list(self.specs[a:b]) for a, b in zip(bounds, bounds[1:])]
        for unit in units:
            whole = sum(s.nbytes for s in unit)
            if current and (whole <= self.bucket_bytes or whole_groups) and used + whole > self.bucket_bytes:
                groups.append(current)  # a group that fits a bucket starts a new one rather than be split
                current, used = [], 0
            for i, spec in enumerate(unit):
                full = bool(current) and (used + spec.nbytes > self.bucket_bytes
                                           or (self.single_dtype and spec.dtype != current[0].dtype))
                if full and not (whole_groups and i):  # with whole_groups, a group stays together
                    groups.append(current)
                    current, used = [], 0
                current.append(spec)
                used += spec.nbytes
        if current:
            groups.append(current)
        for index, group in enumerate(groups):
            ordered = sorted(group, key=lambda s: -s.itemsize)
            offsets, offset = [], 0
            for spec in ordered:
                offsets.append(offset)
                offset += spec.nbytes
            yield Bucket(index, tuple(ordered), tuple(offsets), offset)

    @property
    def total_bytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def max_bucket_bytes(self) -> int:
        return max((b.nbytes for b in self.buckets), default=0)

    def mismatch(self, named: Mapping[str, torch.Tensor]) -> str | None:
        """None when ``named`` has exactly this plan's names, dtypes and shapes; else what differs."""
        for s in self.specs:
            t = named.get(s.name)
            if t is None:
                return f"tensor '{s.name}' is missing"
            if t.dtype != s.dtype or tuple(t.shape) != s.shape:
                return f"'{s.name}' is {t.dtype} {tuple(t.shape)}, planned as {s.dtype} {s.shape}"
        if len(named) != len(self.specs):
            extra = sorted(set(named) - {s.name for s in self.specs})
            return f"tensor '{extra[0]}' was not in the plan"
        return None

    def matches(self, named: Mapping[str, torch.Tensor]) -> bool:
        """True when ``named`` has exactly this plan's names, dtypes and shapes (the plan is reusable)."""
        return self.mismatch(named) is None


# Every refusal of a version for its layout (names, dtypes, shapes) says this: the same plan would be
# refused again at every version, so the trainer reports it as an error rather than a transient refusal.
LAYOUT_REFUSED = "the tensors sent differ from the ones this server loads"
# The layouts a version's tensors may be in: checkpoint (what a checkpoint stores and engines load)
# or trainer (the module's own in-memory names and layouts).
LAYOUTS = ("checkpoint", "trainer")


def layout_mismatch(loads: Mapping[str, TensorSpec], sent: Iterable[TensorSpec], shown: int = 3,
                    part: bool = False) -> str | None:
    """None when ``sent`` is exactly the tensors a server ``loads`` (names, dtypes, shapes, each once);
    else ``LAYOUT_REFUSED`` and the first few differences on both sides, counted, summaries first.
    ``part``: ``sent`` is a part of a version (a bucket): what it lacks is not a difference."""
    seen: dict[str, TensorSpec] = {}
    twice: list[str] = []
    for spec in sent:
        (twice.append(spec.name) if spec.name in seen else seen.__setitem__(spec.name, spec))
    unknown = [n for n in seen if n not in loads]
    missing = [] if part else [n for n in loads if n not in seen]
    other = [f"'{n}' {seen[n].dtype} {seen[n].shape} (loads {w.dtype} {w.shape})" for n, w in loads.items()
             if n in seen and (w.dtype, w.shape) != (seen[n].dtype, seen[n].shape)]
    parts = [f"{len(names)} {what}, e.g. {', '.join(f(n) for n in names[:shown])}" for names, what, f in (
        (missing, "tensor(s) it loads are not sent", repr), (unknown, "tensor(s) sent that it does not load", repr),
        (other, "tensor(s) with another dtype or shape", str), (twice, "tensor(s) sent twice", repr)) if names]
    return f"{LAYOUT_REFUSED}: " + "; ".join(parts) if parts else None


def byte_view(buf: torch.Tensor, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A typed view of ``shape`` at ``offset`` bytes into a flat uint8 buffer (no copy)."""
    return buf[offset : offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)


def unpack(buf: torch.Tensor, bucket: Bucket) -> list[tuple[str, torch.Tensor]]:
    """Views of every tensor of ``bucket`` inside ``buf``; valid until the buffer is reused."""
    return [(s.name, byte_view(buf, off, s.dtype, s.shape)) for s, off in zip(bucket.specs, bucket.offsets)]
