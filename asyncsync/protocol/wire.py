"""Messages of the weight-update protocol, as frozen dataclasses that validate what they parse.

A bucket travels as metadata over HTTP (names, dtypes, shapes, in packing order) and as bytes over
the data plane. Offsets are implied by the order, exactly as in SGLang's flattened bucket: each tensor
starts where the previous one ended, so the receiver recomputes them and checks their alignment.

Every message is validated completely when it is built (``__post_init__``) or parsed (``from_json``),
before a receiver acts on any of it: for any JSON value, ``from_json`` returns the message or raises
``WireError`` (``tests/faults/test_wire_properties.py`` checks exactly that). Numbers are finite and
within the limits below, strings are printable UTF-8 of bounded length, sizes and shape products
cannot overflow an int64, and an error message quotes at most ``ECHO_CHARS`` of any input (``shown``),
so a hostile request can neither crash a receiver nor make it answer with its own input.
"""

from __future__ import annotations

import reprlib
from dataclasses import asdict, dataclass
from typing import Any

from asyncsync.protocol.shm import ALIGN, HostIdentity, valid_segment_name
from asyncsync.protocol.specs import Bucket, TensorSpec, dtype_from_name, dtype_name

# The data plane's framing, agreed at /init_group (``InitGroupRequest.protocol``): 1 was bare payloads
# (asyncsync before frame headers); 2 sends a fixed-size header before every payload (``protocol.frames``).
PROTOCOL_VERSION = 2

# Limits of what a message may carry: generous for any real model, small enough that nothing a
# receiver derives from them (a timedelta, an int64, a tensor size) can overflow.
MAX_DEADLINE_S = 3600.0      # an hour: a rendezvous or one broadcast that may take longer is a mistake
MAX_BYTES = 2**62            # a tensor, a bucket or a version (sizes travel as int64 in frame headers)
MAX_VERSION = 2**63 - 1      # versions travel as int64 in frame headers
MAX_WORLD_SIZE = 2**16
MAX_GROUPS = 1024            # groups of one sharded trainer (one per owning rank)
MAX_RELAY_EDGES = 64         # servers one relaying server forwards to
MAX_BUCKETS = 2**16
MAX_DIMS = 32
MAX_CHECKED_TENSORS = 1_000_000  # a LayoutCheck's tensors (the largest MoE checkpoints hold ~100,000)
MAX_NAME_CHARS = 256         # a tensor name ("model.layers.61.mlp.experts.255.down_proj.weight" is 49)
MAX_GROUP_NAME_CHARS = 256
MAX_HOST_CHARS = 255         # a DNS name at most
MAX_DTYPE_CHARS = 32
ECHO_CHARS = 60              # the most of one input value an error message quotes
MAX_ERROR_CHARS = 600        # the most of any error message a receiver answers with

_SHOW = reprlib.Repr()
_SHOW.maxstring = _SHOW.maxother = _SHOW.maxlong = ECHO_CHARS
_SHOW.maxlevel, _SHOW.maxlist, _SHOW.maxdict = 2, 4, 4


class WireError(ValueError):
    """A control request is malformed; the message says which field and why (answered with HTTP 400)."""


def shown(value: Any) -> str:
    """``value`` for an error message: its repr, cut to about ``ECHO_CHARS`` characters and two levels
    of nesting (a 50 MB field or a 10,000-deep list is never echoed back)."""
    return _SHOW.repr(value)


def short(message: str) -> str:
    """``message`` cut to ``MAX_ERROR_CHARS``: what a receiver answers with, whatever input it names."""
    return message if len(message) <= MAX_ERROR_CHARS else message[: MAX_ERROR_CHARS - 15] + "... (truncated)"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _field(data: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(data, dict):
        raise WireError(f"{where}: expected a JSON object, got {type(data).__name__}")
    if key not in data:
        raise WireError(f"{where}: missing field '{key}'")
    value = data[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,))):
        raise WireError(f"{where}.{key}: expected {getattr(kind, '__name__', kind)}, got {type(value).__name__}")
    return value


def _int_in(value: Any, lo: int, hi: int, where: str) -> int:
    if not _is_int(value) or not lo <= value <= hi:
        raise WireError(f"{where}: expected an integer in [{lo}, {hi}], got {shown(value)}")
    return value


