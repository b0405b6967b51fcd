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

A keyed group (``GroupSpec.key``, protocol 3: ``protocol.keys``) rendezvouses through a
``SealedStore`` (no member reads an address no key holder wrote), and its warm-up is a proof of the
key: rank 0 broadcasts a fresh nonce and every rank all-gathers its MAC of it, which every rank
checks, so a peer that took a member's place at gloo's pair listener is found before any version
byte flows. The trainer runs one store for all of its groups (``store``), bound to ``master_addr``
(``serve_store``).

The rendezvous gives up at the group's ``timeout_s`` however the other side behaves: torch's
``TCPStore`` client waits without a deadline for a peer that accepts the connection and never
answers. So a member first checks, with a deadline, that a store answers at the address
(``_store_answers``), and the rendezvous runs on a thread of its own, which the joining thread
leaves at the deadline (or when another thread abandons the join: ``Abandoner``), shutting down the
thread's connections to the store so that it ends too.

What differs between gloo and NCCL (which stream a collective waits on, what a wait blocks, how a
failed group is torn down, the enqueue lock) is the member's ``Runtime`` (``protocol.device``).
Closing a group never waits for it: gloo's process group drains its queue when the last reference
goes (a pending receive until its deadline), so that happens on a thread of its own (``_release``).
"""

from __future__ import annotations

import atexit
import errno
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
from torch._C._distributed_c10d import AllgatherOptions
from torch.distributed import BroadcastOptions, PrefixStore, Store, TCPStore

from asyncsync.protocol.device import ENQUEUE_LOCK, Runtime, scoped_env
from asyncsync.protocol.frames import FrameSeal
from asyncsync.protocol.keys import KEY_BYTES, Proof, SealedStore
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


def serve_store(host: str, port: int, timeout_s: float) -> TCPStore:
    """A rendezvous store listening on ``host`` only (``port`` 0: a free one; its ``port`` says which):
    torch's ``TCPStore`` binds every interface, so the socket is bound here and handed to it
    (``master_listen_fd``, which it then owns). Every failure (the port taken, no such address, out
    of file descriptors) is a ``DataPlaneError`` that names it."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        listener = socket.create_server((host, port), family=family, backlog=1024)
    except OSError as e:
        raise DataPlaneError(f"the rendezvous store cannot listen on {host}:{port}: {e.strerror or e} "
                             f"({_errno_name(e)}); pick another master_port, or raise the open-file limit") from None
    bound = listener.getsockname()[1]
    try:
        return TCPStore(host, bound, None, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False,
                        master_listen_fd=listener.detach())
    except Exception as e:  # torch raises DistNetworkError (a RuntimeError) or RuntimeError
        raise DataPlaneError(f"the rendezvous store on {host}:{bound} did not start: {e} (out of file descriptors? "
                             "raise the open-file limit)") from None


