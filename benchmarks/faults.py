"""A dead server costs seconds, not collective_s: kill -9 one of three servers in the middle of a sync,
restart it 10 steps later, in blocking, async and async + group_per_server modes.

Default configuration (collective_s 120 s, readmit_interval_s 5 s), three reference servers in child
processes on a ~270 MB bf16 model, a trainer step of ``--step-s`` of simulated compute. A watcher
samples every server's version every 20 ms. Per mode:

  kill_step_s      the trainer's longest step from the kill on (publish, wait_snapshot and the step)
  survivor_gap_s   the longest time a healthy server went without a new version, across the kill
  evicted_after_s  from the kill to the "evicted" event
  rejoin_s         from the restarted server answering to it serving a version again
  normal_sync_s    a normal sync before the kill (median total_s), the yardstick of the targets

Targets: blocking kill_step_s <= 3 s + one normal sync; async survivor_gap_s <= 3 s + one normal
sync, with one shared group too. Writes benchmarks/results/faults.json and faults.png.

    python -m benchmarks.faults [--steps-before 8] [--steps-after 10]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import threading
import time
from typing import Any

import torch

from asyncsync import WeightSync, WeightSyncConfig
from asyncsync.models import ModelConfig, build_model
from asyncsync.launch.reference import ServerProcess
from benchmarks.common import RESULTS, write_json

# ~286 MB of bf16 weights: Qwen2's layout at 1024 wide, 6 layers.
MODEL = ModelConfig(family="qwen2", vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_layers=6,
                    num_heads=16, num_kv_heads=16, dtype="bfloat16")
MODES = {
    "blocking": {"async_weight_update": False},
    "async": {"async_weight_update": True},
    "async_group_per_server": {"async_weight_update": True, "group_per_server": True},
}


class VersionWatch:
    """Every server's version every 20 ms, with timestamps (bounded: stops itself after an hour)."""

    def __init__(self, servers: list[ServerProcess]):
        self.servers = servers
        self.samples: dict[int, list[tuple[float, int]]] = {i: [] for i in range(len(servers))}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for _ in range(180_000):
            if self._stop.is_set():
                return
            for i, s in enumerate(self.servers):
                try:
                    self.samples[i].append((time.time(), s.get("/version", timeout=1.0)["version"]))
                except OSError:
                    pass  # the killed one
            self._stop.wait(0.02)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def changes(self, i: int) -> list[tuple[float, int]]:
        """When server i's version changed (time of the first sample of each new version)."""
        out, last = [], None
        for t, v in self.samples[i]:
            if v != last:
                out.append((t, v))
                last = v
        return out


def perturb(model: torch.nn.Module, step: int) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-3 * (1 + step % 3))


def run_mode(name: str, extra: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    servers = [ServerProcess(build_model, (MODEL,), start_timeout_s=300).start() for _ in range(3)]
    victim_index = 1
    restarted: ServerProcess | None = None
    watch = VersionWatch(servers)
    try:
        model = build_model(MODEL)
        cfg = WeightSyncConfig.from_dict({"servers": [s.url for s in servers], "bucket_bytes": "64MiB",
                                          "transport": "collective", **extra})  # the data plane's faults
        sync = WeightSync(cfg)
        sync.connect(model)
        steps: list[tuple[float, float]] = []  # (start, duration) per step, time.time()
        kill_at = restart_at = 0.0
        version = max(sync.server_versions.values())
        total = args.steps_before + args.steps_after + args.steps_rejoin
        for step in range(total):
            t0 = time.time()
            time.sleep(args.step_s)  # the step's compute (a simulated accelerator)
            sync.wait_snapshot()
            perturb(model, step)
            version += 1
            if step == args.steps_before:  # kill in the middle of this step's sync
                victim = servers[victim_index]
                killer = threading.Timer(args.kill_after_s, victim.process.kill)
                killer.start()
                kill_at = time.time() + args.kill_after_s
            sync.publish(model, version)
            steps.append((t0, time.time() - t0))
            if step == args.steps_before + args.steps_after:
                restarted = ServerProcess(build_model, (MODEL,), port=servers[victim_index].port, start_timeout_s=300).start()
                restart_at = time.time()
                watch.servers = [*servers[:victim_index], restarted, *servers[victim_index + 1:]]
        sync.close()
        time.sleep(0.5)
        watch.stop()
        normal = statistics.median(r.total_s for r in list(sync.metrics.history)[: args.steps_before] if r.total_s > 0)
        survivors = [i for i in range(3) if i != victim_index]
        gaps = []
        for i in survivors:
            times = [t for t, _ in watch.changes(i)]
            before = [t for t in times if t <= kill_at]
            after = [t for t in times if kill_at < t <= restart_at]
            points = before[-1:] + after
            gaps.append(max((b - a for a, b in zip(points, points[1:])), default=restart_at - kill_at))
        evicted = [e.at for e in sync.events if e.kind == "evicted" and e.server == servers[victim_index].url]
        back = [t for t, v in watch.samples[victim_index] if t > restart_at and v > 0]
        return {
            "mode": name,
            "normal_sync_s": normal,
            "kill_step_s": max(d for t, d in steps if t + d >= kill_at),
            "survivor_gap_s": max(gaps),
            "evicted_after_s": (evicted[0] - kill_at) if evicted else None,
            "rejoin_s": (back[0] - restart_at) if back else None,
            "target_s": 3.0 + normal,
            "superseded": sync.metrics.superseded, "failed": sync.metrics.failed,
            "events": [(e.kind, e.server, round(e.at - kill_at, 2)) for e in sync.events],
        }
    finally:
        watch.stop()
        for s in [*servers, *([restarted] if restarted else [])]:
            s.stop()


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ["kill_step_s", "survivor_gap_s", "evicted_after_s", "rejoin_s"]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(rows)
    for j, row in enumerate(rows):
        ax.bar([k + j * width for k in range(len(keys))], [row[k] or 0 for k in keys], width, label=row["mode"])
        ax.axhline(row["target_s"], color=f"C{j}", linestyle="--", linewidth=0.8)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(keys))], keys)
    ax.set_ylabel("seconds")
    ax.set_title("kill -9 of one of 3 servers mid-sync (default collective_s = 120 s); dashed: 3 s + one sync")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps-before", type=int, default=8)
    parser.add_argument("--steps-after", type=int, default=10, help="steps between the kill and the restart")
    parser.add_argument("--steps-rejoin", type=int, default=12, help="steps after the restart")
    parser.add_argument("--step-s", type=float, default=0.3)
    parser.add_argument("--kill-after-s", type=float, default=0.15, help="how far into the sync the kill lands")
    parser.add_argument("--modes", nargs="*", default=list(MODES))
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    rows = []
    for name in args.modes:
        row = run_mode(name, MODES[name], args)
        rows.append(row)
        print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items() if k != "events"}, flush=True)
    write_json("faults", {"model_bytes": sum(p.numel() * p.element_size() for p in build_model(MODEL).state_dict().values()),
                          "targets": "blocking kill_step_s and async survivor_gap_s <= 3 s + one normal sync",
                          **{row["mode"]: row for row in rows}})
    plot(rows, str(RESULTS / "faults.png"))


if __name__ == "__main__":
    main()
