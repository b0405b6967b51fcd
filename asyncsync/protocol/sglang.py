"""SGLang's weight-update messages, shared by the SGLang client and the reference server's SGLang API.

Field names and defaults are SGLang's own (``io_struct.py``: ``InitWeightsUpdateGroupReqInput`` and
``UpdateWeightsFromDistributedReqInput``). One ``/update_weights_from_distributed`` request carries
one bucket; with ``load_format="flattened_bucket"`` its tensors travel as one broadcast, laid out in
request order with no padding, exactly like an asyncsync bucket. Before sgl-project/sglang#13413
(November 2025) SGLang read a flattened bucket as a single dtype, so asyncsync's buckets for SGLang
hold one dtype each, and the reference server refuses mixed ones.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from asyncsync.protocol.specs import TensorSpec, dtype_from_name
from asyncsync.protocol.wire import BucketMeta, GroupSpec, WireError, _field

DEFAULT_GROUP_NAME = "weight_update_group"
FLATTENED_BUCKET = "flattened_bucket"


@dataclass(frozen=True)
class InitWeightsUpdateGroup:
    """Body of ``POST /init_weights_update_group``: join the trainer's group as ranks ``rank_offset`` on."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = DEFAULT_GROUP_NAME
    backend: str = "nccl"

    @classmethod
    def of(cls, spec: GroupSpec, rank_offset: int) -> InitWeightsUpdateGroup:
        return cls(spec.host, spec.port, rank_offset, spec.world_size, spec.group_name, spec.backend)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> InitWeightsUpdateGroup:
        w = "init_weights_update_group"
        msg = cls(
            _field(data, "master_address", str, w), _field(data, "master_port", int, w),
            _field(data, "rank_offset", int, w), _field(data, "world_size", int, w),
            data.get("group_name", DEFAULT_GROUP_NAME), data.get("backend", "nccl"),
        )
        if not 0 < msg.master_port < 65536:
            raise WireError(f"{w}.master_port: {msg.master_port} is not a port number")
        if not 1 <= msg.rank_offset < msg.world_size:
            raise WireError(f"{w}.rank_offset: must be in [1, world_size={msg.world_size}), got {msg.rank_offset}")
        if msg.backend not in ("gloo", "nccl"):
            raise WireError(f"{w}.backend: expected 'gloo' or 'nccl', got {msg.backend!r}")
        if not isinstance(msg.group_name, str) or not msg.group_name:
            raise WireError(f"{w}.group_name: expected a non-empty string, got {msg.group_name!r}")
        return msg

    def spec(self, timeout_s: float) -> GroupSpec:
        return GroupSpec(self.master_address, self.master_port, self.world_size, self.group_name, self.backend, timeout_s)


@dataclass(frozen=True)
class UpdateWeightsFromDistributed:
    """Body of ``POST /update_weights_from_distributed``: one bucket, broadcast right after it is posted.

    On the wire the bucket is SGLang's ``names``, ``dtypes`` and ``shapes`` fields. ``weight_version``
    goes with a version's last bucket only: SGLang adopts it as soon as that request succeeds.
    ``flush_cache`` (drop the radix cache) is wanted once per version, on that same last bucket.
    """

    bucket: BucketMeta
    group_name: str = DEFAULT_GROUP_NAME
    load_format: str | None = FLATTENED_BUCKET
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None

    def to_json(self) -> dict[str, Any]:
        b = self.bucket
        return {
            "names": list(b.names), "dtypes": list(b.dtypes), "shapes": [list(s) for s in b.shapes],
            "group_name": self.group_name, "load_format": self.load_format, "flush_cache": self.flush_cache,
            "abort_all_requests": self.abort_all_requests, "weight_version": self.weight_version,
        }

    @classmethod
    def from_json(cls, data: Any) -> UpdateWeightsFromDistributed:
        w = "update_weights_from_distributed"
        names, dtypes, shapes = (_field(data, k, list, w) for k in ("names", "dtypes", "shapes"))
        version = data.get("weight_version")
        if version is not None and not isinstance(version, str):
            raise WireError(f"{w}.weight_version: expected a string or null, got {type(version).__name__}")
        for key, default in (("flush_cache", True), ("abort_all_requests", False)):
            if not isinstance(data.get(key, default), bool):
                raise WireError(f"{w}.{key}: expected true or false, got {data[key]!r}")
        bucket = BucketMeta.from_json({"names": names, "dtypes": dtypes, "shapes": shapes, "nbytes": _nbytes(dtypes, shapes)}, w)
        return cls(
            bucket, data.get("group_name", DEFAULT_GROUP_NAME), data.get("load_format"),
            data.get("flush_cache", True), data.get("abort_all_requests", False), version,
        )


def _nbytes(dtypes: list[Any], shapes: list[Any]) -> int:
    """Bytes of a flattened bucket. SGLang's request carries no byte count; entries that are not a
    dtype name and a shape add nothing here and are then reported by ``BucketMeta.from_json``."""
    total = 0
    for d, s in zip(dtypes, shapes):
        if isinstance(d, str) and isinstance(s, list) and all(isinstance(x, int) and x >= 0 for x in s):
            try:
                total += TensorSpec("", dtype_from_name(d), tuple(s)).nbytes
            except ValueError:
                continue
    return total
