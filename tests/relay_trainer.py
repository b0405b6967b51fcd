"""The trainer side of tests/test_relay.py, run as its own process (inside the trainer's network
namespace on an emulated cluster): relayed versions, blocking then async, one interior server killed
mid-version, its return as a leaf. Writes what it saw as JSON for the test to judge.

    python tests/relay_trainer.py '{"urls": [...], "master_addr": ..., "victim_pid": ..., "dir": ...}'
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
from asyncsync.launch.http import http_call, wait_healthy
from asyncsync.models import ModelConfig, build_model

from helpers import digest  # this script's folder (tests/) is first on its path


def served(urls: list[str], model: torch.nn.Module) -> dict[str, Any]:
    """Each server's version, and whether every tensor it serves has the bytes of ``model``'s (the
    names both hold: a server keeps a tied weight once)."""
    want, out = digest(model), {}
    for url in urls:
        answer = http_call(url, "GET", "/weights/digest", timeout_s=60)[1]
        common = want.keys() & answer["digest"].keys()
        out[url] = {"version": answer["version"], "same": bool(common) and all(answer["digest"][n] == want[n] for n in common)}
    return out


def step(model: torch.nn.Module, version: int) -> None:
    g = torch.Generator().manual_seed(version)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 1e-3)


def tree_of(sync: WeightSync) -> list[str]:
    return [u for f in sync.connection.role.fleets for t in f.epochs.current.trees for u in t.order]


def slow_hop(args: dict[str, Any]) -> None:
    """urls[1]'s link is a tenth of the others': while it relays it holds the chain below it; once it
    is a leaf, the servers it held serve each version without waiting for it."""
    urls, out = args["urls"], Path(args["dir"])
    for url in urls:
        wait_healthy(url, 300, f"the server at {url}")
    model = build_model(ModelConfig.from_dict(args["model"]))
    cfg = {"servers": urls, "transport": "collective", "fanout": 1, "master_addr": args["master_addr"],
           "bucket_bytes": "2MiB", "deadlines": {"broadcast_floor_s": 30.0}}
    seen: dict[str, Any] = {}
    with WeightSync(WeightSyncConfig.from_dict(cfg)) as sync:
        sync.connect(model)
        seen["tree"] = tree_of(sync)
        for v in (1, 2, 3):
            step(model, v)
            fast = [u for u in urls if u != urls[1]]
            reached: dict[str, float] = {}
            t0 = time.perf_counter()
            watch = threading.Thread(target=watch_versions, args=(fast, v, t0, reached))
            watch.start()
            result = sync.publish(model, v)
            seen[f"v{v}"] = {"s": time.perf_counter() - t0, "servers": result.server_versions, "failures": result.failures,
                             "fast_s": max(reached.values()) if len(reached) == len(fast) else None}
            watch.join()
            seen[f"v{v}"]["fast_s"] = max(reached.values()) if len(reached) == len(fast) else None
            seen[f"v{v}"]["served"] = served(urls, model)
        seen["tree_after"] = tree_of(sync)
        seen["events"] = [(e.kind, e.server, e.version) for e in sync.metrics.events]
    (out / "seen.json").write_text(json.dumps(seen))


def watch_versions(urls: list[str], version: int, t0: float, reached: dict[str, float]) -> None:
    """When each of ``urls`` first serves ``version`` (seconds after ``t0``), polled for a minute at most."""
    while len(reached) < len(urls) and time.perf_counter() - t0 < 60:
        for url in urls:
            if url not in reached and http_call(url, "GET", "/version", timeout_s=10)[1]["version"] >= version:
                reached[url] = time.perf_counter() - t0
        time.sleep(0.02)


def main(args: dict[str, Any]) -> None:
    if args.get("scenario") == "slow":
        return slow_hop(args)
    urls, out = args["urls"], Path(args["dir"])
    for url in urls:
        wait_healthy(url, 300, f"the server at {url}")
    model = build_model(ModelConfig.from_dict(args["model"]))
    base = {"servers": urls, "transport": "collective", "fanout": 1, "master_addr": args["master_addr"],
            "bucket_bytes": "2MiB", "readmit_interval_s": 0.5}
    seen: dict[str, Any] = {"versions": {}}
    with WeightSync(WeightSyncConfig.from_dict(base)) as sync:
        sync.connect(model)
        seen["tree"] = tree_of(sync)
        for v in (1, 2):  # blocking, every server healthy; version 2 changes one tensor: deltas down the chain
            if v == 1:
                step(model, v)
            else:
                with torch.no_grad():
                    next(model.parameters()).add_(1e-3)
            t0 = time.perf_counter()
            result = sync.publish(model, v)
            seen["versions"][v] = {"s": time.perf_counter() - t0, "servers": result.server_versions,
                                   "failures": result.failures, "served": served(urls, model),
                                   "delta_buckets": result.delta_buckets}
        # Version 3: the second server of the chain (an interior one) is killed while it relays.
        step(model, 3)
        seen["kill_s"] = args["kill_after"] * seen["versions"][1]["s"]  # version 1 went whole, as 3 does
        killer = threading.Timer(seen["kill_s"], os.kill, (args["victim_pid"], signal.SIGKILL))
        t0 = time.perf_counter()
        killer.start()
        result = sync.publish(model, 3)
        killer.join()
        survivors = [u for u in urls if u != args["victim"]]
        seen["versions"][3] = {"s": time.perf_counter() - t0, "servers": result.server_versions, "failures": result.failures,
                               "repaired": result.repaired, "served": served(survivors, model)}
        (out / "killed").write_text("")
        while not (out / "restarted").exists():  # the test restarts it, in its own namespace
            time.sleep(0.1)
        wait_healthy(args["victim"], 300, "the restarted server")
        time.sleep(1.0)  # past readmit_interval_s: the next version probes it
        for v in (4, 5):
            step(model, v)
            result = sync.publish(model, v)
            seen["versions"][v] = {"servers": result.server_versions, "failures": result.failures,
                                   "served": served(urls, model)}
        seen["tree_after"] = tree_of(sync)
    # Async: versions published while the last is still on its way; close() drains the last one.
    with WeightSync(WeightSyncConfig.from_dict({**base, "async_weight_update": True})) as sync:
        sync.connect(model)
        for v in range(6, 10):
            sync.wait_snapshot()
            step(model, v)
            sync.publish(model, v)
        tree = tree_of(sync)
        sync.close()
        seen["async"] = {"sent": [r.version for r in sync.metrics.history], "errors": [str(e) for e in sync.errors],
                         "failed": sync.metrics.as_dict()["failed"], "served": served(urls, model),
                         "tree": tree}
    (out / "seen.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