def _seconds(value: Any, where: str) -> float:
    """A deadline: a finite number of seconds in (0, ``MAX_DEADLINE_S``] (NaN, Infinity, 1e300 refused)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= MAX_DEADLINE_S:
        raise WireError(f"{where}: expected seconds in (0, {MAX_DEADLINE_S:.0f}], got {shown(value)}")
    return float(value)


def sane_text(value: Any, max_chars: int) -> bool:
    """A non-empty printable string of at most ``max_chars`` characters that encodes as UTF-8 (no
    control characters, no lone surrogates): safe in a store key, a log line and an error message."""
    if not isinstance(value, str) or not 0 < len(value) <= max_chars or not value.isprintable():
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _text(value: Any, max_chars: int, where: str) -> str:
    if not sane_text(value, max_chars):
        raise WireError(f"{where}: expected a printable string of 1 to {max_chars} characters, got {shown(value)}")
    return value


def _version(data: Any, where: str) -> int:
    return _int_in(_field(data, "version", int, where), 0, MAX_VERSION, f"{where}.version")


def _list(data: Any, key: str, where: str, max_len: int) -> list[Any]:
    value = _field(data, key, list, where)
    if len(value) > max_len:
        raise WireError(f"{where}.{key}: at most {max_len} entries, got {len(value)}")
    return value


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
        if not sane_text(self.host, MAX_HOST_CHARS) or any(c.isspace() for c in self.host):
            raise WireError(f"group.host: expected a host name or address, got {shown(self.host)}")
        if not _is_int(self.port) or not 0 < self.port < 65536:
            raise WireError(f"group.port: {shown(self.port)} is not a port number")
        if not _is_int(self.world_size) or not 2 <= self.world_size <= MAX_WORLD_SIZE:
            raise WireError(f"group.world_size: a group needs the trainer and at least one receiver (at most "
                            f"{MAX_WORLD_SIZE} ranks), got {shown(self.world_size)}")
        if self.backend not in ("gloo", "nccl"):
            raise WireError(f"group.backend: expected 'gloo' or 'nccl', got {shown(self.backend)}")
        if not self.group_name:
            raise WireError("group.group_name: must not be empty")
        _text(self.group_name, MAX_GROUP_NAME_CHARS, "group.group_name")
        _seconds(self.timeout_s, "group.timeout_s")

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
        _int_in(nbytes, 0, MAX_BYTES, f"{where}.nbytes")
        for i, (n, d, s) in enumerate(zip(names, dtypes, shapes)):
            _text(n, MAX_NAME_CHARS, f"{where}.names[{i}]")
            if not sane_text(d, MAX_DTYPE_CHARS):
                raise WireError(f"{where}.dtypes[{i}]: expected a dtype name, got {shown(d)}")
            if not isinstance(s, list) or len(s) > MAX_DIMS or not all(_is_int(x) and 0 <= x <= MAX_BYTES for x in s):
                raise WireError(f"{where}.shapes[{i}]: expected a list of at most {MAX_DIMS} non-negative integers, "
                                f"got {shown(s)}")
        meta = cls(tuple(names), tuple(dtypes), tuple(tuple(s) for s in shapes), nbytes)
        meta.to_bucket(0, where)  # validates dtypes, alignment, overflow and the byte count
        return meta

    def to_bucket(self, index: int, where: str = "bucket") -> Bucket:
        """Rebuild the bucket with offsets implied by order; rejects misaligned or mis-sized layouts
        (``nbytes`` is at most ``MAX_BYTES``, so no shape whose product passes it is accepted)."""
        specs, offsets, offset = [], [], 0
        for i, (name, d, shape) in enumerate(zip(self.names, self.dtypes, self.shapes)):
            try:
                spec = TensorSpec(name, dtype_from_name(d), shape)
            except ValueError as e:
                raise WireError(f"{where}.dtypes[{i}]: {e}") from None
            if offset % spec.itemsize:
                raise WireError(f"{where}: tensor {shown(name)} would start at byte {offset}, not a multiple of its "
                                f"item size {spec.itemsize}")
            specs.append(spec)
            offsets.append(offset)
            offset += spec.nbytes
        if offset != self.nbytes:
            raise WireError(f"{where}.nbytes: is {shown(self.nbytes)} but the tensors add up to {offset} bytes")
        return Bucket(index, tuple(specs), tuple(offsets), offset)


RECEIVE_MODES = ("background", "in_rpc")
MAX_BOOT_ID_CHARS = 64  # a boot id is a UUID (36 characters)


@dataclass(frozen=True)
class SharedVersion:
    """Where a same-host receiver finds a version instead of the data plane (``protocol/shm.py``):
    the shared-memory segment, each bucket's offset in it (a multiple of ``shm.ALIGN``, so that every
    tensor's view is aligned), each bucket's CRC32C (empty without checksums) and the trainer's host
    identity (a receiver elsewhere refuses at once)."""

    segment: str
    offsets: tuple[int, ...]
    crcs: tuple[int, ...]
    host: HostIdentity

    def __post_init__(self) -> None:
        if not valid_segment_name(self.segment):
            raise WireError(f"update.shm.segment: {shown(self.segment)} is not an asyncsync segment name")
        if len(self.offsets) > MAX_BUCKETS or any(not _is_int(o) or not 0 <= o <= MAX_BYTES or o % ALIGN
                                                  for o in self.offsets):
            raise WireError(f"update.shm.offsets: expected byte offsets in [0, {MAX_BYTES}], each a multiple of "
                            f"{ALIGN}, got {shown(list(self.offsets))}")
        if self.crcs and len(self.crcs) != len(self.offsets):
            raise WireError(f"update.shm.crcs: {len(self.crcs)} checksum(s) for {len(self.offsets)} bucket(s)")
        if any(not _is_int(c) or not 0 <= c < 2**32 for c in self.crcs):
            raise WireError("update.shm.crcs: expected CRC32C values (unsigned 32-bit integers)")

    def to_json(self) -> dict[str, Any]:
        return {"segment": self.segment, "offsets": list(self.offsets), "crcs": list(self.crcs),
                "host": self.host.to_json()}

    @classmethod
    def from_json(cls, data: Any) -> SharedVersion:
        w = "update.shm"
        host = HostIdentity.from_json(_field(data, "host", dict, w))
        if host is None or not sane_text(host.boot_id, MAX_BOOT_ID_CHARS):
            raise WireError(f"{w}.host: expected {{'boot_id': str, 'shm_dev': int}}")
        return cls(_field(data, "segment", str, w), tuple(_list(data, "offsets", w, MAX_BUCKETS)),
                   tuple(_list(data, "crcs", w, MAX_BUCKETS)), host)


@dataclass(frozen=True)
class DeltaVersion:
    """The version arrives as deltas against ``base``, the version the receiver committed last
    (``protocol/delta.py``): bucket i is broadcast as ``nbytes[i]`` encoded bytes, or whole where
    ``nbytes[i]`` is 0. The checksum manifest still carries the full buckets' CRC32Cs, which the
    rebuilt buckets must match; a receiver that does not hold ``base`` intact refuses the version."""

    base: int
    nbytes: tuple[int, ...]

    def __post_init__(self) -> None:
        _int_in(self.base, 1, MAX_VERSION, "update.delta.base")
        for n in self.nbytes:
            _int_in(n, 0, MAX_BYTES, "update.delta.nbytes")

    def to_json(self) -> dict[str, Any]:
        return {"base": self.base, "nbytes": list(self.nbytes)}

    @classmethod
    def from_json(cls, data: Any) -> DeltaVersion:
        return cls(_field(data, "base", int, "update.delta"), tuple(_list(data, "nbytes", "update.delta", MAX_BUCKETS)))


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
        _int_in(self.version, 0, MAX_VERSION, "update.version")
        if not self.buckets or len(self.buckets) > MAX_BUCKETS:
            raise WireError(f"update.buckets: must list 1 to {MAX_BUCKETS} buckets, got {len(self.buckets)}")
        if sum(b.nbytes for b in self.buckets) > MAX_BYTES:
            raise WireError(f"update.buckets: the version would pass {MAX_BYTES} bytes")
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
        if any(not _is_int(i) or not 0 <= i < MAX_GROUPS for i in self.sources):
            raise WireError(f"update.sources: expected group indexes in [0, {MAX_GROUPS}), got {shown(list(self.sources))}")
        for d in self.deadlines_s:
            _seconds(d, "update.deadlines_s[]")
        if self.receive not in RECEIVE_MODES:
            raise WireError(f"update.receive: expected one of {list(RECEIVE_MODES)}, got {shown(self.receive)}")

    @property
    def nbytes(self) -> int:
        """The bytes of every bucket: what a receiver stages for this version."""
        return sum(b.nbytes for b in self.buckets)

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
        raw = _list(data, "buckets", "update", MAX_BUCKETS)
        if not raw:
            raise WireError("update.buckets: must list at least one bucket")
        checksum = _field(data, "checksum", bool, "update")
        deadlines = _list(data, "deadlines_s", "update", MAX_BUCKETS) if "deadlines_s" in data else []
        sources = _list(data, "sources", "update", MAX_BUCKETS) if "sources" in data else []
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

    def __post_init__(self) -> None:
        _int_in(self.version, 0, MAX_VERSION, "discard")

    def to_json(self) -> dict[str, Any]:
        return {"discard": self.version}

    @classmethod
    def from_json(cls, data: Any) -> DiscardRequest:
        return cls(_field(data, "discard", int, "discard"))


@dataclass(frozen=True)
class LayoutCheck:
    """Asks a receiver, at ``connect``, whether it loads exactly these tensors; it refuses (an error
    that says ``specs.LAYOUT_REFUSED`` and the differences) if not. Carried where an ``UpdateRequest``
    would be (vLLM's ``update_info``: its routes cannot tell the trainer what the engine loads)."""

    specs: tuple[TensorSpec, ...]

    def to_json(self) -> dict[str, Any]:
        return {"check": [[s.name, dtype_name(s.dtype), list(s.shape)] for s in self.specs]}

    @classmethod
    def from_json(cls, data: Any) -> LayoutCheck:
        return cls(spec_entries(_field(data, "check", list, "check"), "check"))


def spec_entries(entries: Any, where: str) -> tuple[TensorSpec, ...]:
    """Tensor specs sent as ``[[name, dtype, [sizes...]], ...]`` (a ``LayoutCheck``, an adapter's),
    each bounded and validated before a ``TensorSpec`` is made of it."""
    if not isinstance(entries, list):
        raise WireError(f"{where}: expected a list of [name, dtype, [sizes...]], got {shown(entries)}")
    if len(entries) > MAX_CHECKED_TENSORS:
        raise WireError(f"{where}: at most {MAX_CHECKED_TENSORS} tensors, got {len(entries)}")
    specs = []
    for i, entry in enumerate(entries):
        at = f"{where}[{i}]"
        if not (isinstance(entry, list) and len(entry) == 3):
            raise WireError(f"{at}: expected [name, dtype, [sizes...]], got {shown(entry)}")
        name, dtype, shape = entry
        _text(name, MAX_NAME_CHARS, at)
        if not sane_text(dtype, MAX_DTYPE_CHARS):
            raise WireError(f"{at}: expected a dtype name, got {shown(dtype)}")
        if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_is_int(x) and 0 <= x <= MAX_BYTES for x in shape):
            raise WireError(f"{at}: expected a list of at most {MAX_DIMS} non-negative integers, got {shown(shape)}")
        try:
            specs.append(TensorSpec(name, dtype_from_name(dtype), tuple(shape)))
        except ValueError as e:
            raise WireError(f"{at}: {short(str(e))}") from None
    return tuple(specs)


