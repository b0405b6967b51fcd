"""The data plane: a torch.distributed process group between the trainer (rank 0) and the receivers.

Groups are built without touching torch.distributed's global default group (a trainer already has
one for its own training, and a server may have one for tensor parallelism): a TCPStore rendezvous,
then a backend-specific process group object used directly. Keys and the start-up handshake are
exactly those of SGLang's ``init_custom_process_group`` (``PrefixStore(group_name)``, then torch's
``_new_process_group_helper`` adds ``group_name/`` and the device type, and the backend exchanges a
sequence number through the store), so an SGLang server joins the trainer's group as it is.

asyncsync's own receivers warm every group with one small broadcast right after creation: a lazily
initialised NCCL communicator deadlocks when its first use comes under memory pressure in the middle
of a sync. SGLang does not take part in such a broadcast, so its groups are joined with ``warmup=False``.

The rendezvous gives up at the group's ``timeout_s`` however the other side behaves: torch's
``TCPStore`` client waits without a deadline for a peer that accepts the connection and never
answers. So a member first checks, with a deadline, that a store answers at the address
(``_store_answers``), and the rendezvous runs on a thread of its own, which the joining thread
leaves at the deadline (or when another thread abandons the join: ``Abandoner``), shutting down the
thread's connections to the store so that it ends too.

What differs between gloo and NCCL (which stream a collective waits on, what a wait blocks, how a
failed group is torn down, the enqueue lock) is the member's ``Runtime`` (``protocol.device``).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import BroadcastOptions, PrefixStore, TCPStore

from asyncsync.protocol.device import ENQUEUE_LOCK, Runtime, scoped_env
from asyncsync.protocol.wire import GroupSpec

log = logging.getLogger(__name__)

_DEVICE_PREFIX = {"gloo": "cpu/", "nccl": "cuda/"}  # the device type torch's _new_process_group_helper adds
RENDEZVOUS_GRACE_S = 1.0  # past timeout_s: torch's own deadlines fire first wherever the peer answers at all
_POLL_S = 0.05  # how often a joining thread looks whether its join was abandoned
# What torch's TCPStore client sends first (c10d/TCPStore.cpp, QueryType and validationMagicNumber).
_STORE_VALIDATE, _STORE_PING, _STORE_MAGIC = 0, 13, 0x3C85F7CE


class DataPlaneError(RuntimeError):
    """A rendezvous or collective failed or missed its deadline."""


def resolve_backend(backend: str, runtime: Runtime) -> str:
    """The data-plane backend for weights on ``runtime``'s device: ``auto`` is NCCL for CUDA weights and
    gloo for everything else (CUDA on the machine is not enough: CPU weights go over gloo). A backend
    named in the config must be the one the weights' device takes."""
    if backend in ("auto", runtime.wire_backend):
        return runtime.wire_backend
    raise DataPlaneError(f"backend {backend!r} cannot send weights on {runtime.device}, which take "
                         f"{runtime.wire_backend}; use backend: auto")


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now (another process may take it before it is bound again);
    ``DataPlaneError`` when none can be had (no such address, or out of file descriptors)."""
    try:
        with socket.socket() as s:
            s.bind((host, 0))
            return s.getsockname()[1]
    except OSError as e:
        raise DataPlaneError(f"no free port on {host}: {e}") from None


class Abandoner:
    """Lets one thread give up the rendezvous another thread is in (a server whose trainer asks for a
    new group, or releases it, while a join hangs on a silent peer): ``watch()`` when a join starts,
    ``abandon()`` from anywhere; the join then fails at once with ``DataPlaneError``."""

    def __init__(self) -> None:
        self._epoch = 0

    def abandon(self) -> None:
        self._epoch += 1

    def watch(self) -> Callable[[], bool]:
        """For a join starting now: whether ``abandon`` was called since."""
        epoch = self._epoch
        return lambda: self._epoch != epoch


class Work:
    """A collective in flight and its deadline."""

    __slots__ = ("handle", "timeout")

    def __init__(self, handle: Any, timeout: timedelta):
        self.handle, self.timeout = handle, timeout


class DataPlaneGroup:
    """One member's handle on a group: broadcast from rank 0, with the deadline given at creation.

    Lifecycle::

        group = DataPlaneGroup.join(spec, rank, runtime)   # blocks until every rank joined, then warms up
        for bucket in buckets:
            work = group.broadcast_async(buffer)           # rank 0 sends, every other rank receives in place
            group.wait(work)                               # raises DataPlaneError by the group's deadline
        group.close(broken=failed)                         # abort() after a failure, shutdown() otherwise
    """

    def __init__(self, spec: GroupSpec, rank: int, store: TCPStore, pg: Any, runtime: Runtime):
        self.spec, self.rank, self._store, self._pg, self.runtime = spec, rank, store, pg, runtime
        self.timeout = timedelta(seconds=spec.timeout_s)

    @property
    def device(self) -> torch.device:
        return self.runtime.device

    @classmethod
    def join(cls, spec: GroupSpec, rank: int, runtime: Runtime, warmup: bool = True,
             abandoner: Abandoner | None = None, hosts_store: bool | None = None) -> DataPlaneGroup:
        """Join as ``rank``; blocks until every rank joined, and raises ``DataPlaneError`` by
        ``spec.timeout_s`` (+ ``RENDEZVOUS_GRACE_S``) whatever the peer does, or as soon as
        ``abandoner`` abandons the join. Every member must agree on ``warmup``. ``runtime`` is the
        member's device: its data-plane backend must be the group's. ``hosts_store``: whether this
        member runs the rendezvous store (default: rank 0 does; a relaying server is rank 0 of a group
        whose store the trainer runs)."""
        if spec.backend != runtime.wire_backend:
            raise DataPlaneError(f"rank {rank}: the group '{spec.group_name}' uses {spec.backend}, but this member's "
                                 f"tensors are on {runtime.device}, which takes {runtime.wire_backend}: put both sides' "
                                 "weights on the same kind of device or set the trainer's backend to match")
        master = rank == 0 if hosts_store is None else hosts_store
        store, pg = _rendezvous(spec, rank, runtime, abandoner.watch() if abandoner else lambda: False, master)
        group = cls(spec, rank, store, pg, runtime)
        if warmup:
            group.broadcast(torch.zeros(1, dtype=torch.uint8, device=runtime.device))
        log.info("rank %d joined data-plane group %s (%s, world %d)", rank, spec.group_name, spec.backend, spec.world_size)
        return group

    def broadcast_async(self, tensor: torch.Tensor, timeout_s: float | None = None) -> Work:
        """Start a broadcast from rank 0 into ``tensor`` on every rank; pass the result to ``wait``.
        It is ordered after the calling thread's current stream (NCCL) and enqueued under the
        process-wide lock. ``timeout_s`` is this broadcast's deadline (default: the group's); gloo
        applies it to the operation itself, so a rank 0 whose send misses it closes its connections
        and releases the other ranks."""
        if self._pg is None:
            raise DataPlaneError(f"rank {self.rank}: group '{self.spec.group_name}' is closed")
        timeout = timedelta(seconds=timeout_s) if timeout_s is not None else self.timeout
        opts = BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        opts.timeout = timeout
        with ENQUEUE_LOCK:
            return Work(self._pg.broadcast([tensor], opts), timeout)

    def broadcast(self, tensor: torch.Tensor, timeout_s: float | None = None) -> None:
        self.wait(self.broadcast_async(tensor, timeout_s))

    def wait(self, work: Work) -> None:
        """Until ``work`` is done (host and current stream), or ``DataPlaneError`` at its deadline."""
        try:
            self.runtime.wait_work(work.handle, work.timeout)
        except Exception as e:
            raise DataPlaneError(
                f"rank {self.rank}: broadcast in group '{self.spec.group_name}' failed or exceeded "
                f"{work.timeout.total_seconds():.1f}s: {e}"
            ) from None

    def barrier(self) -> None:
        """Wait until every rank got here: benchmarks use it to time delivery, not just sending."""
        self.wait(Work(self._pg.barrier(), self.timeout))

    def close(self, broken: bool = False) -> None:
        """Release the group. After a failure (``broken``) it is aborted, which kills in-flight
        collectives instead of waiting for them (on NCCL ``shutdown`` would hang on a dead peer)."""
        pg, self._pg, self._store = self._pg, None, None
        if pg is None:
            return
        try:
            (self.runtime.abort if broken else self.runtime.shutdown)(pg)
        except Exception as e:  # the group is gone either way
            log.debug("closing group %s: %s", self.spec.group_name, e)


def _form(spec: GroupSpec, rank: int, runtime: Runtime, master: bool) -> tuple[TCPStore, Any]:
    """The rendezvous store and the process group (blocking; ``_rendezvous`` bounds it)."""
    timeout = timedelta(seconds=spec.timeout_s)
    try:
        store = TCPStore(spec.host, spec.port, spec.world_size, master, timeout=timeout, wait_for_workers=False)
    except Exception as e:  # torch raises several types (RuntimeError, DistNetworkError)
        raise DataPlaneError(f"rank {rank}: rendezvous at {spec.host}:{spec.port} failed: {e}") from e
    # SGLang's key layout: {name}/{name}//{device}//<key>
    named = PrefixStore(f"{spec.group_name}/", PrefixStore(spec.group_name, store))
    try:
        with scoped_env(runtime.group_env):  # the group's error policy, read by its constructor
            pg = runtime.process_group(PrefixStore(_DEVICE_PREFIX[spec.backend], named), rank, spec.world_size, timeout)
        pg._set_sequence_number_for_group()  # rank 0 publishes it, the others wait for it: torch does the same
    except Exception as e:
        raise DataPlaneError(
            f"rank {rank}: could not form the {spec.backend} group '{spec.group_name}' of {spec.world_size} "
            f"within {spec.timeout_s}s ({e}); check that every server reached {spec.host}:{spec.port}"
        ) from e
    return store, pg


def _rendezvous(spec: GroupSpec, rank: int, runtime: Runtime, abandoned: Callable[[], bool],
                master: bool) -> tuple[TCPStore, Any]:
    """``_form`` on a thread of its own, waited for until ``spec.timeout_s`` + ``RENDEZVOUS_GRACE_S``
    or until ``abandoned()``. A rendezvous given up has its connection to the store shut down, so the
    thread, blocked in torch on a silent peer, ends too. The thread inherits the caller's CPU
    priority and cores (and so do the group's own threads)."""
    before = set(_sockets().values())
    outcome: list[Any] = []
    done, stop = threading.Event(), threading.Event()
    store_ready = time.monotonic() + spec.timeout_s

    def run() -> None:
        try:
            runtime.enter_thread()
            if not master and not _store_answers(spec, store_ready, stop) or stop.is_set():
                return  # given up: the joining thread has said why
            outcome.append(_form(spec, rank, runtime, master))
        except BaseException as e:  # handed to the joining thread
            outcome.append(e)
        finally:
            done.set()

    threading.Thread(target=run, name="asyncsync-rendezvous", daemon=True).start()
    give_up = time.monotonic() + spec.timeout_s + RENDEZVOUS_GRACE_S
    while not done.wait(_POLL_S):
        why = ("was abandoned (a newer join or a release)" if abandoned() else
               f"got no answer within {spec.timeout_s:g}s" if time.monotonic() > give_up else None)
        if why is not None:
            stop.set()
            shut = _shut_new_connections(spec.port, before)
            # The rendezvous thread may connect only after this sweep (a store that answered the probe
            # and then fell silent), and torch's client retries a broken connection until the group's
            # timeout: until the thread ends, its connections keep being shut.
            threading.Thread(target=_reap, args=(spec.port, before, done, time.monotonic() + spec.timeout_s + 1),
                             name="asyncsync-rendezvous-reaper", daemon=True).start()
            log.warning("rank %d: rendezvous at %s:%d %s; %d connection(s) shut", rank, spec.host, spec.port, why, shut)
            raise DataPlaneError(f"rank {rank}: rendezvous at {spec.host}:{spec.port} {why}: is the trainer's "
                                 "rendezvous store listening there, and can the group's members reach each other "
                                 "(gloo connects every pair of them directly, on any port)?")
    if not outcome:
        raise DataPlaneError(f"rank {rank}: no rendezvous store answered at {spec.host}:{spec.port} within "
                             f"{spec.timeout_s:g}s: is the trainer's store listening there?")
    (result,) = outcome
    if isinstance(result, BaseException):
        raise result
    return result


def _store_answers(spec: GroupSpec, until: float, stop: threading.Event) -> bool:
    """Wait until a rendezvous store answers at ``spec``'s address (its connection closed at once),
    or until ``until`` or ``stop``: False then. torch's client waits without a deadline for a peer
    that accepts and never answers, and retries a refused or broken connection on its own until the
    group's timeout, in a loop nothing can end early; this probe ends within ``_POLL_S`` of ``stop``.
    It sends what torch's client sends first (c10d's TCPStore, torch 2.13: a validate message with
    its magic number, then a ping the store answers with its nonce): every group the tests form
    runs it against torch's own store, so a torch whose store spoke otherwise would fail them all."""
    nonce = secrets.randbits(32)
    hello = struct.pack("<BIBI", _STORE_VALIDATE, _STORE_MAGIC, _STORE_PING, nonce)
    while not stop.is_set() and time.monotonic() < until:
        try:
            with socket.create_connection((spec.host, spec.port), timeout=max(_POLL_S, min(1.0, until - time.monotonic()))) as s:
                s.sendall(hello)
                s.settimeout(_POLL_S)
                reply = b""
                while len(reply) < 4 and not stop.is_set() and time.monotonic() < until:
                    try:
                        chunk = s.recv(4 - len(reply))
                    except TimeoutError:
                        continue
                    if not chunk:
                        break
                    reply += chunk
                if reply == struct.pack("<I", nonce):
                    return True
        except OSError:  # refused (not listening yet), unreachable, reset, no such host: again
            pass
        stop.wait(_POLL_S)
    return False


def _reap(port: int, before: set[str], done: threading.Event, until: float) -> None:
    """Shut the given-up rendezvous thread's connections to ``port`` until it ended (``done``), or
    until ``until``, past which torch's client stops retrying."""
    while not done.wait(_POLL_S) and time.monotonic() < until:
        _shut_new_connections(port, before)


def _sockets() -> dict[int, str]:
    """This process's sockets: file descriptor -> its inode (``socket:[n]``, unique while the socket
    lives, unlike descriptor numbers, which are reused at once). Empty where /proc cannot be read."""
    found = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:"):
            found[int(fd)] = target
    return found


def _shut_new_connections(port: int, before: set[str]) -> int:
    """Shut down (both ways) this process's TCP connections to remote ``port`` that are not among the
    sockets ``before``: a rendezvous thread blocked reading from its store then returns with an error.
    Returns how many were shut; 0 where sockets cannot be listed (the thread then ends whenever the
    peer closes, and only its socket is held meanwhile)."""
    shut = 0
    for fd, inode in _sockets().items():
        if inode in before:
            continue
        try:
            with socket.socket(fileno=os.dup(fd)) as s:  # closing the duplicate leaves ``fd`` open
                if s.type == socket.SOCK_STREAM and s.family in (socket.AF_INET, socket.AF_INET6) \
                        and s.getpeername()[1] == port:
                    s.shutdown(socket.SHUT_RDWR)
                    shut += 1
        except OSError:  # closed meanwhile, or not connected
            continue
    return shut
