"""Group members and rendezvous peers that lie or say nothing: a reference server (in a child
process, so a crash would show as its exit) refuses what they send without aborting, keeps serving
the same tokens, and takes a valid version afterwards, bit-exact; every wait on a silent peer ends by
its own deadline, and a stalled join never holds the owner's next calls past it."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from asyncsync.config import WeightSyncConfig
from asyncsync.models import build_model
from asyncsync.protocol.frames import FrameHeader, VersionFrames
from asyncsync.protocol.group import free_port
from asyncsync.protocol.keys import new_key
from asyncsync.protocol.wire import PROTOCOL_VERSION, GroupSpec, InitGroupRequest, UpdateRequest
from asyncsync.receivers.reference import app as app_module
from asyncsync.receivers.reference.app import ReferenceServer
from asyncsync.testing import RogueTrainer, ServerProcess, http_call, mixed_dtype_model

from conftest import TINY
from helpers import ThreadedServer, Trainer, call, digest, weights

PROMPT = {"prompt": [5, 6, 7], "max_new_tokens": 6}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess(mixed_dtype_model, (TINY,)) as started:
        yield started


def served(server: ServerProcess) -> tuple[Any, Any]:
    return server.get("/weights/digest"), server.post("/generate", PROMPT)


def liar(server: ServerProcess) -> RogueTrainer:
    return RogueTrainer(server.url)


def valid_version(rogue: RogueTrainer, version: int) -> tuple[UpdateRequest, list[torch.Tensor]]:
    return rogue.version(weights(mixed_dtype_model(TINY), version), version)


def assert_unharmed_and_takes_a_valid_version(server: ServerProcess, before: tuple[Any, Any], version: int) -> None:
    assert server.process.is_alive(), f"the server died (exit code {server.process.exitcode})"
    assert served(server) == before, "the server's weights and greedy tokens changed"
    trainer = Trainer(WeightSyncConfig.from_dict({"servers": [server.url], "bucket_bytes": "16KiB"}))
    try:
        good = weights(mixed_dtype_model(TINY), version)
        assert trainer.publish(good, version) == {server.url: version}
        names = set(server.get("/weights/names")["names"])
        assert server.get("/weights/digest")["digest"] == {n: d for n, d in digest(good).items() if n in names}
    finally:
        trainer.close()


# 64 bytes, no header (whatever MAC the rogue's group would seal it with)
GARBAGE = type("Garbage", (), {"words": lambda self: [0] * 6,
                               "tensor": lambda self, mac=(): torch.arange(8, dtype=torch.int64)})()


@pytest.mark.parametrize("lie", ["a longer payload", "another plan", "another version", "no header", "another protocol"])
def test_frames_that_disagree_with_the_announcement_are_refused_before_their_payload(server, lie):
    """The issue's SIGABRT was a bucket broadcast 4,096 bytes longer than announced: its frame header
    tells the truth, so the receiver never posts a receive it would overflow. Whatever a header gets
    wrong, the receiver refuses the version before its payload and leaves the group, which fails the
    liar's broadcast at once, and then serves on unchanged."""
    before = served(server)
    version = before[0]["version"] + 1
    rogue = liar(server)
    try:
        request, flat = valid_version(rogue, version)
        true = VersionFrames.of(request).header(0, flat[0])
        longer = torch.cat([flat[0], torch.zeros(4096, dtype=torch.uint8)])
        header, payload = {
            "a longer payload": (FrameHeader(true.plan, version, 0, true.nbytes + 4096), longer),
            "another plan": (FrameHeader(true.plan ^ 1, version, 0, true.nbytes), flat[0]),
            "another version": (FrameHeader(true.plan, version + 5, 0, true.nbytes), flat[0]),
            "no header": (GARBAGE, flat[0]),  # what a sender of another framing would send
            "another protocol": (FrameHeader(true.plan, version, 0, true.nbytes, protocol=PROTOCOL_VERSION + 1),
                                 flat[0]),
        }[lie]
        status, body, failed, took = rogue.send(request, [(header, payload)])
    finally:
        rogue.close()
    reason = {"a longer payload": f"is {true.nbytes + 4096} bytes on the wire but was announced as {true.nbytes}",
              "another plan": "belongs to another plan", "another version": f"arrived as frame 0 of version {version + 5}",
              "no header": "has no asyncsync frame header",
              "another protocol": f"is of data-plane protocol {PROTOCOL_VERSION + 1}"}[lie]
    assert status == 409 and reason in body["error"] and "before its payload" in body["error"], body
    assert failed is not None and took < 5.0, "the liar's broadcast failed at once, not at a deadline"
    assert_unharmed_and_takes_a_valid_version(server, before, version + 1)


