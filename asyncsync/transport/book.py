"""The book of servers: what the trainer knows of each server, changed only by named transitions.

Every server of a sender has one ``ServerRecord``, a frozen value; the book replaces it whenever
something happened to the server, through one of the transitions below, and nothing outside this
module writes a server's state (``tests/test_architecture.py`` checks that)::

    book = ServerBook(urls, metrics)
    book.claimed(url, ranks, shared)    # an epoch claimed it: its data-plane ranks, whether it maps shared memory
    book.reported(url, version)         # it said which version it serves
    book.took(url, version, holds)      # it committed a weights version: its next delta's baseline
    book.wrote(url)                     # it wrote an adapter version (served once loaded: ``loaded``)
    book.loaded(url, version)           # its engine loaded adapter version ``version``
    book.refused(url, version, why)     # it answered no: keeps its version (a layout refusal is kept)
    book.unreachable(url, why)          # it gave no answer: evicted (its lease retired), probed once
                                        # ``readmit_interval_s`` passed (again after each failed probe)
    book.distrusted(url, why)           # it forwarded bytes the trainer did not publish: evicted, named
    book.probed(url)                    # an evicted server did not answer a readmission probe: not before
                                        # another ``readmit_interval_s``
    book.expelled(url, why)             # evict it when the next version starts (``verify``'s divergence)
    book.rejoined(url, epoch)           # an evicted server is in an epoch's groups again
    book.verified(url)                  # the served check asked it (``verify``): it owes none until evicted

Readers get values (``record``, ``versions``, ``baselines``...), never the records' dict. The book is
shared by the sender's thread, the control loop (adapter loads) and the trainer (``server_versions``),
so every transition and read holds its lock.

Shared memory: a server's ``lease`` is the trainer's segments it still maps (its ``end`` answers).
A ``SegmentPool`` tracks the book (``lease_from``) so that it never rewrites a leased segment, and an
evicted server's lease, and the segment it may still be reading, are retired (never written again).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from asyncsync.metrics import SyncMetrics
from asyncsync.protocol.specs import LAYOUT_REFUSED

if TYPE_CHECKING:
    from asyncsync.transport.shm import SegmentPool

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerRecord:
    """One server as the trainer knows it.

    ``version``: what it serves (its weights', or with ``lora: adapter`` its newest adapter version);
    ``baseline``: the version it committed from this sync, the base of its next delta (None: it gets
    the next version whole); ``refusing``: why it refuses this plan's layout (every later version too);
    ``shared``: it maps versions from the trainer's shared memory; ``ranks``: its data-plane ranks;
    ``lease``: the shared-memory segments it still maps; ``evicted``: why it is out of the groups, and
    ``evicted_at`` since when (``time.monotonic``: its eviction, or the last probe it failed);
    ``expelled``: why it is to be evicted when the next version starts; ``owes_check``: the served
    check (``trainer/verify.py``) has not asked it since it joined (at connect, or readmitted after an
    eviction: it may serve from other state than when it was last asked), so it is due for it."""

    url: str
    version: int = 0
    baseline: int | None = None
    refusing: str | None = None
    shared: bool = False
    ranks: int | None = None
    lease: frozenset[str] = frozenset()
    evicted: str | None = None
    evicted_at: float = 0.0
    expelled: str | None = None
    owes_check: bool = True


class ServerBook:
    """Every server's record, and the transitions that change them (the module doc)."""

    def __init__(self, urls: Iterable[str], metrics: SyncMetrics):
        self.metrics = metrics
        self._records = {url: ServerRecord(url) for url in urls}
        self._lock = threading.Lock()
        self._pool: SegmentPool | None = None

    def lease_from(self, pool: SegmentPool) -> None:
        """Versions are packed into ``pool``'s segments: it must not rewrite what a server maps."""
        self._pool = pool
        pool.track(self.leased)

    # -- reads ------------------------------------------------------------------------------------

    def record(self, url: str) -> ServerRecord:
        with self._lock:
            return self._records[url]

    def versions(self, urls: Iterable[str] | None = None) -> dict[str, int]:
        """The version each server serves, as last reported (of ``urls``, or every server)."""
        with self._lock:
            return {u: self._records[u].version for u in (self._records if urls is None else urls)}

    def baselines(self) -> dict[str, int]:
        """Each server's delta baseline: the version it committed from this sync (servers without one omitted)."""
        with self._lock:
            return {u: r.baseline for u, r in self._records.items() if r.baseline is not None}

    def refusing(self) -> dict[str, str]:
        with self._lock:
            return {u: r.refusing for u, r in self._records.items() if r.refusing is not None}

    def evicted(self) -> dict[str, str]:
        with self._lock:
            return {u: r.evicted for u, r in self._records.items() if r.evicted is not None}

    def evicted_since(self) -> dict[str, float]:
        """Each evicted server's ``evicted_at``: when it was evicted, or last failed a probe."""
        with self._lock:
            return {u: r.evicted_at for u, r in self._records.items() if r.evicted is not None}

    def shared(self) -> frozenset[str]:
        with self._lock:
            return frozenset(u for u, r in self._records.items() if r.shared)

    def ranks(self) -> dict[str, int]:
        """Each server's data-plane ranks, as it reported them when last claimed."""
        with self._lock:
            return {u: r.ranks for u, r in self._records.items() if r.ranks is not None}

    def owing_check(self) -> frozenset[str]:
        """The servers in the groups (not evicted, not refusing this plan) that owe the served check."""
        with self._lock:
            return frozenset(u for u, r in self._records.items()
                             if r.owes_check and r.evicted is None and r.refusing is None)

    def leased(self) -> frozenset[str]:
        """Every shared-memory segment some server still maps."""
        with self._lock:
            return frozenset().union(*(r.lease for r in self._records.values()))

    # -- transitions ------------------------------------------------------------------------------

    def claimed(self, url: str, ranks: int, shared: bool) -> None:
        self._set(url, ranks=ranks, shared=shared)

    def reported(self, url: str, version: int) -> None:
        self._set(url, version=version)

    def took(self, url: str, version: int, holds: frozenset[str] = frozenset()) -> None:
        """It committed weights version ``version`` of this sync (its next delta's base) and still maps ``holds``."""
        self._set(url, version=version, baseline=version, refusing=None,
                  lease=holds if self.record(url).shared else frozenset())

    def wrote(self, url: str) -> None:
        """It verified and wrote an adapter version; its weights are unchanged, and no delta base is kept."""
        self._set(url, baseline=None, refusing=None)

    def loaded(self, url: str, version: int) -> None:
        """Its engine loaded adapter version ``version`` (its served version only moves forward)."""
        with self._lock:
            record = self._records[url]
            self._records[url] = replace(record, version=max(record.version, version))

    def refused(self, url: str, version: int, why: str) -> None:
        """It answered no to ``version``: it keeps serving its own, and gets the next one whole. A layout
        refusal is kept: every later version of this plan would be refused too."""
        self._set(url, baseline=None, **({"refusing": why} if LAYOUT_REFUSED in why else {}))
        self.metrics.event("refused", url, version, why)

    def missed(self, url: str) -> None:
        """It did not take the version (whatever it answered): the next one goes to it whole."""
        self._set(url, baseline=None)

    def unreachable(self, url: str, why: str, reading: str | None = None) -> None:
        """It gave no answer (dead, hung past a deadline, never claimed, or a readmission probe): evicted,
        from now (``evicted_at``: it is not called again before ``readmit_interval_s``). It may come back
        restarted, so its next version is whole and the served check is due for it again; it loses its
        lease, and the segments it held or was ``reading`` are retired, never rewritten under it."""
        with self._lock:
            record = self._records[url]
            self._records[url] = replace(record, baseline=None, lease=frozenset(), evicted=why,
                                         evicted_at=time.monotonic(), expelled=None, owes_check=True)
        if self._pool is not None:
            self._pool.retire(record.lease | ({reading} if reading else set()))
        if record.evicted is None:
            self.metrics.event("evicted", url, None, why)
            log.warning("evicted %s: %s", url, why)

    def distrusted(self, url: str, version: int, why: str) -> None:
        """It relayed bytes of ``version`` that the trainer did not publish (the servers below it refused
        them against the trainer's digests): evicted like a server that gave no answer (readmitted
        later with a whole version, and checked as every server is), and named in a ``forged`` event."""
        self.metrics.event("forged", url, version, why)
        log.error("%s forwarded bytes of version %d the trainer did not publish: %s", url, version, why)
        self.unreachable(url, why)

    def probed(self, url: str) -> None:
        """An evicted server did not answer its readmission probe: it stays evicted (for its first
        reason), and is not called again before another ``readmit_interval_s`` (``evicted_at``)."""
        self._set(url, evicted_at=time.monotonic())

    def expelled(self, url: str, why: str) -> None:
        """Evict it between versions, not during one: when the next version starts (``take_expelled``)."""
        self._set(url, expelled=why)

    def take_expelled(self) -> dict[str, str]:
        """The servers ``expelled`` named since the last call, and why; they are evicted now."""
        with self._lock:
            out = {u: r.expelled for u, r in self._records.items() if r.expelled is not None}
        for url, why in out.items():
            self.unreachable(url, why)
        return out

    def rejoined(self, url: str, epoch: int) -> None:
        with self._lock:
            record = self._records[url]
            self._records[url] = replace(record, evicted=None)
        if record.evicted is not None:
            self.metrics.event("rejoined", url, None, f"epoch {epoch}")

    def verified(self, url: str) -> None:
        """The served check asked it (it compared its scores, or it cannot score): it owes no check
        until it is evicted; later checks come on the check's own schedule (``verify_every``)."""
        self._set(url, owes_check=False)

    def _set(self, url: str, **changes: object) -> None:
        with self._lock:
            self._records[url] = replace(self._records[url], **changes)  # type: ignore[arg-type]
