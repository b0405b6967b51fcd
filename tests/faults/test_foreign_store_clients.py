"""A foreign client of the trainer's rendezvous store: a plain torch ``TCPStore`` client, which the
store answers like any member. It can list every key and overwrite or delete any. The trainer runs
one store for its session (``transport.topology.RendezvousStore``), bound to ``master_addr``, where
every group and relay edge of every epoch meets in a namespace named by a secret that only the
token-checked ``/init_group`` carries. Every value a member reads there is sealed with the group's
key (``protocol.keys.SealedStore``), so the client cannot make any member connect to it. It can at
most delay a version, or deny versions while it keeps overwriting. Three reference servers in child
processes, a chain (``fanout: 1``): the trainer's group and two stream edges."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from asyncsync.config import WeightSyncConfig
from asyncsync.protocol.group import free_port
from asyncsync.protocol.wire import OWNED_STATUS
from asyncsync.testing import ServerProcess, http_call, mixed_dtype_model

from conftest import TINY
from helpers import Trainer, digest, listening_addresses, weights

pytestmark = pytest.mark.slow  # three reference servers and a relay chain per module: ~20 s on 2 cores

DEADLINES = {"rendezvous_s": 6.0, "collective_s": 6.0, "http_s": 20.0}


@pytest.fixture(scope="module")
def servers() -> Iterator[list[ServerProcess]]:
    with ServerProcess(mixed_dtype_model, (TINY,)) as a, ServerProcess(mixed_dtype_model, (TINY,)) as b, \
            ServerProcess(mixed_dtype_model, (TINY,)) as c:
        yield [a, b, c]


@pytest.fixture
def trainer(servers: list[ServerProcess]) -> Iterator[Trainer]:
    cfg = {"servers": [s.url for s in servers], "fanout": 1, "bucket_bytes": "16KiB", "master_port": free_port(),
           "readmit_interval_s": 0.5, "deadlines": DEADLINES}
    made = Trainer(WeightSyncConfig.from_dict(cfg))
    try:
        yield made
    finally:
        made.close()


class Intruder:
    """A thread that lists the store's keys every few milliseconds and writes what it likes where it
    likes; ``listener`` is the address it would have members connect to, counting who does."""

    def __init__(self, port: int, overwrite: bool):
        self.client = TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=10), wait_for_workers=False)
        self.overwrite, self.seen, self.stop = overwrite, set(self.client.list_keys()), threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.05)
        self.connections = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def forged(self, key: str) -> bytes:
        """Its own address where a relay edge's lower end publishes one, garbage everywhere else."""
        here = f"127.0.0.1:{self.listener.getsockname()[1]}".encode()
        return here if key.endswith("lower") else b"\x00" * 96

    def _run(self) -> None:
        while not self.stop.is_set():
            for key in self.client.list_keys():
                if key not in self.seen:
                    self.seen.add(key)
                    if self.overwrite:
                        self.client.set(key, self.forged(key))
                    elif key.endswith("/0/0"):  # a new gloo group: its other ranks' keys, before they write them
                        for rank in range(1, 8):
                            self.seen.add(f"{key[:-1]}{rank}")
                            self.client.set(f"{key[:-1]}{rank}", self.forged(key))
            try:
                self.listener.accept()[0].close()
                self.connections += 1
            except TimeoutError:
                pass

    def __enter__(self) -> Intruder:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)
        self.listener.close()


def serves(servers: list[ServerProcess], named: dict, version: int) -> None:
    for server in servers:
        names = set(server.get("/weights/names")["names"])
        answer = server.get("/weights/digest")
        assert answer["version"] == version and answer["digest"] == {
            n: d for n, d in digest(named).items() if n in names}, f"{server.url} serves other bytes"


def test_a_foreign_client_lists_no_useful_name_and_nothing_it_writes_reaches_a_member(servers, trainer):
    urls = [s.url for s in servers]
    store_port = trainer.fleet.config.master_port
    assert listening_addresses(store_port) == {"0100007F"}, "the store listens on master_addr (127.0.0.1) only"
    named = weights(mixed_dtype_model(TINY), 1)
    assert trainer.publish(named, 1) == {u: 1 for u in urls}
    intruder = Intruder(store_port, overwrite=False)
    keys = intruder.client.list_keys()
    session = trainer.fleet.session  # what a 423 answer prints
    assert keys and not [k for k in keys if session.rsplit(":", 1)[-1] in k], "a group name derived from the session"
    for key in keys:  # every key overwritten or deleted: the formed groups never read the store again
        intruder.client.set(key, b"garbage") if hash(key) % 2 else intruder.client.delete_key(key)
    named = weights(mixed_dtype_model(TINY), 2)
    assert trainer.publish(named, 2) == {u: 2 for u in urls}
    serves(servers, named, 2)

    with intruder:  # racing every rendezvous of a new epoch: forged ranks' keys before the ranks write theirs
        start = time.monotonic()
        trainer.fleet.epochs.rebuild()
        formed_s = time.monotonic() - start
        named = weights(mixed_dtype_model(TINY), 3)
        assert trainer.publish(named, 3) == {u: 3 for u in urls}
    serves(servers, named, 3)
    assert intruder.connections == 0, "a member connected to the address a foreign client wrote"
    print(f"an epoch formed in {formed_s:.2f} s with forged keys written ahead of the members'")


def test_a_foreign_client_that_keeps_overwriting_denies_versions_but_injects_nothing(servers, trainer):
    urls = [s.url for s in servers]
    named = weights(mixed_dtype_model(TINY), 11)
    assert trainer.publish(named, 11) == {u: 11 for u in urls}
    with Intruder(trainer.fleet.config.master_port, overwrite=True) as intruder:
        start = time.monotonic()
        trainer.fleet.epochs.rebuild()  # every key overwritten as soon as it appears: no group can form
        denied_s = time.monotonic() - start
        evicted = trainer.fleet.book.evicted()
        for server in servers:  # denied, never served another's bytes
            assert server.process.is_alive() and server.get("/weights/digest")["version"] == 11
    assert intruder.connections == 0, "a member connected to the address a foreign client wrote"
    time.sleep(0.6)  # readmit_interval_s
    named = weights(mixed_dtype_model(TINY), 12)
    result = trainer.publish(named, 12)
    if result != {u: 12 for u in urls}:  # the version the intruder was in the way of: the next one reaches all
        named = weights(mixed_dtype_model(TINY), 13)
        assert trainer.publish(named, 13) == {u: 13 for u in urls}
    serves(servers, named, max(v for v in trainer.fleet.book.versions(urls).values()))
    print(f"denied for {denied_s:.2f} s ({len(evicted)} server(s) evicted meanwhile); served again right after")


def test_a_parked_relayed_server_is_still_owned_while_its_trainer_lives(servers, trainer):
    """The ownership probe asks whether the owner's store still listens: with one store per session
    it does across every epoch, a repair's included (a store per edge closed with its epoch, and a
    parked server looked free to any other trainer)."""
    urls = [s.url for s in servers]
    assert trainer.publish(weights(mixed_dtype_model(TINY), 21), 21) == {u: 21 for u in urls}
    engines = {e.url: e for e in trainer.fleet.engines}
    trainer.fleet.epochs.park([engines[urls[2]]])  # a repair's epoch over the last server only
    status, body = http_call(urls[1], "POST", "/claim", {"session": "another-host:1:ffff"})
    assert status == OWNED_STATUS and trainer.fleet.session in str(body), body
