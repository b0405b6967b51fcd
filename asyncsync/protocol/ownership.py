"""Which trainer session a receiver belongs to, so that a second trainer is refused instead of racing.

Without it, two trainer processes connecting to the same servers (two FSDP ranks each calling
``connect()``) each form a data-plane group with them, and each server ends up in whichever group
asked last, or the groups time out half-formed. With it::

    owners = TrainerOwnership(lease_s=120)
    owners.claim(session, takeover=False)     # POST /claim: granted, or OwnedByAnotherTrainer (HTTP 423)
    owners.joined(session, host, port)        # after /init_group: where the owner's rendezvous store is
    owners.check(session)                     # before every weight-update call (init_group, begin, update, end)
    owners.seen(session)                      # on every call: the owner's lease is renewed
    owners.release(session)                   # POST /release, sent by the trainer's close()

A claim is granted when nobody owns the receiver, when the session already does, with ``takeover``,
or when the owner is gone: it released the receiver (``close()``), its rendezvous store no longer
accepts connections (the store lives in the trainer's process, so a crashed or killed trainer is
known dead at once), or it made no call for ``lease_s`` (a hung trainer whose socket still accepts:
the bounded wait). A weight-update call from anyone but the owner is refused the same way, so a
trainer that was taken over hears it on its next version instead of corrupting the new owner's.
Callers that send no session (trainers that predate claims, hand-made requests) are one anonymous
session: an unclaimed receiver serves them as before, a claimed one refuses them.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from asyncsync.protocol.shm import alive

log = logging.getLogger(__name__)

STORE_PROBE_S = 0.5  # a store that neither accepts nor refuses within this long counts as alive
OWNER_SAYS = "this server belongs to trainer session"  # a refusal names the owner right after this


class OwnedByAnotherTrainer(Exception):
    """A call came from another trainer session than the one that owns the receiver (HTTP 423)."""


def local_pid(session: str) -> int | None:
    """The pid of a trainer session (``host:pid:random``) that runs on this host, else None: a
    same-host trainer that syncs through shared memory forms no group whose store could be probed."""
    parts = session.split(":")
    if len(parts) == 3 and parts[0] == socket.gethostname() and parts[1].isascii() and parts[1].isdigit() \
            and len(parts[1]) <= 7:  # Linux pids stay below 2**22
        return int(parts[1])
    return None


def store_reachable(host: str, port: int) -> bool:
    """Whether the trainer's rendezvous store still accepts connections; False only when it refuses
    (the process that hosted it is gone). Unanswered probes count as alive: never steal on a timeout."""
    try:
        socket.create_connection((host, port), timeout=STORE_PROBE_S).close()
    except ConnectionRefusedError:
        return False
    except OSError:
        return True
    return True


@dataclass
class _Owner:
    session: str
    since: float
    last_seen: float
    store: tuple[str, int] | None = None  # the owner's rendezvous store, once it formed a group here


class TrainerOwnership:
    """The owner of one receiver and the rules above; thread-safe (the server calls it from its event
    loop and from worker threads). ``clock`` and ``reachable`` are injectable for tests."""

    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic,
                 reachable: Callable[[str, int], bool] = store_reachable):
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive, got {lease_s}")
        self.lease_s = lease_s
        self._clock, self._reachable = clock, reachable
        self._owner: _Owner | None = None
        self._lock = threading.Lock()

    @property
    def owner(self) -> str | None:
        with self._lock:
            return self._owner.session if self._owner else None

    def admits(self, session: str) -> bool:
        """Fast path, no probe: ``session`` owns the receiver or nobody does."""
        owner = self._owner
        return owner is None or owner.session == session

    def seen(self, session: str) -> None:
        """A call from ``session``: renews the lease if it is the owner's."""
        owner = self._owner
        if owner is not None and owner.session == session:
            owner.last_seen = self._clock()

    def claim(self, session: str, takeover: bool = False) -> None:
        """Make ``session`` the owner, or raise ``OwnedByAnotherTrainer`` saying who owns the receiver and what to do."""
        with self._lock:
            now = self._clock()
            owner = self._owner
            if owner is not None and owner.session != session:
                gone = self._gone(owner, now)
                if gone is None and not takeover:
                    raise OwnedByAnotherTrainer(self._refusal(owner, session, now))
                log.warning("trainer session %s takes this server over from %s (%s)", session, owner.session,
                            gone or "takeover requested")
                owner = None
            if owner is None:
                self._owner = _Owner(session, now, now)
                log.info("owned by trainer session %s", session)
            else:
                owner.last_seen = now

    def check(self, session: str) -> None:
        """Before a weight-update call: raise ``OwnedByAnotherTrainer`` unless ``session`` owns the
        receiver, nobody does, or the owner is gone (then nobody does any more)."""
        with self._lock:
            owner, now = self._owner, self._clock()
            if owner is None or owner.session == session:
                return
            gone = self._gone(owner, now)
            if gone is None:
                raise OwnedByAnotherTrainer(self._refusal(owner, session, now))
            log.warning("trainer session %s is gone (%s): this server is unclaimed", owner.session, gone)
            self._owner = None

    def joined(self, session: str, host: str, port: int) -> None:
        """``session`` formed a data-plane group whose store is at host:port (probed to tell if it died)."""
        with self._lock:
            if self._owner is None and session:
                self._owner = _Owner(session, self._clock(), self._clock())  # a group formed without a claim
            if self._owner is not None and self._owner.session == session:
                self._owner.store = (host, port)

    def release(self, session: str) -> bool:
        """``session`` is done (its ``close()``); True if it was the owner."""
        with self._lock:
            if self._owner is None or self._owner.session != session:
                return False
            self._owner = None
            log.info("released by trainer session %s", session)
            return True

    def _gone(self, owner: _Owner, now: float) -> str | None:
        """Why ``owner`` counts as gone, or None while it may still be syncing."""
        if now - owner.last_seen > self.lease_s:
            return f"no call for {now - owner.last_seen:.0f}s, past the {self.lease_s:.0f}s lease"
        if owner.store is not None and not self._reachable(*owner.store):
            return f"its rendezvous store {owner.store[0]}:{owner.store[1]} refuses connections"
        pid = local_pid(owner.session)
        if pid is not None and not alive(pid):
            return f"its process {pid} on this host no longer exists"
        return None

    def _refusal(self, owner: _Owner, session: str, now: float) -> str:
        who = f"session {session!r}" if session else "a caller without a session"
        store = f"; its rendezvous store {owner.store[0]}:{owner.store[1]} still answers" if owner.store else ""
        left = max(0.0, self.lease_s - (now - owner.last_seen))
        return (f"{OWNER_SAYS} {owner.session!r} (last call {now - owner.last_seen:.1f}s "
                f"ago{store}), so {who} is refused: only one trainer may sync a server. Close the other trainer "
                f"(its close() releases the server), wait {left:.0f}s for its lease to expire if it hung, or "
                "connect with takeover: true")
