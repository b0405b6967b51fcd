"""Messages of the weight-update protocol, as frozen dataclasses that validate what they parse.

A bucket travels as metadata over HTTP (names, dtypes, shapes, in packing order) and as bytes over
the data plane. Offsets are implied by the order, exactly as in SGLang's flattened bucket: each tensor
starts where the previous one ended, so the receiver recomputes them and checks their alignment.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from asyncsync.protocol.shm import HostIdentity, valid_segment_name
from asyncsync.protocol.specs import Bucket, TensorSpec, dtype_from_name, dtype_name


class WireError(ValueError):
    """A control request is malformed; the message says which field and why (answered with HTTP 400)."""


def _field(data: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(data, dict):
        raise WireError(f"{where}: expected a JSON object, got {type(data).__name__}")
    if key not in data:
        raise WireError(f"{where}: missing field '{key}'")
    value = data[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,))):
        raise WireError(f"{where}.{key}: expected {getattr(kind, '__name__', kind)}, got {type(value).__name__}")
    return value


def _version(data: Any, where: str) -> int:
    v = _field(data, "version", int, where)
    if v < 0:
        raise WireError(f"{where}.version: must be >= 0, got {v}")
    return v


@dataclass(frozen=True)
class GroupSpec:
    """Everything a member needs to join a data-plane group: where the rendezvous store is, how many
    ranks, the group's name (the store prefix), the backend and the deadline of every collective."""

    host: str
    port: int
    world_size: int
    group_name: str
    backend: str  # "gloo" or "nccl"
    timeout_s: float

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise WireError(f"group.port: {self.port} is not a port number")
        if self.world_size < 2:
            raise WireError(f"group.world_size: a group needs the trainer and at least one receiver, got {self.world_size}")
        if self.backend not in ("gloo", "nccl"):
            raise WireError(f"group.backend: expected 'gloo' or 'nccl', got {self.backend!r}")
        if not self.group_name:
            raise WireError("group.group_name: must not be empty")
        if self.timeout_s <= 0:
            raise WireError(f"group.timeout_s: must be positive, got {self.timeout_s}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class BucketMeta:
    """The metadata of one bucket: names, dtypes and shapes in packing order, and its byte size."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    nbytes: int

    @classmethod
    def of(cls, bucket: Bucket) -> BucketMeta:
        return cls(
            tuple(s.name for s in bucket.specs), tuple(dtype_name(s.dtype) for s in bucket.specs),
            tuple(s.shape for s in bucket.specs), bucket.nbytes,
        )

    def to_json(self) -> dict[str, Any]:
        return {"names": list(self.names), "dtypes": list(self.dtypes), "shapes": [list(s) for s in self.shapes], "nbytes": self.nbytes}

    @classmethod
    def from_json(cls, data: Any, where: str = "bucket") -> BucketMeta:
        names = _field(data, "names", list, where)
        dtypes = _field(data, "dtypes", list, where)
        shapes = _field(data, "shapes", list, where)
        nbytes = _field(data, "nbytes", int, where)
        if not (len(names) == len(dtypes) == len(shapes)):
            raise WireError(f"{where}: names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, {len(shapes)})")
        if not names:
            raise WireError(f"{where}: a bucket must hold at least one tensor")
        if nbytes < 0:
            raise WireError(f"{where}.nbytes: must be >= 0, got {nbytes}")
        for i, (n, d, s) in enumerate(zip(names, dtypes, shapes)):
            if not isinstance(n, str) or not n:
                raise WireError(f"{where}.names[{i}]: expected a non-empty string, got {n!r}")
            if not isinstance(d, str):
                raise WireError(f"{where}.dtypes[{i}]: expected a dtype name, got {d!r}")
            if not isinstance(s, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in s):
                raise WireError(f"{where}.shapes[{i}]: expected a list of non-negative integers, got {s!r}")
        meta = cls(tuple(names), tuple(dtypes), tuple(tuple(s) for s in shapes), nbytes)
        meta.to_bucket(0, where)  # validates dtypes, alignment and the byte count
        return meta

    def to_bucket(self, index: int, where: str = "bucket") -> Bucket:
        """Rebuild the bucket with offsets implied by order; rejects misaligned or mis-sized layouts."""
        specs, offsets, offset = [], [], 0
        for i, (name, d, shape) in enumerate(zip(self.names, self.dtypes, self.shapes)):
            try:
                spec = TensorSpec(name, dtype_from_name(d), shape)
            except ValueError as e:
                raise WireError(f"{where}.dtypes[{i}]: {e}") from None
            if offset % spec.itemsize:
                raise WireError(f"{where}: tensor '{name}' would start at byte {offset}, not a multiple of its item size {spec.itemsize}")
            specs.append(spec)
            offsets.append(offset)
            offset += spec.nbytes
        if offset != self.nbytes:
            raise WireError(f"{where}.nbytes: is {self.nbytes} but the tensors add up to {offset} bytes")
        return Bucket(index, tuple(specs), tuple(offsets), offset)


RECEIVE_MODES = ("background", "in_rpc")


@dataclass(frozen=True)
class SharedVersion:
    """Where a same-host receiver finds a version instead of the data plane (``protocol/shm.py``):
    the shared-memory segment, each bucket's offset in it, each bucket's CRC32C (empty without
    checksums) and the trainer's host identity (a receiver elsewhere refuses at once)."""

    segment: str
    offsets: tuple[int, ...]
    crcs: tuple[int, ...]
    host: HostIdentity

    def __post_init__(self) -> None:
        if not valid_segment_name(self.segment):
            raise WireError(f"update.shm.segment: {self.segment!r} is not an asyncsync segment name")
        if any(not isinstance(o, int) or isinstance(o, bool) or o < 0 for o in self.offsets):
            raise WireError(f"update.shm.offsets: expected byte offsets >= 0, got {list(self.offsets)}")
        if self.crcs and len(self.crcs) != len(self.offsets):
            raise WireError(f"update.shm.crcs: {len(self.crcs)} checksum(s) for {len(self.offsets)} bucket(s)")
        if any(not isinstance(c, int) or isinstance(c, bool) or not 0 <= c < 2**32 for c in self.crcs):
            raise WireError("update.shm.crcs: expected CRC32C values (unsigned 32-bit integers)")

    def to_json(self) -> dict[str, Any]:
        return {"segment": self.segment, "offsets": list(self.offsets), "crcs": list(self.crcs),
                "host": self.host.to_json()}

    @classmethod
    def from_json(cls, data: Any) -> SharedVersion:
        w = "update.shm"
        host = HostIdentity.from_json(_field(data, "host", dict, w))
        if host is None:
            raise WireError(f"{w}.host: expected {{'boot_id': str, 'shm_dev': int}}")
        return cls(_field(data, "segment", str, w), tuple(_field(data, "offsets", list, w)),
                   tuple(_field(data, "crcs", list, w)), host)


@dataclass(frozen=True)
class DeltaVersion:
    """The version arrives as deltas against ``base``, the version the receiver committed last
    (``protocol/delta.py``): bucket i is broadcast as ``nbytes[i]`` encoded bytes, or whole where
    ``nbytes[i]`` is 0. The checksum manifest still carries the full buckets' CRC32Cs, which the
    rebuilt buckets must match; a receiver that does not hold ``base`` intact refuses the version."""

    base: int
    nbytes: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.base, int) or isinstance(self.base, bool) or self.base < 1:
            raise WireError(f"update.delta.base: expected a committed version >= 1, got {self.base!r}")
        if any(not isinstance(n, int) or isinstance(n, bool) or n < 0 for n in self.nbytes):
            raise WireError(f"update.delta.nbytes: expected byte counts >= 0, got {list(self.nbytes)}")

    def to_json(self) -> dict[str, Any]:
        return {"base": self.base, "nbytes": list(self.nbytes)}

    @classmethod
    def from_json(cls, data: Any) -> DeltaVersion:
        return cls(_field(data, "base", int, "update.delta"), tuple(_field(data, "nbytes", list, "update.delta")))