@dataclass(frozen=True)
class VersionRequest:
    """``begin`` and ``end`` carry only the version they are about."""

    version: int

    def __post_init__(self) -> None:
        _int_in(self.version, 0, MAX_VERSION, "version")

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version}

    @classmethod
    def from_json(cls, data: Any, where: str) -> VersionRequest:
        return cls(_version(data, where))


@dataclass(frozen=True)
class InitGroupRequest:
    """Join the data-plane group ``group`` as rank ``rank_offset`` (the trainer is rank 0), and, for a
    sharded trainer whose other ranks send buckets too, ``more_groups`` at the same rank: group i of
    ``groups`` is trainer rank i's (``UpdateRequest.sources`` says which group each bucket arrives on).

    ``protocol`` is the data plane's framing the trainer speaks (``PROTOCOL_VERSION``); a request
    without it comes from an asyncsync that sends bare payloads. Any other than this receiver's is
    refused here, before the rendezvous, so no payload of a foreign framing ever reaches the group.

    ``relay`` (``fanout`` other than ``direct``): one two-rank group per server this one forwards to,
    in which it is rank 0 and the server below it rank 1. Their rendezvous stores are the trainer's
    (a trainer cannot pick a free port on another host), so this server joins them as a client. A
    relaying server forwards every payload it receives, frame header first, as it lands."""

    group: GroupSpec
    rank_offset: int
    more_groups: tuple[GroupSpec, ...] = ()
    protocol: int = PROTOCOL_VERSION
    relay: tuple[GroupSpec, ...] = ()

    @property
    def groups(self) -> tuple[GroupSpec, ...]:
        return (self.group, *self.more_groups)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"group": self.group.to_json(), "rank_offset": self.rank_offset, "protocol": self.protocol}
        if self.more_groups:
            out["more_groups"] = [g.to_json() for g in self.more_groups]
        if self.relay:
            out["relay"] = [g.to_json() for g in self.relay]
        return out

    @classmethod
    def from_json(cls, data: Any) -> InitGroupRequest:
        w = "init_group"
        group = _group_spec(_field(data, "group", dict, w), f"{w}.group")
        more = _list(data, "more_groups", w, MAX_GROUPS - 1) if "more_groups" in data else []
        protocol = _field(data, "protocol", int, w) if "protocol" in data else 1
        relay = _list(data, "relay", w, MAX_RELAY_EDGES + 1) if "relay" in data else []
        return cls(group, _field(data, "rank_offset", int, w),
                   tuple(_group_spec(g, f"{w}.more_groups[{i}]") for i, g in enumerate(more)), protocol,
                   tuple(_group_spec(g, f"{w}.relay[{i}]") for i, g in enumerate(relay)))

    def __post_init__(self) -> None:
        if self.protocol != PROTOCOL_VERSION:
            raise WireError(f"init_group.protocol: the trainer speaks asyncsync data-plane protocol {shown(self.protocol)}"
                            f"{' (no protocol field: an asyncsync that sends bare payloads)' if self.protocol == 1 else ''}"
                            f", this server speaks {PROTOCOL_VERSION}: run the same asyncsync release on the trainer "
                            "and its servers")
        if len(self.more_groups) >= MAX_GROUPS:
            raise WireError(f"init_group.more_groups: at most {MAX_GROUPS - 1} groups, got {len(self.more_groups)}")
        for g in self.groups:
            if not _is_int(self.rank_offset) or not 1 <= self.rank_offset < g.world_size:
                raise WireError(f"init_group.rank_offset: must be in [1, world_size={g.world_size}), got "
                                f"{shown(self.rank_offset)}")
        if len(self.relay) > MAX_RELAY_EDGES:
            raise WireError(f"init_group.relay: at most {MAX_RELAY_EDGES} servers below one, got {len(self.relay)}")
        if self.relay and self.more_groups:
            raise WireError("init_group.relay: a server relays only the versions of a trainer that sends from one rank "
                            "(more_groups names other sending ranks)")
        for i, g in enumerate(self.relay):
            if g.world_size != 2 or g.backend != self.group.backend:
                raise WireError(f"init_group.relay[{i}]: a relay edge is a {self.group.backend} group of two ranks, got "
                                f"{g.backend} with {shown(g.world_size)}")


def _group_spec(data: Any, where: str) -> GroupSpec:
    if not isinstance(data, dict):
        raise WireError(f"{where}: expected a JSON object, got {type(data).__name__}")
    fields = {k: _field(data, k, kind, where) for k, kind in
              (("host", str), ("port", int), ("world_size", int), ("group_name", str), ("backend", str),
               ("timeout_s", (int, float)))}
    try:
        return GroupSpec(**{**fields, "timeout_s": _seconds(fields["timeout_s"], "group.timeout_s")})
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
        if not sane_text(self.session, MAX_SESSION_CHARS):
            raise WireError(f"claim.session: expected a printable string of 1 to {MAX_SESSION_CHARS} characters, "
                            f"got {shown(self.session)}")
        if not isinstance(self.takeover, bool):
            raise WireError(f"claim.takeover: expected true or false, got {shown(self.takeover)}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> ClaimRequest:
        takeover = _field(data, "takeover", bool, "claim") if isinstance(data, dict) and "takeover" in data else False
        return cls(_field(data, "session", str, "claim"), takeover)
