"""Per-sync timings and counters, as a dict and as Prometheus text."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


@dataclass
class SyncResult:
    """What one sync of one version did, and where its time went (seconds)."""

    version: int
    nbytes: int
    buckets: int
    snapshot_s: float = 0.0  # copy of the parameters into packed buffers (async mode)
    pack_s: float = 0.0      # packing into the ring buffers (blocking mode)
    begin_s: float = 0.0     # waiting for the servers to begin (a pause lets the requests in flight finish)
    wire_s: float = 0.0      # broadcasts, from the first posted to the last finished
    apply_s: float = 0.0     # waiting for the servers to verify and swap in
    total_s: float = 0.0
    server_versions: dict[str, int] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)  # servers that did not apply it, and why
    repaired: list[str] = field(default_factory=list)  # servers a relay failed that got it sent again (fanout)
    switch_s: dict[str, float] = field(default_factory=dict)  # how long each server held generation to switch
    wire_bytes: int = 0      # bytes broadcast into the data-plane groups (deltas where they went out)
    delta_base: int | None = None  # the version the buckets sent as deltas were encoded against
    delta_buckets: int = 0   # buckets sent as deltas (the others whole)
    started: float = 0.0   # time.perf_counter() when the snapshot (async) or the pack (blocking) began
    send_started: float = 0.0
    finished: float = 0.0

    @property
    def gbps(self) -> float:
        return self.nbytes / self.total_s / 1e9 if self.total_s else 0.0


@dataclass(frozen=True)
class Footprint:
    """Bytes the sync's own buffers hold: ``device`` on the weights' device (a ring, snapshots, the
    shared-memory segments same-host servers map), of which ``baseline`` hold the delta baseline;
    ``host`` in host memory apart from the weights' device (a snapshot with ``snapshot: host``);
    ``conversion``: the most converting a version to the engines' layout allocates at once."""

    device: int = 0
    host: int = 0
    baseline: int = 0
    conversion: int = 0

    def __add__(self, other: Footprint) -> Footprint:
        return Footprint(self.device + other.device, self.host + other.host, self.baseline + other.baseline,
                         self.conversion + other.conversion)


@dataclass(frozen=True)
class SyncEvent:
    """Something that happened to a server: ``evicted``, ``rejoined`` or ``refused`` (a version)."""

    kind: str
    server: str
    version: int | None
    detail: str
    at: float  # time.time()