@dataclass(frozen=True)
class UpdateRequest:
    """A whole version: every bucket's metadata, in broadcast order. With ``checksum`` the trainer
    broadcasts one more int64 tensor after the last bucket: the CRC32C of every bucket.

    ``deadlines_s`` (optional, one per bucket) is how long each bucket's broadcast may take: the
    trainer derives it from the measured rate (``transport.pace``), and a receiver that waits longer
    for a bucket gives up then instead of at the group's own timeout (the manifest gets the largest).

    ``receive`` says where a receiver that can do either receives the version (asyncsync's vLLM
    engine): ``in_rpc`` inside the call that carries this request, which is answered once the version
    is received, verified and applied (the default, and what every other receiver does);
    ``background`` on a worker thread, answering at once: the version is verified there and applied,
    or refused, by the call that ends the update.

    ``delta`` (optional): the buckets arrive as deltas against the version the receiver committed
    last (``DeltaVersion``); the receiver rebuilds each in its staging and verifies the result."""

    version: int
    buckets: tuple[BucketMeta, ...]
    checksum: bool
    deadlines_s: tuple[float, ...] = ()
    sources: tuple[int, ...] = ()  # per bucket, the group it arrives on (InitGroupRequest.groups); () = all group 0
    receive: str = "in_rpc"
    shm: SharedVersion | None = None  # same-host receivers: the version is in shared memory, not on the data plane
    delta: DeltaVersion | None = None  # buckets sent as deltas against the receiver's committed version

    def __post_init__(self) -> None:
        if self.delta is not None:
            if len(self.delta.nbytes) != len(self.buckets):
                raise WireError(f"update.delta.nbytes: {len(self.delta.nbytes)} size(s) for {len(self.buckets)} bucket(s)")
            if not self.checksum or self.shm is not None:
                raise WireError("update.delta: a delta version needs checksum true (the rebuilt buckets are verified "
                                "against it) and comes over the data plane, not shared memory")
            if self.delta.base >= self.version:
                raise WireError(f"update.delta.base: {self.delta.base} is not older than the version {self.version}")
            over = [i for i, (n, b) in enumerate(zip(self.delta.nbytes, self.buckets)) if n >= b.nbytes]
            if over:
                raise WireError(f"update.delta.nbytes: bucket(s) {over} are no smaller as a delta than whole")
        if self.shm is not None and len(self.shm.offsets) != len(self.buckets):
            raise WireError(f"update.shm.offsets: {len(self.shm.offsets)} offset(s) for {len(self.buckets)} bucket(s)")
        if self.shm is not None and self.checksum and not self.shm.crcs:
            raise WireError("update.shm.crcs: the update has checksum true but the shared version carries none")
        if self.deadlines_s and len(self.deadlines_s) != len(self.buckets):
            raise WireError(f"update.deadlines_s: {len(self.deadlines_s)} deadline(s) for {len(self.buckets)} bucket(s)")
        if self.sources and len(self.sources) != len(self.buckets):
            raise WireError(f"update.sources: {len(self.sources)} source(s) for {len(self.buckets)} bucket(s)")
        if any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in self.sources):
            raise WireError(f"update.sources: expected group indexes >= 0, got {list(self.sources)}")
        if any(not isinstance(d, (int, float)) or isinstance(d, bool) or d <= 0 for d in self.deadlines_s):
            raise WireError(f"update.deadlines_s: expected positive seconds, got {list(self.deadlines_s)}")
        if self.receive not in RECEIVE_MODES:
            raise WireError(f"update.receive: expected one of {list(RECEIVE_MODES)}, got {self.receive!r}")

    def source(self, index: int) -> int:
        """The group bucket ``index`` arrives on (the manifest: group 0)."""
        return self.sources[index] if self.sources and index < len(self.sources) else 0

    def deadline_s(self, index: int) -> float | None:
        """Bucket ``index``'s deadline (``len(buckets)``: the manifest's), or None for the group's own."""
        if not self.deadlines_s:
            return None
        return self.deadlines_s[index] if index < len(self.deadlines_s) else max(self.deadlines_s)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"version": self.version, "buckets": [b.to_json() for b in self.buckets], "checksum": self.checksum}
        if self.deadlines_s:
            out["deadlines_s"] = list(self.deadlines_s)
        if self.sources:
            out["sources"] = list(self.sources)
        if self.receive != "in_rpc":
            out["receive"] = self.receive
        if self.shm is not None:
            out["shm"] = self.shm.to_json()
        if self.delta is not None:
            out["delta"] = self.delta.to_json()
        return out

    @classmethod
    def from_json(cls, data: Any) -> UpdateRequest:
        version = _version(data, "update")
        raw = _field(data, "buckets", list, "update")
        if not raw:
            raise WireError("update.buckets: must list at least one bucket")
        checksum = _field(data, "checksum", bool, "update")
        deadlines = _field(data, "deadlines_s", list, "update") if "deadlines_s" in data else []
        sources = _field(data, "sources", list, "update") if "sources" in data else []
        receive = _field(data, "receive", str, "update") if "receive" in data else "in_rpc"
        buckets = tuple(BucketMeta.from_json(b, f"update.buckets[{i}]") for i, b in enumerate(raw))
        shm = SharedVersion.from_json(_field(data, "shm", dict, "update")) if "shm" in data else None
        delta = DeltaVersion.from_json(_field(data, "delta", dict, "update")) if "delta" in data else None
        return cls(version, buckets, checksum, tuple(deadlines), tuple(sources), receive, shm, delta)


