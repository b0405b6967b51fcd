"""Bucket plan: how a model's tensors are laid out in flat byte buckets.

Only this index structure is cached between syncs; the tensors themselves are fetched fresh from the
model at every sync (a cached tensor reference goes stale when a parameter object is replaced).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024

_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
        torch.float8_e4m3fn, torch.float8_e5m2,
    )
}


def dtype_from_name(name: str) -> torch.dtype:
    """Parse a wire dtype name such as ``"bfloat16"``; errors list the supported names."""
    try:
        return _DTYPES[name.removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def distinct_tensors(named: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop names that alias an earlier tensor (tied weights such as ``lm_head.weight``): sent once.

    Trainer and receivers apply the same rule to the same module layout, so they agree on the names.
    """
    seen: set[tuple[int, torch.dtype, tuple[int, ...], tuple[int, ...]]] = set()
    out: dict[str, torch.Tensor] = {}
    for name, t in named.items():
        if t.numel():
            key = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
            if key in seen:
                continue
            seen.add(key)
        out[name] = t
    return out


def named_tensors(weights: torch.nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fresh name -> tensor map (parameters and persistent buffers, tied ones once), fetched at every sync."""
    return distinct_tensors(weights.state_dict() if isinstance(weights, torch.nn.Module) else weights)


@dataclass(frozen=True)
class TensorSpec:
    """Name, dtype and shape of one tensor: all a receiver needs to rebuild it from bytes."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

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
    """

    def __init__(self, specs: Iterable[TensorSpec], bucket_bytes: int = DEFAULT_BUCKET_BYTES, single_dtype: bool = False):
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.bucket_bytes = bucket_bytes
        self.single_dtype = single_dtype
        self.specs: tuple[TensorSpec, ...] = tuple(specs)
        names = [s.name for s in self.specs]
        if len(set(names)) != len(names):
            raise ValueError("tensor names must be unique within a plan")
        self.buckets: tuple[Bucket, ...] = tuple(self._build())

    @classmethod
    def from_tensors(cls, named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                     single_dtype: bool = False) -> BucketPlan:
        return cls((TensorSpec.of(n, t) for n, t in named), bucket_bytes, single_dtype)

    def _build(self) -> Iterator[Bucket]:
        groups: list[list[TensorSpec]] = []
        current: list[TensorSpec] = []
        used = 0
        specs = sorted(self.specs, key=lambda s: (-s.itemsize, dtype_name(s.dtype))) if self.single_dtype else self.specs
        for spec in specs:
            if current and (used + spec.nbytes > self.bucket_bytes or (self.single_dtype and spec.dtype != current[0].dtype)):
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

    def matches(self, named: Mapping[str, torch.Tensor]) -> bool:
        """True when ``named`` has exactly this plan's names, dtypes and shapes (the plan is reusable)."""
        if len(named) != len(self.specs):
            return False
        return all(
            (t := named.get(s.name)) is not None and t.dtype == s.dtype and tuple(t.shape) == s.shape
            for s in self.specs
        )
