"""Relay edges of host weights: two ranks over one authenticated TCP stream, read with bounded, checked reads.

gloo aborts the whole process (``gloo::EnforceNotMet``) when a peer sends more bytes than a receive
was posted for, and completes a receive that was sent fewer bytes without a word: a gloo edge can
never be safe against its upper end, a server above this one. A ``StreamEdge`` is a TCP connection
that the receiving end reads itself, exactly the bytes each posted buffer holds, by that buffer's
deadline. What a peer sends beyond a payload is read as the next frame header and refused (no MAC,
``protocol.frames``); a stream that ends early fails the read (a short payload); one that stalls
fails it at the deadline. Nothing an upper end sends makes this process do more than refuse the
version and leave the edge.

Rendezvous, in the trainer's store at ``spec``'s address, in the edge's namespace, sealed with the
edge's key (``protocol.keys``: a value no key holder wrote is never read)::

    lower (rank 1): listens on its address toward the store, publishes "host:port" (sealed), and
                    accepts connections until one proves the key (each gets HANDSHAKE_S)
    upper (rank 0): reads that address, connects, and proves the key
    upper -> lower  HELLO + nonce_u                           (16 + 32 bytes)
    lower -> upper  nonce_l + proof("lower", nonce_u nonce_l)  (32 + 32)
    upper -> lower  proof("upper", nonce_u nonce_l)            (32)

So a foreign peer that connects to the listener gets nothing and delays the edge by at most
HANDSHAKE_S; one that forges the address is never read. Frame headers are sealed for the edge and
this connection's nonces (a header recorded on another connection opens on no other).

After that, the interface is ``DataPlaneGroup``'s as ``FramedReceive`` and ``Forward`` use it:
``broadcast_async(buffer, timeout_s)`` queues the buffer on the edge's one I/O thread (the upper
end sends it, the lower end fills it), in order, each by its deadline counted from when it was
queued; ``wait`` raises ``DataPlaneError``. A failed operation breaks the edge: the socket is shut
(the other end's read fails at once) and every queued operation fails. ``close`` never waits.
"""

from __future__ import annotations

import logging
import queue
import secrets
import socket
import threading
import time
from typing import Any

import torch

from asyncsync.protocol.device import Runtime
from asyncsync.protocol.frames import FrameSeal
from asyncsync.protocol.group import Abandoner, DataPlaneError, DataPlaneGroup, namespaced, rendezvous, store_for
from asyncsync.protocol.keys import KEY_BYTES, MAC_BYTES, Forged, Proof
from asyncsync.protocol.wire import GroupSpec

log = logging.getLogger(__name__)

HELLO = b"asyncsync-edge/3"  # what an upper end says first: this protocol's edge, and no other
HANDSHAKE_S = 5.0  # the most one connection to a lower end's listener may take to prove the key
_POLL_S = 0.1  # how often a waiting rendezvous looks whether it was given up
_WAIT_GRACE_S = 1.0  # past an operation's deadline, a waiter gives up even if the I/O thread has not
_ADDRESS = "lower"  # the lower end's listening address, under the edge's namespace of the store


class StreamWork:
    """One queued send or receive: done (or failed, ``error``) by ``deadline`` (monotonic seconds)."""

    __slots__ = ("buffer", "deadline", "done", "error")

    def __init__(self, buffer: torch.Tensor, deadline: float):
        self.buffer, self.deadline = buffer, deadline
        self.done = threading.Event()
        self.error: str | None = None

    def fail(self, error: str) -> None:
        self.error = error
        self.done.set()