@dataclass(frozen=True)
class DiscardRequest:
    """Drop what a receiver holds of ``version`` without applying it: a version being received, or
    received, in the background (``UpdateRequest.receive``) that the trainer abandoned. The receiver
    stops a receive still in progress by leaving the group (the trainer forms a new one). Carried
    where an ``UpdateRequest`` would be (vLLM's ``update_info``)."""

    version: int

    def to_json(self) -> dict[str, Any]:
        return {"discard": self.version}

    @classmethod
    def from_json(cls, data: Any) -> DiscardRequest:
        version = _field(data, "discard", int, "discard")
        if version < 0:
            raise WireError(f"discard: must be >= 0, got {version}")
        return cls(version)


@dataclass(frozen=True)
class VersionRequest:
    """``begin`` and ``end`` carry only the version they are about."""

    version: int

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version}

    @classmethod
    def from_json(cls, data: Any, where: str) -> VersionRequest:
        return cls(_version(data, where))


@dataclass(frozen=True)
class InitGroupRequest:
    """Join the data-plane group ``group`` as rank ``rank_offset`` (the trainer is rank 0), and, for a
    sharded trainer whose other ranks send buckets too, ``more_groups`` at the same rank: group i of
    ``groups`` is trainer rank i's (``UpdateRequest.sources`` says which group each bucket arrives on)."""

    group: GroupSpec
    rank_offset: int
    more_groups: tuple[GroupSpec, ...] = ()

    @property
    def groups(self) -> tuple[GroupSpec, ...]:
        return (self.group, *self.more_groups)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"group": self.group.to_json(), "rank_offset": self.rank_offset}
        if self.more_groups:
            out["more_groups"] = [g.to_json() for g in self.more_groups]
        return out

    @classmethod
    def from_json(cls, data: Any) -> InitGroupRequest:
        w = "init_group"
        group = _group_spec(_field(data, "group", dict, w), f"{w}.group")
        more = _field(data, "more_groups", list, w) if "more_groups" in data else []
        return cls(group, _field(data, "rank_offset", int, w),
                   tuple(_group_spec(g, f"{w}.more_groups[{i}]") for i, g in enumerate(more)))

    def __post_init__(self) -> None:
        for g in self.groups:
            if not 1 <= self.rank_offset < g.world_size:
                raise WireError(f"init_group.rank_offset: must be in [1, world_size={g.world_size}), got {self.rank_offset}")