def test_a_trainer_of_another_protocol_is_refused_at_init_group_before_any_rendezvous(server):
    """An asyncsync that sends bare payloads says no ``protocol``: refused by name at once, without
    even a rendezvous (nothing listens at the group's port, and the timeout is long)."""
    spec = GroupSpec("127.0.0.1", free_port(), 2, "old", "gloo", 60.0, key=new_key())
    old = {k: v for k, v in InitGroupRequest(spec, 1).to_json().items() if k != "protocol"}
    start = time.monotonic()
    status, body = call(server.url, "POST", "/init_group", old)
    assert status == 400 and "protocol 1" in body["error"] and f"this server speaks {PROTOCOL_VERSION}" in body["error"], body
    assert time.monotonic() - start < 5.0
    assert call(server.url, "GET", "/world_size")[1] == {"world_size": 1, "protocol": PROTOCOL_VERSION}
    unkeyed = {**old, "protocol": 2, "group": {k: v for k, v in spec.to_json().items() if k != "key"}}
    status, body = call(server.url, "POST", "/init_group", unkeyed)  # the release before keys
    assert status == 400 and "speaks asyncsync data-plane protocol 2" in body["error"], body


@pytest.fixture
def silent_peer() -> Iterator[tuple[int, list[socket.socket]]]:
    """A port that accepts connections and never answers on them (the accepted sockets are kept)."""
    yield from peer(answers_first_ping=False)


@pytest.fixture
def store_that_falls_silent() -> Iterator[tuple[int, list[socket.socket]]]:
    """A port that answers the first connection's ping as a rendezvous store does (the probe passes),
    then never answers again: what only a peer that means to stall does."""
    yield from peer(answers_first_ping=True)


def peer(answers_first_ping: bool) -> Iterator[tuple[int, list[socket.socket]]]:
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn = listener.accept()[0]
            except TimeoutError:
                continue
            if answers_first_ping and not accepted:
                conn.settimeout(5)
                hello = b""
                while len(hello) < 10:
                    hello += conn.recv(10 - len(hello))
                conn.sendall(hello[6:10])  # the ping's nonce back
            accepted.append(conn)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1], accepted
    finally:
        stop.set()
        thread.join(5)
        for s in [*accepted, listener]:
            s.close()


def init_group_body(port: int, timeout_s: float) -> dict[str, Any]:
    return InitGroupRequest(GroupSpec("127.0.0.1", port, 2, f"silent{free_port()}", "gloo", timeout_s, key=new_key()),
                            1).to_json()


def closed_by_server(conn: socket.socket) -> bool:
    """Whether the server's side of ``conn`` is closed (what it had sent is read and dropped first)."""
    conn.settimeout(5)
    try:
        while conn.recv(1024):
            pass
    except TimeoutError:
        return False
    except OSError:
        pass
    return True


def test_a_silent_rendezvous_peer_ends_by_its_deadline_and_never_holds_end_past_it(silent_peer):
    """The issue's stall: ``/init_group`` naming a master that accepts and never answers, ``timeout_s``
    2. It is answered (503) by the deadline, the owner's ``/end`` queued behind it right after, and
    the server shut its connection to the peer: no rendezvous thread is left waiting on it."""
    port, accepted = silent_peer
    with ThreadedServer(ReferenceServer(build_model(TINY))) as server, ThreadPoolExecutor(2) as pool:
        start = time.monotonic()
        joining = pool.submit(call, server.url, "POST", "/init_group", init_group_body(port, 2.0))
        time.sleep(0.3)
        ending = pool.submit(call, server.url, "POST", "/end", {"version": 1})
        status, body = joining.result(30)
        joined_after = time.monotonic() - start
        end_status, end_body = ending.result(30)
        ended_after = time.monotonic() - start
        assert status == 503 and "no rendezvous store answered at" in body["error"] and "within 2s" in body["error"], body
        assert 2.0 <= joined_after < 5.0, joined_after
        assert end_status == 409 and "not staged" in end_body["error"] and ended_after < joined_after + 1.0
        assert accepted and closed_by_server(accepted[0]), "the server left its connection to the silent store open"
        time.sleep(0.5)
        assert not [t for t in threading.enumerate() if t.name == "asyncsync-rendezvous"], "a rendezvous thread is left"
        assert call(server.url, "GET", "/health")[0] == 200