class StreamEdge:
    """One end of a relay edge over an authenticated TCP stream (the module doc): ``rank`` 0 sends,
    rank 1 receives. Made by ``join``; ``spec``, ``rank``, ``runtime``, ``device`` and ``seal`` as a
    ``DataPlaneGroup``'s."""

    def __init__(self, spec: GroupSpec, rank: int, runtime: Runtime, sock: socket.socket, binding: bytes):
        self.spec, self.rank, self.runtime = spec, rank, runtime
        self.seal = FrameSeal(bytes.fromhex(spec.key), binding)
        self._sock: socket.socket | None = sock
        self._queue: queue.SimpleQueue[StreamWork | None] = queue.SimpleQueue()
        self._broken: str | None = None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a header is sent at once, not held for more
        threading.Thread(target=self._run, name=f"asyncsync-edge-{'send' if rank == 0 else 'receive'}",
                         daemon=True).start()

    @property
    def device(self) -> torch.device:
        return self.runtime.device

    @classmethod
    def join(cls, spec: GroupSpec, rank: int, runtime: Runtime, abandoner: Abandoner | None = None) -> StreamEdge:
        """The edge ``spec`` as its ``rank`` (0: the upper end, which connects; 1: the lower, which
        listens), once both ends proved the key; ``DataPlaneError`` by ``spec.timeout_s`` whatever the
        peer does, or as soon as ``abandoner`` abandons the join."""
        if runtime.wire_backend != "gloo" or not spec.key:
            raise DataPlaneError(f"edge '{spec.group_name}': a stream carries keyed host weights, this end's are on "
                                 f"{runtime.device}{'' if spec.key else ' and the edge has no key'}")
        watch = abandoner.watch() if abandoner else lambda: False

        def form(stop: threading.Event) -> tuple[socket.socket, bytes]:
            return _rendezvous(spec, rank, stop)

        sock, binding = rendezvous(spec, rank, runtime, watch, form, probe=True)
        log.info("rank %d joined relay edge %s (stream)", rank, spec.group_name)
        return cls(spec, rank, runtime, sock, binding)

    def broadcast_async(self, tensor: torch.Tensor, timeout_s: float | None = None) -> StreamWork:
        """Queue ``tensor`` (on the host, contiguous) to be sent (rank 0) or filled (rank 1) after the
        ones queued before it, by ``timeout_s`` from now (default: the edge's)."""
        if self._broken is not None:
            raise DataPlaneError(f"rank {self.rank}: relay edge '{self.spec.group_name}' is broken: {self._broken}")
        work = StreamWork(tensor, time.monotonic() + (timeout_s if timeout_s is not None else self.spec.timeout_s))
        self._queue.put(work)
        if self._broken is not None:  # broken meanwhile, by another thread: fail what it did not see
            self._break(self._broken)
        return work

    def broadcast(self, tensor: torch.Tensor, timeout_s: float | None = None) -> None:
        self.wait(self.broadcast_async(tensor, timeout_s))

    def wait(self, work: StreamWork) -> None:
        """Until ``work`` is done, or ``DataPlaneError`` (it failed, or its deadline passed)."""
        if not work.done.wait(max(0.0, work.deadline - time.monotonic()) + _WAIT_GRACE_S):
            work.fail(f"not done by its deadline ({self.spec.timeout_s:g}s at most)")
        if work.error is not None:
            what = "send to" if self.rank == 0 else "receive from"
            raise DataPlaneError(f"rank {self.rank}: {what} relay edge '{self.spec.group_name}' failed: {work.error}")

    def close(self, broken: bool = False) -> None:
        """Leave the edge at once: the socket is shut both ways (the other end's next read fails at
        once, so no news needs sending), every queued operation fails."""
        sock, self._sock = self._sock, None
        if sock is None:
            return
        self._break("the edge was closed")
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # the peer went first
            pass
        sock.close()
        self._queue.put(None)

    def _break(self, why: str) -> None:
        """From now on every operation fails (first reason kept): the queued ones at once."""
        if self._broken is None:
            self._broken = why
        stop = False
        while True:
            try:
                work = self._queue.get_nowait()
            except queue.Empty:
                break
            if work is None:
                stop = True
            else:
                work.fail(self._broken)
        if stop:  # the I/O thread's end, taken out with the rest: put back
            self._queue.put(None)

    def _run(self) -> None:
        """The I/O thread: each queued operation in turn; the first that fails breaks the edge."""
        self.runtime.enter_thread()
        move = _send if self.rank == 0 else _fill
        while True:
            work = self._queue.get()
            sock = self._sock
            if work is None or sock is None:
                if work is not None:
                    work.fail(self._broken or "the edge was closed")
                return
            try:
                move(sock, _bytes_of(work.buffer), work.deadline)
            except (OSError, ValueError, DataPlaneError) as e:  # ValueError: a socket closed meanwhile
                why = str(e) if isinstance(e, DataPlaneError) else f"{type(e).__name__}: {e}"
                if self._sock is None and self._broken is not None:  # closed here meanwhile: that is why
                    why = self._broken
                work.fail(why)
                log.warning("relay edge %s broken: %s", self.spec.group_name, why)
                self._break(why)
                self.close(broken=True)
                return
            work.done.set()


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor, writable in place."""
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


def _fill(sock: socket.socket, view: memoryview, deadline: float) -> None:
    """Exactly ``len(view)`` bytes into ``view``, by ``deadline``: a stream that ends first is a short payload."""
    got = 0
    while got < len(view):
        left = deadline - time.monotonic()
        if left <= 0:
            raise DataPlaneError(f"{got} of {len(view)} bytes arrived by the deadline")
        sock.settimeout(left)
        try:
            n = sock.recv_into(view[got:])
        except TimeoutError:
            continue
        if n == 0:
            raise DataPlaneError(f"the upper end closed the stream after {got} of {len(view)} bytes")
        got += n


def _send(sock: socket.socket, view: memoryview, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise DataPlaneError("the deadline passed before the send started")
    sock.settimeout(left)  # sendall's whole duration (Python 3.5+)
    try:
        sock.sendall(view)
    except TimeoutError:
        raise DataPlaneError(f"the lower end took less than {len(view)} bytes by the deadline") from None


def _rendezvous(spec: GroupSpec, rank: int, stop: threading.Event) -> tuple[socket.socket, bytes]:
    """The connected, authenticated socket and its frames' binding (the module doc), by the edge's
    deadline or until ``stop``."""
    give_up = time.monotonic() + spec.timeout_s
    store, _held = namespaced(spec, store_for(spec, master=False))  # _held: alive while the store is used
    proof = Proof(bytes.fromhex(spec.key), spec.group_name.encode())
    try:
        if rank == 1:
            return _listen(spec, store, proof, give_up, stop)
        host, _, port = store.get(_ADDRESS).decode().rpartition(":")
    except DataPlaneError:
        raise
    except Forged as e:
        raise DataPlaneError(f"edge '{spec.group_name}': {e}") from None
    except Exception as e:  # torch's store errors: DistStoreError (its wait timed out), DistNetworkError
        raise DataPlaneError(f"edge '{spec.group_name}': the trainer's rendezvous store failed: {e}") from None
    return _connect(spec, (host.strip("[]"), int(port)), proof, give_up)


def _listen(spec: GroupSpec, store: Any, proof: Proof, give_up: float,
            stop: threading.Event) -> tuple[socket.socket, bytes]:
    """The lower end: listen toward the store, publish where, accept until a connection proves the key."""
    family, address = _address_toward(spec.host, spec.port)
    with socket.create_server((address, 0), family=family) as listener:
        store.set(_ADDRESS, f"[{address}]:{listener.getsockname()[1]}" if family == socket.AF_INET6 else
                  f"{address}:{listener.getsockname()[1]}")
        listener.settimeout(_POLL_S)
        while not stop.is_set() and time.monotonic() < give_up:
            try:
                conn, peer = listener.accept()
            except TimeoutError:
                continue
            try:
                return conn, _answer(conn, proof, min(give_up, time.monotonic() + HANDSHAKE_S))
            except (OSError, DataPlaneError) as e:
                log.warning("edge %s: a connection from %s did not prove the edge's key (%s); it gets nothing",
                            spec.group_name, peer, e)
                conn.close()
    raise DataPlaneError(f"edge '{spec.group_name}': no upper end proved the edge's key within {spec.timeout_s:g}s")


def _answer(conn: socket.socket, proof: Proof, deadline: float) -> bytes:
    """The lower end's side of the handshake; the frames' binding."""
    hello = _read(conn, len(HELLO) + KEY_BYTES, deadline)
    if hello[: len(HELLO)] != HELLO:
        raise DataPlaneError("it did not greet as an asyncsync edge of this protocol")
    nonces = hello[len(HELLO):] + secrets.token_bytes(KEY_BYTES)
    conn.settimeout(max(0.01, deadline - time.monotonic()))
    conn.sendall(nonces[KEY_BYTES:] + proof.of(b"lower", nonces))
    if not proof.holds(b"upper", nonces, _read(conn, MAC_BYTES, deadline)):
        raise DataPlaneError("its proof of the key did not hold")
    return proof.binding + b"/" + nonces


def _connect(spec: GroupSpec, address: tuple[str, int], proof: Proof, give_up: float) -> tuple[socket.socket, bytes]:
    """The upper end: connect to the lower end's (sealed) address and prove the key both ways."""
    try:
        conn = socket.create_connection(address, timeout=max(0.01, give_up - time.monotonic()))
    except OSError as e:
        raise DataPlaneError(f"edge '{spec.group_name}': the lower end at {address[0]}:{address[1]}: {e}") from None
    try:
        nonce = secrets.token_bytes(KEY_BYTES)
        conn.sendall(HELLO + nonce)
        reply = _read(conn, KEY_BYTES + MAC_BYTES, give_up)
        nonces = nonce + reply[:KEY_BYTES]
        if not proof.holds(b"lower", nonces, reply[KEY_BYTES:]):
            raise DataPlaneError("the lower end did not prove the edge's key: a peer that is not the server below "
                                 "answered at its address")
        conn.sendall(proof.of(b"upper", nonces))
    except (OSError, DataPlaneError) as e:
        conn.close()
        raise DataPlaneError(f"edge '{spec.group_name}': {e}") from None
    return conn, proof.binding + b"/" + nonces


def _read(conn: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray(n)
    _fill(conn, memoryview(buf), deadline)
    return bytes(buf)


def _address_toward(host: str, port: int) -> tuple[socket.AddressFamily, str]:
    """This host's address on the way to ``host`` (the interface the trainer's store is reached on),
    where a lower end listens: reachable from the servers the trainer reaches, and nowhere else it need be."""
    family, _, _, _, where = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(where)  # a datagram socket's connect sends nothing: it only picks the route
        return family, probe.getsockname()[0]


def join_member(spec: GroupSpec, rank: int, runtime: Runtime, warmup: bool = True,
                abandoner: Abandoner | None = None, hosts_store: bool | None = None) -> DataPlaneGroup | StreamEdge:
    """Join ``spec`` as ``rank``: a relay edge of host weights as a ``StreamEdge``, any other group as a
    ``DataPlaneGroup`` (arguments as its ``join``)."""
    if spec.backend == "stream":
        return StreamEdge.join(spec, rank, runtime, abandoner)
    return DataPlaneGroup.join(spec, rank, runtime, warmup, abandoner, hosts_store)