def _group_spec(data: Any, where: str) -> GroupSpec:
    if not isinstance(data, dict):
        raise WireError(f"{where}: expected a JSON object, got {type(data).__name__}")
    fields = {k: _field(data, k, kind, where) for k, kind in
              (("host", str), ("port", int), ("world_size", int), ("group_name", str), ("backend", str),
               ("timeout_s", (int, float)))}
    try:
        return GroupSpec(**{**fields, "timeout_s": float(fields["timeout_s"])})
    except WireError as e:
        raise WireError(f"{where.rsplit('.group', 1)[0]}.{e}" if where.endswith(".group") else f"{where}: {e}") from None


# -- which trainer owns a receiver -------------------------------------------------------------------

SESSION_HEADER = "X-Asyncsync-Session"  # every call of a trainer carries its session id (renews its lease)
OWNED_STATUS = 423  # HTTP status of a call refused because another trainer session owns the receiver
MAX_SESSION_CHARS = 200


@dataclass(frozen=True)
class ClaimRequest:
    """A trainer session asks to own a receiver before it forms a group with it (``POST /claim``).

    ``session`` names the trainer process (``host:pid:random``; the same value travels in the
    ``SESSION_HEADER`` of all its calls). ``takeover`` claims the receiver even from a session that
    still looks alive: for replacing a trainer known to be hung faster than the receiver's lease.
    Receivers that predate claims answer 404 and are used as before (unprotected)."""

    session: str
    takeover: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.session, str) or not self.session or len(self.session) > MAX_SESSION_CHARS \
                or not self.session.isprintable():
            raise WireError(f"claim.session: expected a printable string of 1 to {MAX_SESSION_CHARS} characters, "
                            f"got {self.session!r}")
        if not isinstance(self.takeover, bool):
            raise WireError(f"claim.takeover: expected true or false, got {self.takeover!r}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> ClaimRequest:
        takeover = _field(data, "takeover", bool, "claim") if isinstance(data, dict) and "takeover" in data else False
        return cls(_field(data, "session", str, "claim"), takeover)
