"""One trainer per server: a second trainer's connect() is refused clearly, never racing; a closed,
crashed or hung trainer hands its servers on (at once, at once, after the lease); takeover is explicit."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from asyncsync import WeightSync, WeightSyncConfig
from asyncsync.models import build_model
from asyncsync.protocol.ownership import OwnedByAnotherTrainer, TrainerOwnership
from asyncsync.protocol.wire import ClaimRequest, WireError
from asyncsync.receivers.reference.app import ReferenceServer
from asyncsync.transport.fleet import TrainerConflict

from conftest import TINY
from helpers import ThreadedServer, digest

REPO = Path(__file__).resolve().parents[2]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_ownership_rules():
    clock, alive = Clock(), {("h", 1): True}
    owners = TrainerOwnership(lease_s=10, clock=clock, reachable=lambda host, port: alive[(host, port)])
    owners.check("")  # unclaimed: callers without a session are served as before claims existed
    owners.claim("A")
    owners.joined("A", "h", 1)
    with pytest.raises(OwnedByAnotherTrainer, match=r"belongs to trainer session 'A'.*session 'B' is refused.*takeover: true"):
        owners.claim("B")
    for caller in ("B", ""):
        with pytest.raises(OwnedByAnotherTrainer, match="belongs to trainer session 'A'"):
            owners.check(caller)
    owners.check("A")

    clock.now += 9  # a call from the owner renews its lease
    owners.seen("A")
    clock.now += 9
    with pytest.raises(OwnedByAnotherTrainer, match="wait 1s for its lease"):
        owners.claim("B")
    clock.now += 2  # past the lease: a hung owner loses the server
    owners.claim("B")
    assert owners.owner == "B"
    with pytest.raises(OwnedByAnotherTrainer):
        owners.check("A")  # the old owner hears it on its next call

    owners.joined("B", "h", 1)
    alive[("h", 1)] = False  # B's store refuses connections: its process is gone
    owners.claim("C")
    assert owners.owner == "C"
    owners.claim("D", takeover=True)  # explicit takeover from a live owner
    assert owners.owner == "D"
    assert owners.release("C") is False and owners.owner == "D"
    assert owners.release("D") is True and owners.owner is None


def test_claim_request_is_validated():
    assert ClaimRequest.from_json({"session": "h:1:ab"}) == ClaimRequest("h:1:ab", False)
    assert ClaimRequest.from_json(ClaimRequest("h:1:ab", True).to_json()).takeover is True
    for bad, message in [({}, "missing field 'session'"), ({"session": ""}, "printable string"),
                         ({"session": "x\n"}, "printable string"), ({"session": 3}, "expected str"),
                         ({"session": "x", "takeover": "yes"}, "expected bool")]:
        with pytest.raises(WireError, match=message):
            ClaimRequest.from_json(bad)


def blocking(server: ThreadedServer, **extra: object) -> WeightSyncConfig:
    return WeightSyncConfig.from_dict({"servers": [server.url], "bucket_bytes": "64KiB",
                                       "deadlines": {"rendezvous_s": 20, "collective_s": 20, "http_s": 20}, **extra})


def perturbed(seed: int) -> torch.nn.Module:
    """The server's model with other weights: every trainer below sends a different version."""
    return build_model(dataclasses.replace(TINY, seed=seed))


@pytest.fixture
def server():
    with ThreadedServer(ReferenceServer(build_model(TINY), trainer_lease_s=1.5)) as s:
        yield s


def test_second_trainer_is_refused_then_admitted_after_close(server):
    first, second = perturbed(1), perturbed(2)
    a = WeightSync(blocking(server))
    try:
        a.connect(first)
        assert a.publish(first, 1).server_versions == {server.url: 1}
        b = WeightSync(blocking(server))
        started = time.monotonic()
        with pytest.raises(TrainerConflict, match=rf"another WeightSync of this process, never closed.*{a.session}.*takeover: true"):
            b.connect(second)
        assert time.monotonic() - started < 5, "the refusal must come at once, not after a rendezvous timeout"
        b.close()
        assert server.server.receiver.digest() == (1, digest(first)), "the refused trainer changed nothing"
        assert a.publish(first, 2).server_versions == {server.url: 2}, "the owner was not disturbed"
    finally:
        a.close()
    assert server.server.owners.owner is None, "close() releases the server"
    with WeightSync(blocking(server)) as b:
        b.connect(second)
        assert b.publish(second, 3).server_versions == {server.url: 3}
    assert server.server.receiver.digest() == (3, digest(second))