@pytest.mark.parametrize("then", ["init_group", "init_weights_update_group", "release"])
def test_a_new_join_or_a_release_abandons_a_stalled_join_at_once(silent_peer, then):
    """A join hanging on a silent peer (``timeout_s`` 60) ends at once when the owner asks for another
    group, through asyncsync's route or SGLang's, or releases the server."""
    port, accepted = silent_peer
    owner = "trainer-host:1:ab12"
    sglang_join = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                   "group_name": "sg", "backend": "gloo"}
    with ThreadedServer(ReferenceServer(build_model(TINY))) as server, ThreadPoolExecutor(2) as pool:
        def post(path: str, body: Any) -> tuple[int, Any]:
            return http_call(server.url, "POST", path, body, session=owner)

        assert post("/claim", {"session": owner})[0] == 200
        start = time.monotonic()
        stalled = pool.submit(post, "/init_group", init_group_body(port, 60.0))
        time.sleep(1.0)
        second = pool.submit(post, *{"init_group": ("/init_group", init_group_body(port, 2.0)),
                                     "init_weights_update_group": ("/init_weights_update_group", sglang_join),
                                     "release": ("/release", None)}[then])
        status, body = stalled.result(30)
        assert status == 503 and "was abandoned" in body["error"], body
        assert time.monotonic() - start < 3.0, "the stalled join ended when it was abandoned, not at its 60 s deadline"
        assert closed_by_server(accepted[0])
        if then == "init_weights_update_group":  # its own join hangs too (SGLang's carry no deadline: 120 s)
            time.sleep(0.5)
            post("/init_group", init_group_body(port, 0.5))
        status, body = second.result(30)
        assert status == {"init_group": 503, "init_weights_update_group": 400, "release": 200}[then], body


@pytest.mark.parametrize("route", ["/end", "/end_adapter"])
def test_a_call_queued_behind_a_stalled_one_is_answered_503_by_its_queue_bound(silent_peer, monkeypatch, route):
    """A join stalled with a long deadline (60 s) holds the one data-plane thread; ``/end`` (or the
    adapter's ``/end_adapter``, which once waited for the thread without a bound) behind it waits at
    most ``WEIGHT_QUEUE_S`` to start, then is answered 503 naming the stalled call, and never runs later."""
    monkeypatch.setattr(app_module, "WEIGHT_QUEUE_S", 1.0)
    port, _ = silent_peer
    with ThreadedServer(ReferenceServer(build_model(TINY))) as server, ThreadPoolExecutor(2) as pool:
        stalled = pool.submit(call, server.url, "POST", "/init_group", init_group_body(port, 60.0))
        time.sleep(0.5)
        start = time.monotonic()
        status, body = call(server.url, "POST", route, {"version": 1})
        assert status == 503 and "busy with join" in body["error"], body
        assert 1.0 <= time.monotonic() - start < 3.0
        assert call(server.url, "POST", "/init_group", init_group_body(port, 0.5))[0] == 503  # abandons the stalled one
        assert stalled.result(30)[0] == 503


def test_a_store_that_answers_the_probe_then_falls_silent_still_ends_by_the_deadline(store_that_falls_silent):
    """Past the probe, torch's own client meets the silence: the join still ends by its deadline, and
    the rendezvous thread, whose connections keep being shut while torch retries them, ends by the
    group's timeout."""
    port, accepted = store_that_falls_silent
    with ThreadedServer(ReferenceServer(build_model(TINY))) as server:
        start = time.monotonic()
        status, body = call(server.url, "POST", "/init_group", init_group_body(port, 2.0))
        assert status == 503 and "got no answer within 2s" in body["error"], body
        assert time.monotonic() - start < 5.0
        deadline = time.monotonic() + 10
        while [t for t in threading.enumerate() if t.name.startswith("asyncsync-rendezvous")] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [t for t in threading.enumerate() if t.name.startswith("asyncsync-rendezvous")]
        assert len(accepted) >= 2 and all(closed_by_server(c) for c in accepted[1:])