def _errno_name(e: OSError) -> str:
    return errno.errorcode.get(e.errno, str(e.errno)) if e.errno is not None else type(e).__name__


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
        for bucket in buckets:                             # (a keyed group: every rank proved its key)
            work = group.broadcast_async(buffer)           # rank 0 sends, every other rank receives in place
            group.wait(work)                               # raises DataPlaneError by the group's deadline
        group.close(broken=failed)                         # returns at once; the group goes on its own thread

    ``seal`` seals and opens the group's frame headers (``protocol.frames``)."""

    def __init__(self, spec: GroupSpec, rank: int, store: Store, pg: Any, runtime: Runtime):
        self.spec, self.rank, self._store, self._pg, self.runtime = spec, rank, store, pg, runtime
        self.timeout = timedelta(seconds=spec.timeout_s)
        self.seal = FrameSeal(bytes.fromhex(spec.key), spec.group_name.encode())
        self._works: list[Any] = []  # the operations not known to be over: a closed group outlives them

    @property
    def device(self) -> torch.device:
        return self.runtime.device

    @classmethod
    def join(cls, spec: GroupSpec, rank: int, runtime: Runtime, warmup: bool = True,
             abandoner: Abandoner | None = None, hosts_store: bool | None = None,
             store: Store | None = None) -> DataPlaneGroup:
        """Join as ``rank``; blocks until every rank joined, and raises ``DataPlaneError`` by
        ``spec.timeout_s`` (+ ``RENDEZVOUS_GRACE_S``) whatever the peer does, or as soon as
        ``abandoner`` abandons the join. Every member must agree on ``warmup`` (a keyed group's
        warm-up is the proof of its key). ``runtime`` is the member's device: its data-plane backend
        must be the group's. The rendezvous store: ``store`` where the caller runs it (the trainer's
        one store for all its groups), else this member's own when ``hosts_store`` (default: rank 0),
        else the one at ``spec``'s address (a relaying server is rank 0 of an edge the trainer's
        store serves)."""
        if spec.backend != runtime.wire_backend:
            raise DataPlaneError(f"rank {rank}: the group '{spec.group_name}' uses {spec.backend}, but this member's "
                                 f"tensors are on {runtime.device}, which takes {runtime.wire_backend}: put both sides' "
                                 "weights on the same kind of device or set the trainer's backend to match")
        master = store is None and (rank == 0 if hosts_store is None else hosts_store)

        def form(stop: threading.Event) -> tuple[Store, Any]:
            return _form(spec, rank, runtime, store if store is not None else store_for(spec, master))

        watch = abandoner.watch() if abandoner else lambda: False
        held, pg = rendezvous(spec, rank, runtime, watch, form, probe=store is None and not master)
        group = cls(spec, rank, held, pg, runtime)
        try:
            if spec.key:
                group._prove()
            elif warmup:
                group.broadcast(torch.zeros(1, dtype=torch.uint8, device=runtime.device))
        except BaseException:
            group.close(broken=True)
            raise
        log.info("rank %d joined data-plane group %s (%s, world %d)", rank, spec.group_name, spec.backend, spec.world_size)
        return group

    def _prove(self) -> None:
        """Every rank proves the group's key: rank 0's fresh nonce, then every rank's MAC of it, all-gathered
        and checked on every rank; ``DataPlaneError`` names a rank whose proof does not hold."""
        nonce = torch.frombuffer(bytearray(secrets.token_bytes(KEY_BYTES)), dtype=torch.uint8) if self.rank == 0 \
            else torch.zeros(KEY_BYTES, dtype=torch.uint8)
        nonce = self.runtime.upload(nonce)
        self.broadcast(nonce)
        said = bytes(nonce.cpu().tolist())
        proof = Proof(bytes.fromhex(self.spec.key), self.spec.group_name.encode())
        mine = torch.frombuffer(bytearray(proof.of(b"%d" % self.rank, said)), dtype=torch.uint8)
        everyone = [torch.zeros(KEY_BYTES, dtype=torch.uint8, device=self.device) for _ in range(self.spec.world_size)]
        self.wait(self._allgather(everyone, self.runtime.upload(mine)))
        for rank, got in enumerate(everyone):
            if not proof.holds(b"%d" % rank, said, bytes(got.cpu().tolist())):
                raise DataPlaneError(
                    f"rank {self.rank}: rank {rank} of group '{self.spec.group_name}' did not prove the group's key: a "
                    "peer that is no member took its place at the rendezvous (the group is left before any version "
                    "byte flows)")

    def _allgather(self, out: list[torch.Tensor], mine: torch.Tensor) -> Work:
        opts = AllgatherOptions()
        opts.timeout = self.timeout
        with ENQUEUE_LOCK:
            return self._track(Work(self._live().allgather([out], [mine], opts), self.timeout))

    def _track(self, work: Work) -> Work:
        self._works = [w for w in self._works if not w.is_completed()]
        self._works.append(work.handle)
        return work

    def _live(self) -> Any:
        if self._pg is None:
            raise DataPlaneError(f"rank {self.rank}: group '{self.spec.group_name}' is closed")
        return self._pg

    def broadcast_async(self, tensor: torch.Tensor, timeout_s: float | None = None) -> Work:
        """Start a broadcast from rank 0 into ``tensor`` on every rank; pass the result to ``wait``.
        It is ordered after the calling thread's current stream (NCCL) and enqueued under the
        process-wide lock. ``timeout_s`` is this broadcast's deadline (default: the group's); gloo
        applies it to the operation itself, so a rank 0 whose send misses it closes its connections
        and releases the other ranks. Whatever torch raises on enqueueing is a ``DataPlaneError``."""
        pg = self._live()
        timeout = timedelta(seconds=timeout_s) if timeout_s is not None else self.timeout
        opts = BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        opts.timeout = timeout
        try:
            with ENQUEUE_LOCK:
                return self._track(Work(pg.broadcast([tensor], opts), timeout))
        except Exception as e:  # an NCCL enqueue error, a closed gloo context: the group is broken
            raise DataPlaneError(f"rank {self.rank}: broadcast in group '{self.spec.group_name}' could not start: "
                                 f"{e}") from None

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
        self.wait(Work(self._live().barrier(), self.timeout))

    def close(self, broken: bool = False) -> None:
        """Release the group; returns at once. A healthy group is shut down here. A broken one
        (``broken``: after a failure) is aborted, which kills in-flight collectives instead of waiting
        for them (on NCCL ``shutdown`` would hang on a dead peer; gloo's abort does nothing), and the
        rest happens on a thread of its own (``_release``): gloo's process group, once its last
        reference goes, waits for an operation still pending (a receive, until its deadline), which
        must hold no caller (a vLLM cancel runs in an RPC that holds the engine)."""
        held, works = [self._pg, self._store], self._works
        self._pg, self._store, self._works = None, None, []
        if held[0] is None:
            return
        try:
            (self.runtime.abort if broken else self.runtime.shutdown)(held[0])
        except Exception as e:  # the group is gone either way
            log.debug("closing group %s: %s", self.spec.group_name, e)
        if broken:
            threading.Thread(target=_release, args=(held, works), name="asyncsync-group-release", daemon=True).start()