class SyncMetrics:
    """Thread-safe counters for one ``WeightSync``; the worker writes, anyone reads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.published = 0
        self.sent = 0
        self.superseded = 0
        self.failed = 0
        self.stall_s = 0.0  # total time the trainer was held in wait_snapshot()
        self.footprint = Footprint()  # the sync's own buffers, as connect allocated them
        # Bytes each server holds beside its live weights to receive versions (vLLM: a staging arena
        # per worker), as its engine client knows it; servers whose client cannot tell are not listed.
        self.receiver_staging_bytes: dict[str, int] = {}
        self.checks: dict[str, tuple[float, bool]] = {}  # server -> (largest logprob difference, diverged) at its last check
        self.unchecked: dict[str, int] = {}  # server -> checks it was asked for and could not be compared in
        self.last: SyncResult | None = None
        self.history: deque[SyncResult] = deque(maxlen=1024)  # recent syncs, oldest first
        self.events: deque[SyncEvent] = deque(maxlen=1024)    # recent faults, oldest first
        self.registry = CollectorRegistry()
        r = self.registry
        self._p_versions = Counter("asyncsync_versions", "Versions by outcome", ["outcome"], registry=r)
        self._p_bytes = Counter("asyncsync_bytes_sent", "Bytes of the versions synced, whole (asyncsync_wire_bytes: what crossed)", registry=r)
        self._p_stall = Counter("asyncsync_boundary_stall_seconds", "Time the trainer waited in wait_snapshot", registry=r)
        self._p_phase = Histogram("asyncsync_sync_phase_seconds", "Seconds per sync phase", ["phase"], registry=r)
        self._p_gbps = Gauge("asyncsync_last_sync_gbps", "Throughput of the last sync (GB/s)", registry=r)
        self._p_events = Counter("asyncsync_server_events", "Evictions, rejoins and refused versions", ["kind"], registry=r)
        self._p_server = Gauge("asyncsync_server_version", "Version each server serves", ["server"], registry=r)
        self._p_buffers = Gauge("asyncsync_buffer_bytes", "Bytes of the sync's own buffers on the weights' device", registry=r)
        self._p_host = Gauge("asyncsync_host_buffer_bytes", "Bytes of the sync's own buffers in host memory", registry=r)
        self._p_baseline = Gauge("asyncsync_delta_baseline_bytes", "Bytes of the sync's buffers that hold the delta baseline",
                                 registry=r)
        self._p_wire = Counter("asyncsync_wire_bytes", "Bytes broadcast into the data-plane groups (deltas where sent)",
                               registry=r)
        self._p_conversion = Gauge("asyncsync_conversion_bytes", "Most bytes converting to the engines' layout "
                                   "allocates at once per version", registry=r)
        self._p_staging = Gauge("asyncsync_receiver_staging_bytes", "Bytes each server holds to receive versions",
                                ["server"], registry=r)
        self._p_diverged = Counter("asyncsync_divergences", "Checks (verify) a server failed", ["server"],
                                   registry=r)
        self._p_unchecked = Counter("asyncsync_unchecked", "Checks (verify) a server was asked for and could not be "
                                    "compared in: it cannot score, its answer failed, or had another length than the "
                                    "probe, or it switched versions meanwhile", ["server"], registry=r)
        self._p_logprob = Gauge("asyncsync_logprob_max_diff", "Largest |trainer - server| log-probability at each "
                                "server's last check (verify)", ["server"], registry=r)
        self._p_switch = Gauge("asyncsync_server_switch_seconds", "How long each server held generation for the last switch",
                               ["server"], registry=r)

    def count(self, outcome: str, n: int = 1) -> None:
        """``outcome`` is one of published, sent, superseded, failed."""
        with self._lock:
            setattr(self, outcome, getattr(self, outcome) + n)
        self._p_versions.labels(outcome).inc(n)

    def event(self, kind: str, server: str, version: int | None, detail: str) -> None:
        with self._lock:
            self.events.append(SyncEvent(kind, server, version, detail, time.time()))
        self._p_events.labels(kind).inc()

    def checked(self, server: str, max_diff: float, diverged: bool) -> None:
        """A served check (``verify``) of ``server``: its largest difference, and whether it diverged."""
        with self._lock:
            self.checks[server] = (max_diff, diverged)
        self._p_logprob.labels(server).set(max_diff)
        if diverged:
            self._p_diverged.labels(server).inc()

    def could_not_check(self, server: str) -> None:
        """A check of ``server`` that could not compare its scores (``trainer/verify.py`` says why in its log)."""
        with self._lock:
            self.unchecked[server] = self.unchecked.get(server, 0) + 1
        self._p_unchecked.labels(server).inc()

    def stalled(self, seconds: float) -> None:
        with self._lock:
            self.stall_s += seconds
        self._p_stall.inc(seconds)

    def allocated(self, footprint: Footprint) -> None:
        with self._lock:
            self.footprint = footprint
        self._p_buffers.set(footprint.device)
        self._p_host.set(footprint.host)
        self._p_conversion.set(footprint.conversion)
        self._p_baseline.set(footprint.baseline)

    def staging(self, per_server: dict[str, int]) -> None:
        with self._lock:
            self.receiver_staging_bytes = dict(per_server)
        for server, nbytes in per_server.items():
            self._p_staging.labels(server).set(nbytes)

    def record(self, result: SyncResult) -> None:
        with self._lock:
            self.last = result
            self.history.append(result)
        self._p_bytes.inc(result.nbytes)
        self._p_wire.inc(result.wire_bytes)
        for phase in ("snapshot", "pack", "wire", "apply", "total"):
            self._p_phase.labels(phase).observe(getattr(result, f"{phase}_s"))
        self._p_gbps.set(result.gbps)
        for server, version in result.server_versions.items():
            self._p_server.labels(server).set(version)
        for server, seconds in result.switch_s.items():
            self._p_switch.labels(server).set(seconds)

    def as_dict(self) -> dict[str, Any]:
        with self._lock:
            last = asdict(self.last) if self.last else None
            if self.last:
                last["gbps"] = self.last.gbps
            return {
                "published": self.published, "sent": self.sent, "superseded": self.superseded,
                "failed": self.failed, "boundary_stall_s": self.stall_s, "buffer_bytes": self.footprint.device,
                "host_buffer_bytes": self.footprint.host, "conversion_bytes": self.footprint.conversion,
                "baseline_bytes": self.footprint.baseline,
                "receiver_staging_bytes": dict(self.receiver_staging_bytes), "last": last,
                "checks": {u: {"max_diff": d, "diverged": x} for u, (d, x) in self.checks.items()},
                "unchecked": dict(self.unchecked),
                "events": [asdict(e) for e in self.events],
            }

    def prometheus_text(self) -> str:
        return generate_latest(self.registry).decode()
