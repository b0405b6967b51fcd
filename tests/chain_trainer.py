"""The trainer side of tests/test_relay_chain.py, run as its own process inside the trainer's network
namespace: blocking whole versions (``delta: off``) down a chain of servers, one scenario per run (its
versions numbered on from the newest the servers hold; rows by their place in the run), each
version timed and every server's bytes compared with the trainer's. Writes what it saw as JSON
for the test to judge; a step that needs the test (a partition, a kill) is asked for with a file
(``want-<step>``) and waited for (``did-<step>``).

    python tests/chain_trainer.py '{"scenario": "steady", "urls": [...], "master_addr": ..., "dir": ...}'

Scenarios: ``steady`` (versions, nothing else), ``partition`` (two adjacent servers stop reaching
each other after the second version), ``split`` (they never could: at connect), ``dead`` (the
chain's middle server is killed during the third version).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from asyncsync import WeightSync, WeightSyncConfig
from asyncsync.launch.http import wait_healthy
from asyncsync.models import ModelConfig, build_model

from relay_trainer import served, step, tree_of  # this script's folder (tests/) is first on its path

STEP_WAIT_S = 120  # the test answers a step within this (bounded: a test that died leaves no waiter behind)


def ask(out: Path, step_name: str) -> None:
    """Ask the test for ``step_name`` and wait until it is done."""
    (out / f"want-{step_name}").write_text("")
    give_up = time.monotonic() + STEP_WAIT_S
    while not (out / f"did-{step_name}").exists():
        if time.monotonic() > give_up:
            raise TimeoutError(f"the test did not do {step_name} within {STEP_WAIT_S} s")
        time.sleep(0.05)


def version(sync: WeightSync, model: torch.nn.Module, v: int, urls: list[str]) -> dict[str, Any]:
    """Publish version ``v`` (blocking) and say what happened: its time, who took it, who was repaired."""
    step(model, v)
    t0 = time.perf_counter()
    result = sync.publish(model, v)
    row = {"version": v, "s": time.perf_counter() - t0, "servers": result.server_versions, "failures": result.failures,
           "repaired": result.repaired, "tree": tree_of(sync), "served": served(urls, model)}
    print(f"version {v}: {row['s']:.2f} s, repaired {len(row['repaired'])}", file=sys.stderr, flush=True)
    return row


def main(args: dict[str, Any]) -> None:
    scenario, urls, out = args["scenario"], args["urls"], Path(args["dir"])
    for url in urls:
        wait_healthy(url, 300, f"the server at {url}")
    model = build_model(ModelConfig.from_dict(args["model"]))
    cfg = {"servers": urls, "transport": "collective", "fanout": 1, "delta": "off", "master_addr": args["master_addr"],
           "bucket_bytes": args["bucket_bytes"], "readmit_interval_s": args.get("readmit_interval_s", 5.0),
           "deadlines": args.get("deadlines", {})}
    seen: dict[str, Any] = {"versions": {}}
    if scenario == "split":
        ask(out, "partition")  # before connect: the chain's first formation meets it
    with WeightSync(WeightSyncConfig.from_dict(cfg)) as sync:
        t0 = time.perf_counter()
        sync.connect(model)
        seen["connect_s"] = time.perf_counter() - t0
        seen["tree"] = tree_of(sync)
        fleet = sync.connection.role.fleets[0]
        base = max(sync.server_versions.values(), default=0)  # the servers outlive a run: versions go on from theirs
        for v in range(1, args["versions"] + 1):
            if scenario == "partition" and v == 3:
                ask(out, "partition")
            killer = None
            if scenario == "dead" and v == 3:  # killed a moment into this version, while it relays
                killer = threading.Timer(args["kill_after"] * seen["versions"][2]["s"], os.kill,
                                         (args["victim_pid"], signal.SIGKILL))
                killer.start()
            alive = [u for u in urls if not (scenario == "dead" and v >= 3 and u == args["victim"])]
            seen["versions"][v] = version(sync, model, base + v, alive)
            if killer is not None:
                killer.join()
            seen["first_deadline_s"] = fleet.pace.deadline_s(int(args["bucket_bytes_n"]))
        seen["events"] = [(e.kind, e.server, e.version, e.detail) for e in sync.metrics.events]
    (out / "seen.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
