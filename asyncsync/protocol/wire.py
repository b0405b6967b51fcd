"""Messages of the weight-update protocol, as frozen dataclasses declared as data (``protocol/schema.py``).

A bucket travels as metadata over HTTP (names, dtypes, shapes, in packing order) and as bytes over
the data plane. Offsets are implied by the order, exactly as in SGLang's flattened bucket: each tensor
starts where the previous one ended, so the receiver recomputes them and checks their alignment.

Every message is validated completely when it is parsed (``from_json``) and, except ``BucketMeta``,
when it is built, before a receiver acts on any of it: each field's type and limits are declared in
its annotation and checked by the one reader of ``protocol/schema.py``, the rules that span fields
are each class's ``rules``. For any JSON value, ``from_json`` returns the message or raises
``WireError`` (``tests/faults/test_wire_properties.py`` checks exactly that). Numbers are finite and
within the limits below, strings are printable UTF-8 of bounded length, sizes and shape products
cannot overflow an int64, and an error message quotes at most ``ECHO_CHARS`` of any input (``shown``),
so a hostile request can neither crash a receiver nor make it answer with its own input.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from asyncsync.protocol.schema import (  # WireError, shown and sane_text are imported from here too
    Between, Check, Codec, Each, IfAbsent, Items, Key, Message, OmitDefault, Path, Positive, Text,
    WireError, is_int, read, sane_text, shown,
)
from asyncsync.protocol.digest import DIGEST_CHARS, valid_digest
from asyncsync.protocol.keys import KEY_HEX, is_key
from asyncsync.protocol.shm import ALIGN, HostIdentity, valid_segment_name
from asyncsync.protocol.specs import Bucket, TensorSpec, dtype_from_name, dtype_name

# The data plane's framing, agreed at /init_group (``InitGroupRequest.protocol``): 1 was bare payloads
# (asyncsync before frame headers); 2 sends a fixed-size header before every payload (``protocol.frames``);
# 3 keys every group (``GroupSpec.key``): sealed rendezvous values, a proof of the key when a group forms,
# a MAC in every frame header, and relay edges of host weights as authenticated streams (``protocol.stream``).
PROTOCOL_VERSION = 3

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
MAX_URL_CHARS = 2048
MAX_DTYPE_CHARS = 32
MAX_BOOT_ID_CHARS = 64       # a boot id is a UUID (36 characters)
MAX_ERROR_CHARS = 600        # the most of any error message a receiver answers with

# The field types messages share.
SECONDS = Positive(MAX_DEADLINE_S, f"expected seconds in (0, {MAX_DEADLINE_S:.0f}], got {{got}}")
Seconds = Annotated[float, SECONDS]  # a deadline: NaN, Infinity and 1e300 refused
Version = Annotated[int, Between(0, MAX_VERSION)]
Bytes = Annotated[int, Between(0, MAX_BYTES)]
TensorName = Annotated[str, Text(MAX_NAME_CHARS)]
DtypeName = Annotated[str, Text(MAX_DTYPE_CHARS, "expected a dtype name, got {got}")]
Shape = Annotated[tuple[int, ...], Items(0, MAX_DIMS), Each(Between(0, MAX_BYTES))]
ReceiveMode = Literal["background", "in_rpc"]
OMIT = OmitDefault()


def short(message: str) -> str:
    """``message`` cut to ``MAX_ERROR_CHARS``: what a receiver answers with, whatever input it names."""
    return message if len(message) <= MAX_ERROR_CHARS else message[: MAX_ERROR_CHARS - 15] + "... (truncated)"


HOST_RULE = "expected a host name or address, got {got}"
URL_RULE = "expected an http:// or https:// URL, got {got}"


def _http_url(url: str) -> bool:
    return url.startswith(("http://", "https://"))


def _resolvable(host: str) -> bool:
    """A name ``socket.getaddrinfo`` takes: it encodes a name as IDNA, which refuses an empty label
    (``a..b``) or one past 63 characters with a ``UnicodeError``, not the lookup error a receiver answers."""
    try:
        host.encode("idna")
    except UnicodeError:
        return False
    return True


def _no_key_or_key(value: Any) -> bool:
    return value == "" or is_key(value)


@dataclass(frozen=True)
class GroupSpec(Message):
    """Everything a member needs to join a data-plane group: where the rendezvous store is, how many
    ranks, the group's name (the store prefix), the backend and the deadline of every collective.

    ``backend``: ``gloo`` or ``nccl`` (a torch process group), or ``stream``: a relay edge of host
    weights, two ranks over one authenticated TCP stream (``protocol.stream``), which a receiver
    reads with bounded, checked reads (gloo aborts a process that is sent more than it posted).

    ``key`` (protocol 3): the group's data-plane key (``protocol.keys``), drawn by the trainer per
    group and epoch and carried only in the token-checked ``/init_group``; never shown in a repr.
    Without one (SGLang's groups, whose code is fixed) the group is not keyed."""

    WHERE = "group"
    host: Annotated[str, Text(MAX_HOST_CHARS, HOST_RULE, spaces=False), Check(_resolvable, HOST_RULE)]
    port: Annotated[int, Between(1, 65535, "{got} is not a port number")]
    world_size: Annotated[int, Between(2, MAX_WORLD_SIZE, "a group needs the trainer and at least one receiver (at "
                                                          f"most {MAX_WORLD_SIZE} ranks), got {{got}}")]
    group_name: Annotated[str, Text(MAX_GROUP_NAME_CHARS)]
    backend: Literal["gloo", "nccl", "stream"]
    timeout_s: Seconds
    key: Annotated[str, OMIT, Check(_no_key_or_key, f"expected {KEY_HEX} lowercase hex digits")] = \
        field(default="", repr=False)

    def rules(self) -> None:
        if self.backend == "stream" and self.world_size != 2:
            raise WireError(f"world_size: a stream is a relay edge of two ranks, got {self.world_size}")


@dataclass(frozen=True)
class BucketMeta(Message):
    """The metadata of one bucket: names, dtypes and shapes in packing order, and its byte size.

    Checked when decoded only: the trainer builds one per bucket of every version from its own plan,
    and checking a plan's every tensor again per version would cost the trainer's sender time."""

    WHERE = "bucket"
    CHECKED_WHEN_BUILT = False
    names: tuple[TensorName, ...]
    dtypes: tuple[DtypeName, ...]
    shapes: tuple[Shape, ...]
    nbytes: Bytes

    @classmethod
    def of(cls, bucket: Bucket) -> BucketMeta:
        return cls(
            tuple(s.name for s in bucket.specs), tuple(dtype_name(s.dtype) for s in bucket.specs),
            tuple(s.shape for s in bucket.specs), bucket.nbytes,
        )

    def rules(self) -> None:
        if not (len(self.names) == len(self.dtypes) == len(self.shapes)):
            raise WireError(f"shapes: names, dtypes and shapes differ in length ({len(self.names)}, {len(self.dtypes)}, "
                            f"{len(self.shapes)})")
        if not self.names:
            raise WireError("names: a bucket must hold at least one tensor")
        self._bucket(0)  # dtypes, alignment, overflow and the byte count

    def to_bucket(self, index: int) -> Bucket:
        """Rebuild the bucket with offsets implied by order; rejects misaligned or mis-sized layouts
        (``nbytes`` is at most ``MAX_BYTES``, so no shape whose product passes it is accepted)."""
        try:
            return self._bucket(index)
        except WireError as e:
            raise WireError(f"{self.WHERE}.{e}") from None

    def _bucket(self, index: int) -> Bucket:
        specs, offsets, offset = [], [], 0
        for i, (name, d, shape) in enumerate(zip(self.names, self.dtypes, self.shapes)):
            try:
                spec = TensorSpec(name, dtype_from_name(d), shape)
            except ValueError as e:
                raise WireError(f"dtypes[{i}]: {e}") from None
            if offset % spec.itemsize:
                raise WireError(f"dtypes[{i}]: tensor {shown(name)} would start at byte {offset}, not a multiple of its "
                                f"item size {spec.itemsize}")
            specs.append(spec)
            offsets.append(offset)
            offset += spec.nbytes
        if offset != self.nbytes:
            raise WireError(f"nbytes: is {shown(self.nbytes)} but the tensors add up to {offset} bytes")
        return Bucket(index, tuple(specs), tuple(offsets), offset)


def _host(value: Any, path: Path, reading: Any) -> HostIdentity:
    """A trainer's host identity (``shm.HostIdentity``, which reads its own JSON leniently)."""
    host = value if isinstance(value, HostIdentity) else HostIdentity.from_json(value)
    if host is None or not sane_text(host.boot_id, MAX_BOOT_ID_CHARS):
        reading.fail(path, "expected {'boot_id': str, 'shm_dev': int}")
    return host


def _aligned(offset: Any) -> bool:
    return is_int(offset) and 0 <= offset <= MAX_BYTES and not offset % ALIGN


@dataclass(frozen=True)
class SharedVersion(Message):
    """Where a same-host receiver finds a version instead of the data plane (``protocol/shm.py``):
    the shared-memory segment, each bucket's offset in it (a multiple of ``shm.ALIGN``, so that every
    tensor's view is aligned), each bucket's CRC32C (empty without checksums) and the trainer's host
    identity (a receiver elsewhere refuses at once)."""

    WHERE = "update.shm"
    segment: Annotated[str, Check(valid_segment_name, "{got} is not an asyncsync segment name")]
    offsets: Annotated[tuple[int, ...], Items(0, MAX_BUCKETS), Each(Check(
        _aligned, f"expected byte offsets in [0, {MAX_BYTES}], each a multiple of {ALIGN}, got {{got}}"))]
    crcs: Annotated[tuple[int, ...], Items(0, MAX_BUCKETS),
                    Each(Between(0, 2**32 - 1, "expected CRC32C values (unsigned 32-bit integers)"))]
    host: Annotated[HostIdentity, Codec(_host, HostIdentity.to_json)]

    def rules(self) -> None:
        if self.crcs and len(self.crcs) != len(self.offsets):
            raise WireError(f"crcs: {len(self.crcs)} checksum(s) for {len(self.offsets)} bucket(s)")


@dataclass(frozen=True)
class DeltaVersion(Message):
    """The version arrives as deltas against ``base``, the version the receiver committed last
    (``protocol/delta.py``): bucket i is broadcast as ``nbytes[i]`` encoded bytes, or whole where
    ``nbytes[i]`` is 0. The checksum manifest still carries the full buckets' CRC32Cs, which the
    rebuilt buckets must match; a receiver that does not hold ``base`` intact refuses the version."""

    WHERE = "update.delta"
    base: Annotated[int, Between(1, MAX_VERSION)]
    nbytes: Annotated[tuple[int, ...], Items(0, MAX_BUCKETS), Each(Between(0, MAX_BYTES))]


@dataclass(frozen=True)
class UpdateRequest(Message):
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
    last (``DeltaVersion``); the receiver rebuilds each in its staging and verifies the result.

    ``digest`` (``protocol/digest.py``): the trainer sends every bucket's cryptographic digest with
    ``end`` (``EndRequest``), over this server's own control channel; the receiver hashes each bucket
    as it lands (a delta's rebuilt bucket) and commits nothing whose digests are not the trainer's."""

    WHERE = "update"
    version: Version
    buckets: Annotated[tuple[BucketMeta, ...], Items(1, MAX_BUCKETS, f"must list 1 to {MAX_BUCKETS} buckets, got {{n}}")]
    checksum: bool
    deadlines_s: Annotated[tuple[float, ...], Items(0, MAX_BUCKETS), Each(SECONDS), OMIT] = ()
    # per bucket, the group it arrives on (InitGroupRequest.groups); () = all group 0
    sources: Annotated[tuple[int, ...], Items(0, MAX_BUCKETS), OMIT,
                       Each(Between(0, MAX_GROUPS - 1, f"expected group indexes in [0, {MAX_GROUPS}), got {{got}}"))] = ()
    receive: Annotated[ReceiveMode, OMIT] = "in_rpc"
    shm: Annotated[SharedVersion | None, OMIT] = None  # same-host receivers: the version is in shared memory, not on the data plane
    delta: Annotated[DeltaVersion | None, OMIT] = None  # buckets sent as deltas against the receiver's committed version
    digest: Annotated[bool, OMIT] = False  # every bucket's digest comes with ``end``: commit only what matches

    def rules(self) -> None:
        n = len(self.buckets)
        if self.nbytes > MAX_BYTES:
            raise WireError(f"buckets: the version would pass {MAX_BYTES} bytes")
        if self.delta is not None:
            self._delta_rules(self.delta)
        if self.shm is not None and len(self.shm.offsets) != n:
            raise WireError(f"shm.offsets: {len(self.shm.offsets)} offset(s) for {n} bucket(s)")
        if self.shm is not None and self.checksum and not self.shm.crcs:
            raise WireError("shm.crcs: the update has checksum true but the shared version carries none")
        if self.deadlines_s and len(self.deadlines_s) != n:
            raise WireError(f"deadlines_s: {len(self.deadlines_s)} deadline(s) for {n} bucket(s)")
        if self.sources and len(self.sources) != n:
            raise WireError(f"sources: {len(self.sources)} source(s) for {n} bucket(s)")

    def _delta_rules(self, delta: DeltaVersion) -> None:
        if len(delta.nbytes) != len(self.buckets):
            raise WireError(f"delta.nbytes: {len(delta.nbytes)} size(s) for {len(self.buckets)} bucket(s)")
        if not self.checksum or self.shm is not None:
            raise WireError("delta: a delta version needs checksum true (the rebuilt buckets are verified against it) "
                            "and comes over the data plane, not shared memory")
        if delta.base >= self.version:
            raise WireError(f"delta.base: {delta.base} is not older than the version {self.version}")
        over = [i for i, (n, b) in enumerate(zip(delta.nbytes, self.buckets)) if n >= b.nbytes]
        if over:
            raise WireError(f"delta.nbytes: bucket(s) {over} are no smaller as a delta than whole")

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


@dataclass(frozen=True)
class DiscardRequest(Message):
    """Drop what a receiver holds of ``version`` without applying it: a version being received, or
    received, in the background (``UpdateRequest.receive``) that the trainer abandoned. The receiver
    stops a receive still in progress by leaving the group (the trainer forms a new one). Carried
    where an ``UpdateRequest`` would be (vLLM's ``update_info``: ``protocol.tags.UPDATE_INFO``)."""

    version: Annotated[Version, Key("discard")]


# Every bucket's digest as the trainer computed it (``protocol/digest.py``), in broadcast order.
Digests = Annotated[tuple[str, ...], Items(0, MAX_BUCKETS), OMIT, Each(Check(
    valid_digest, f"expected digests of {DIGEST_CHARS} lower-case hex characters, got {{got}}"))]


@dataclass(frozen=True)
class CommitRequest(Message):
    """Apply ``version``, received and verified in the background (``UpdateRequest.receive``): the
    trainer's end of such a version, with its ``digests`` where it was announced with ``digest`` (it
    is applied only if its buckets hash to exactly these). Carried where an ``UpdateRequest`` would be
    (vLLM's ``update_info``, whose payloads carry the trainer's credential), not in vLLM's
    ``/finish_weight_update``, which reaches the worker with nothing to authenticate."""

    version: Annotated[Version, Key("commit")]
    digests: Digests = ()


def _spec(value: Any, path: Path, reading: Any) -> TensorSpec:
    """A tensor spec sent as ``[name, dtype, [sizes...]]`` (a ``LayoutCheck``'s, an adapter's),
    each part bounded and validated before a ``TensorSpec`` is made of it."""
    if isinstance(value, TensorSpec):
        return value
    name, dtype, shape = read(tuple[TensorName, DtypeName, Shape], value, path, reading)
    try:
        return TensorSpec(name, dtype_from_name(dtype), shape)
    except ValueError as e:
        reading.fail(path, short(str(e)))


def _spec_json(spec: TensorSpec) -> list[Any]:
    return [spec.name, dtype_name(spec.dtype), list(spec.shape)]


Spec = Annotated[TensorSpec, Codec(_spec, _spec_json)]


@dataclass(frozen=True)
class LayoutCheck(Message):
    """Asks a receiver, at ``connect``, whether it loads exactly these tensors; it refuses (an error
    that says ``specs.LAYOUT_REFUSED`` and the differences) if not. Carried where an ``UpdateRequest``
    would be (vLLM's ``update_info``: its routes cannot tell the trainer what the engine loads)."""

    specs: Annotated[tuple[Spec, ...], Key("check"),
                     Items(0, MAX_CHECKED_TENSORS, f"at most {MAX_CHECKED_TENSORS} tensors, got {{n}}")]


@dataclass(frozen=True)
class VersionRequest(Message):
    """``begin`` and ``end`` carry only the version they are about (decoded under the route's name:
    ``begin.version``)."""

    version: Version


@dataclass(frozen=True)
class EndRequest(Message):
    """``end``: commit ``version``. With ``digests`` (a version announced with ``digest``): the
    receiver commits the version only if the buckets it holds hash to exactly these."""

    WHERE = "end"
    version: Version
    digests: Digests = ()


@dataclass(frozen=True)
class InitGroupRequest(Message):
    """Join the data-plane group ``group`` as rank ``rank_offset`` (the trainer is rank 0), and, for a
    sharded trainer whose other ranks send buckets too, ``more_groups`` at the same rank: group i of
    ``groups`` is trainer rank i's (``UpdateRequest.sources`` says which group each bucket arrives on).

    ``protocol`` is the data plane's framing the trainer speaks (``PROTOCOL_VERSION``); a request
    without it comes from an asyncsync that sends bare payloads. Any other than this receiver's is
    refused here, before the rendezvous, so no payload of a foreign framing ever reaches the group.

    ``relay`` (``fanout`` other than ``direct``): one two-rank edge per server this one forwards to,
    in which it is rank 0 and the server below it rank 1: a ``stream`` for host weights (a gloo
    group), NCCL for CUDA weights. Their rendezvous is in the trainer's store (a trainer cannot pick
    a free port on another host), so this server joins as a client. A relaying server forwards every
    payload it receives, frame header first, as it lands.

    Every group and edge carries its data-plane key (``GroupSpec.key``): the only place a key travels.

    ``server_url``: the URL this trainer reaches the server at, where the server needs its own API
    (vLLM's pause guard resumes an engine whose trainer died while it was paused:
    ``receivers/vllm/guard.py``); receivers that need none ignore it."""

    WHERE = "init_group"
    group: GroupSpec
    rank_offset: int
    more_groups: Annotated[tuple[GroupSpec, ...], OMIT,
                           Items(0, MAX_GROUPS - 1, f"at most {MAX_GROUPS - 1} groups, got {{n}}")] = ()
    protocol: Annotated[int, IfAbsent(1)] = PROTOCOL_VERSION
    relay: Annotated[tuple[GroupSpec, ...], OMIT,
                     Items(0, MAX_RELAY_EDGES, f"at most {MAX_RELAY_EDGES} servers below one, got {{n}}")] = ()
    server_url: Annotated[str | None, OMIT, Text(MAX_URL_CHARS, URL_RULE, spaces=False), Check(_http_url, URL_RULE)] = None

    @property
    def groups(self) -> tuple[GroupSpec, ...]:
        return (self.group, *self.more_groups)

    def rules(self) -> None:
        if self.protocol != PROTOCOL_VERSION:
            raise WireError(f"protocol: the trainer speaks asyncsync data-plane protocol {shown(self.protocol)}"
                            f"{' (no protocol field: an asyncsync that sends bare payloads)' if self.protocol == 1 else ''}"
                            f", this server speaks {PROTOCOL_VERSION}: run the same asyncsync release on the trainer "
                            "and its servers")
        for g in self.groups:
            if not 1 <= self.rank_offset < g.world_size:
                raise WireError(f"rank_offset: must be in [1, world_size={g.world_size}), got {shown(self.rank_offset)}")
        if self.relay and self.more_groups:
            raise WireError("relay: a server relays only the versions of a trainer that sends from one rank "
                            "(more_groups names other sending ranks)")
        edge = "nccl" if self.group.backend == "nccl" else "stream"
        for i, g in enumerate(self.relay):
            if g.world_size != 2 or g.backend != edge:
                raise WireError(f"relay[{i}]: a relay edge below a {self.group.backend} group is a {edge} of two "
                                f"ranks, got {g.backend} with {shown(g.world_size)}")
        where = [("group", self.group), *((f"more_groups[{i}]", g) for i, g in enumerate(self.more_groups)),
                 *((f"relay[{i}]", g) for i, g in enumerate(self.relay))]
        for path, g in where:
            if not g.key:
                raise WireError(f"{path}.key: data-plane protocol {PROTOCOL_VERSION} keys every group; the trainer "
                                "sends each group's key here (an asyncsync that sends none is of another release)")


# -- which trainer owns a receiver -------------------------------------------------------------------

SESSION_HEADER = "X-Asyncsync-Session"  # every call of a trainer carries its session id (renews its lease)
OWNED_STATUS = 423  # HTTP status of a call refused because another trainer session owns the receiver
MAX_SESSION_CHARS = 200


@dataclass(frozen=True)
class ClaimRequest(Message):
    """A trainer session asks to own a receiver before it forms a group with it (``POST /claim``).

    ``session`` names the trainer process (``host:pid:random``; the same value travels in the
    ``SESSION_HEADER`` of all its calls). ``takeover`` claims the receiver even from a session that
    still looks alive: for replacing a trainer known to be hung faster than the receiver's lease.
    Receivers that predate claims answer 404 and are used as before (unprotected)."""

    WHERE = "claim"
    session: Annotated[str, Text(MAX_SESSION_CHARS)]
    takeover: bool = False
