"""A bounded soak: many async steps against 2 reference servers, checking for leaks and regressions.

Checks, after the run: every server's applied versions only increase and end at the last published
one; the trainer's RSS grew by less than 5% between the end of warm-up and the end; no thread and no
socket outlives ``close()``. Writes benchmarks/results/soak.json.

    python -m benchmarks.soak [--steps 1000]
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time

import torch

from asyncsync import WeightSync, WeightSyncConfig
from asyncsync.models import ModelConfig, build_model
from asyncsync.launch.reference import ServerProcess
from benchmarks.common import write_json

MODEL = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def open_sockets() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except FileNotFoundError:  # the fd listing itself, closed meanwhile
            pass
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--step-ms", type=float, default=10.0, help="simulated accelerator time per step")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    servers = [ServerProcess(build_model, (MODEL,)) for _ in range(2)]
    try:
        for s in servers:
            s.start()
        model = build_model(MODEL)
        threads_before, sockets_before = threading.active_count(), open_sockets()
        cfg = WeightSyncConfig.from_dict({"async_weight_update": True, "servers": [s.url for s in servers]})
        sync = WeightSync(cfg)
        sync.connect(model)
        t0 = time.perf_counter()
        rss_warm = 0
        for step in range(1, args.steps + 1):
            time.sleep(args.step_ms / 1e3)
            sync.wait_snapshot()
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1e-3)
            sync.publish(model, step)
            if step == args.warmup:
                rss_warm = rss_bytes()
        sync.close()
        wall = time.perf_counter() - t0
        rss_end = rss_bytes()
        threads_after, sockets_after = threading.active_count(), open_sockets()
        applied = [s.get("/version")["applied"] for s in servers]
        finals = [s.get("/version")["version"] for s in servers]
    finally:
        for s in servers:
            s.stop()
    m = sync.metrics.as_dict()
    monotonic = all(a == sorted(a) and len(set(a)) == len(a) for a in applied)
    growth = (rss_end - rss_warm) / rss_warm
    checks = {
        "versions_monotonic": monotonic,
        "servers_at_last_version": finals == [args.steps] * len(servers),
        "rss_growth_below_5pct": growth < 0.05,
        "no_leaked_threads": threads_after <= threads_before,
        "no_leaked_sockets": sockets_after <= sockets_before,
        "no_failed_syncs": m["failed"] == 0,
    }
    result = {
        "steps": args.steps, "wall_s": wall, "steps_per_s": args.steps / wall, "sent": m["sent"],
        "superseded": m["superseded"], "failed": m["failed"], "rss_after_warmup_mb": rss_warm / 1e6,
        "rss_end_mb": rss_end / 1e6, "rss_growth": growth, "threads": [threads_before, threads_after],
        "sockets": [sockets_before, sockets_after], "server_versions": finals, "checks": checks,
    }
    path = write_json("soak", result)
    print(f"{args.steps} async steps in {wall:.1f}s ({m['sent']} sent, {m['superseded']} superseded, {m['failed']} failed); "
          f"RSS {rss_warm / 1e6:.0f} -> {rss_end / 1e6:.0f} MB ({growth * 100:+.1f}%); threads {threads_before}->{threads_after}; "
          f"sockets {sockets_before}->{sockets_after}; servers at {finals}")
    for name, ok in checks.items():
        print(f"  {'ok  ' if ok else 'FAIL'} {name}")
    print(f"wrote {path}")
    if not all(checks.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