_DESTROYING = threading.Condition()  # guards ``_destroying``: release threads inside a group's destructor
_destroying = 0
_exiting = False
_LEFT_AT_EXIT: list[Any] = []


def _release(held: list[Any], works: list[Any]) -> None:
    """Once every operation of a broken group is over (each ends by its deadline), drop the last
    references to it (``held``: the process group and its store), so that its destructor has nothing
    left to wait for. Polled in Python meanwhile: a process that exits first leaves this thread where
    it is, and the group undestroyed (a destructor cut off by the exit would abort the process)."""
    global _destroying
    while any(not w.is_completed() for w in works):
        time.sleep(_POLL_S)
    with _DESTROYING:
        if _exiting:
            _LEFT_AT_EXIT.append(held)  # not destroyed on this thread: the exit goes on without it
            return
        _destroying += 1
    try:
        held.clear()
    finally:
        with _DESTROYING:
            _destroying -= 1
            _DESTROYING.notify_all()


@atexit.register
def _before_exit() -> None:
    """Let a destructor already running end before the process does (briefly); start no other."""
    global _exiting
    with _DESTROYING:
        _exiting = True
        _DESTROYING.wait_for(lambda: _destroying == 0, timeout=5.0)


def store_for(spec: GroupSpec, master: bool) -> Store:
    """The rendezvous store at ``spec``'s address: this member's own (``master``), or a client of it;
    ``DataPlaneError`` when it cannot be had."""
    timeout = timedelta(seconds=spec.timeout_s)
    if master:
        return serve_store(spec.host, spec.port, spec.timeout_s)
    try:
        return TCPStore(spec.host, spec.port, spec.world_size, False, timeout=timeout, wait_for_workers=False)
    except Exception as e:  # torch raises several types (RuntimeError, DistNetworkError)
        raise DataPlaneError(f"rendezvous at {spec.host}:{spec.port} failed: {e}") from e


def namespaced(spec: GroupSpec, store: Store) -> tuple[Store, list[Store]]:
    """``spec``'s namespace of ``store`` (SGLang's key layout: ``{name}/{name}/``), sealed with the group's
    key where it has one (``protocol.keys.SealedStore``), and what must outlive every use of it: a
    Python store's object, which the C++ side only calls back into, dies with the last Python reference."""
    held = [store]
    if spec.key:
        store = SealedStore(store, bytes.fromhex(spec.key), spec.timeout_s)
        held.append(store)
    named = PrefixStore(f"{spec.group_name}/", PrefixStore(spec.group_name, store))
    return named, [*held, named]


def _form(spec: GroupSpec, rank: int, runtime: Runtime, store: Store) -> tuple[list[Store], Any]:
    """The process group (blocking; ``rendezvous`` bounds it) and what must outlive it: the store it
    rendezvoused through (a sealed store's Python object is called back by the group's C++ side)."""
    timeout = timedelta(seconds=spec.timeout_s)
    named, held = namespaced(spec, store)
    try:
        with scoped_env(runtime.group_env):  # the group's error policy, read by its constructor
            pg = runtime.process_group(PrefixStore(_DEVICE_PREFIX[spec.backend], named), rank, spec.world_size, timeout)
        pg._set_sequence_number_for_group()  # rank 0 publishes it, the others wait for it: torch does the same
    except Exception as e:
        raise DataPlaneError(
            f"rank {rank}: could not form the {spec.backend} group '{spec.group_name}' of {spec.world_size} "
            f"within {spec.timeout_s}s ({e}); check that every server reached {spec.host}:{spec.port}"
        ) from e
    return held, pg


def rendezvous(spec: GroupSpec, rank: int, runtime: Runtime, abandoned: Callable[[], bool],
               form: Callable[[threading.Event], Any], probe: bool) -> Any:
    """``form(stop)`` on a thread of its own, waited for until ``spec.timeout_s`` + ``RENDEZVOUS_GRACE_S``
    or until ``abandoned()``; first, with ``probe``, until a store answers at ``spec``'s address
    (``_store_answers``). A rendezvous given up has ``stop`` set and its connections to the store
    shut down, so the thread, blocked in torch on a silent peer, ends too. The thread inherits the
    caller's CPU priority and cores (and so do the group's own threads)."""
    before = set(_sockets().values())
    outcome: list[Any] = []
    done, stop = threading.Event(), threading.Event()
    store_ready = time.monotonic() + spec.timeout_s

    def run() -> None:
        try:
            runtime.enter_thread()
            if probe and not _store_answers(spec, store_ready, stop) or stop.is_set():
                return  # given up: the joining thread has said why
            outcome.append(form(stop))
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