def test_two_ranks_connecting_at_once_one_wins_the_other_is_refused(server):
    """As two FSDP ranks that both call connect(): exactly one gets the server, quickly."""
    syncs = [WeightSync(blocking(server)) for _ in range(2)]
    outcome: dict[int, BaseException | None] = {}
    gate = threading.Barrier(2)

    def rank(i: int) -> None:
        gate.wait()
        try:
            syncs[i].connect(perturbed(i))
            outcome[i] = None
        except BaseException as e:  # noqa: BLE001 - recorded for the assertions
            outcome[i] = e

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(2)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        took = time.monotonic() - started
        winners = [i for i, e in outcome.items() if e is None]
        assert len(winners) == 1, outcome
        loser = outcome[1 - winners[0]]
        assert isinstance(loser, TrainerConflict) and syncs[winners[0]].session in str(loser)
        assert took < 15, f"connecting took {took:.1f}s: the loser waited out a rendezvous"
        assert server.server.owners.owner == syncs[winners[0]].session
        model = perturbed(winners[0])
        assert syncs[winners[0]].publish(model, 1).server_versions == {server.url: 1}
        assert server.server.receiver.digest() == (1, digest(model))
    finally:
        for s in syncs:
            s.close()


def test_a_hung_trainer_loses_its_server_after_the_lease_and_takeover_is_explicit(server):
    first, second, third = perturbed(1), perturbed(2), perturbed(3)
    a, b, c = (WeightSync(blocking(server, **extra)) for extra in ({}, {}, {"takeover": True}))
    try:
        a.connect(first)
        a.publish(first, 1)
        with pytest.raises(TrainerConflict):
            b.connect(second)
        b.close()
        time.sleep(1.7)  # a stays alive (its store answers) but silent past the 1.5 s lease
        b = WeightSync(blocking(server))
        b.connect(second)
        assert b.publish(second, 2).server_versions == {server.url: 2}
        result = a.publish(first, 3)  # the old owner is refused, clearly, and changes nothing
        assert result.server_versions == {} and "belongs to trainer session" in result.failures[server.url]
        assert server.server.receiver.digest() == (2, digest(second))
        assert a.events[0].kind == "refused" and "HTTP 423" in a.events[0].detail, a.events

        c.connect(third)  # takeover: true, while b is alive and within its lease
        assert c.publish(third, 4).server_versions == {server.url: 4}
        assert "belongs to trainer session" in b.publish(second, 5).failures[server.url]
        assert server.server.receiver.digest() == (4, digest(third))
    finally:
        for s in (a, b, c):
            s.close()


TRAINER = """
import json, sys, time
from asyncsync import WeightSync, WeightSyncConfig
from asyncsync.models import ModelConfig, build_model
sync = WeightSync(WeightSyncConfig.from_dict({"servers": [sys.argv[1]], "pack_backend": "torch"}))
sync.connect(build_model(ModelConfig(**json.loads(sys.argv[2]))))  # owns the server from here
print(sync.session, flush=True)
time.sleep(600)
"""


def test_a_killed_trainer_hands_its_servers_on_at_once():
    """kill -9 of the owner: its rendezvous store dies with it, so the next trainer is admitted
    without waiting for the lease (120 s here)."""
    with ThreadedServer(ReferenceServer(build_model(TINY))) as server:
        proc = subprocess.Popen([sys.executable, "-c", TRAINER, server.url, json.dumps(TINY.to_dict())], cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        try:
            session = proc.stdout.readline().strip()
            assert session, proc.stderr.read() if proc.poll() is not None else "the trainer printed nothing"
            assert session.split(":")[1] == str(proc.pid)
            b = WeightSync(blocking(server))
            with pytest.raises(TrainerConflict, match=rf"another trainer process already syncs these servers.*{session}"):
                b.connect(perturbed(2))
            b.close()
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(30)
            started = time.monotonic()
            with WeightSync(blocking(server)) as b:
                model = perturbed(2)
                b.connect(model)
                assert b.publish(model, 2).server_versions == {server.url: 2}
            assert time.monotonic() - started < 30
            assert server.server.receiver.digest() == (2, digest(model))
        finally:
            proc.kill()
            proc.wait(30)
