"""Training steps with no sync, with blocking sync and with async sync, to 2 reference servers.

Two kinds of training step, each run in all three modes in one process:
  (a) simulated accelerator step: the host sleeps for a fixed time, as it would while a GPU computes.
      The step is sized to about one blocking sync, so blocking mode roughly doubles the step.
  (b) real CPU step: matrix multiplications on the trainer's CPU for about the same time. On a
      2-core machine the trainer, the sync worker and both servers then compete for the same cores.
Plus publish() latency over many calls, and a timeline of one async step.
Writes benchmarks/results/overlap.{json,png}.

With ``--link-gbit R`` everything runs in a network namespace whose loopback is an R gbit/s link
(``asyncsync.netns``; skipped, saying why, where none can be made): the sync is then bound by the
link, as on a cluster, rather than by the CPU it shares with the step. That run writes
benchmarks/results/overlap_link.{json,png}, with the same keys and ``link_gbit`` next to the ratios.

    python -m benchmarks.overlap [--steps 20] [--publish-calls 2000] [--link-gbit 8]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from typing import Any

import torch

from asyncsync import WeightSync, WeightSyncConfig
from asyncsync.models import ModelConfig, build_model
from asyncsync.launch.reference import ServerProcess
from asyncsync import netns
from benchmarks.common import save

MODEL = ModelConfig(vocab_size=16000, hidden_size=512, intermediate_size=1408, num_layers=4, num_heads=8, num_kv_heads=4)


def optimizer_step(model: torch.nn.Module, step: int) -> None:
    """A cheap in-place update of every parameter, so every version differs."""
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.0 - 1e-4 * (step % 3))


class CpuStep:
    """About ``seconds`` of matrix work on the trainer's CPU (calibrated once)."""

    def __init__(self, seconds: float):
        self.a = torch.randn(384, 384)
        t0 = time.perf_counter()
        for _ in range(20):
            self.a @ self.a
        per = (time.perf_counter() - t0) / 20
        self.reps = max(1, round(seconds / per))

    def __call__(self) -> None:
        for _ in range(self.reps):
            self.a @ self.a


def run_mode(mode: str, step_fn: Any, steps: int, servers: list[ServerProcess], bucket_bytes: str) -> dict[str, Any]:
    """Time ``steps`` training steps; mode is none | blocking | async."""
    model = build_model(MODEL)
    sync = None
    if mode != "none":
        cfg = WeightSyncConfig.from_dict({
            "async_weight_update": mode == "async", "servers": [s.url for s in servers], "bucket_bytes": bucket_bytes,
            "transport": "collective",  # the data plane's overlap (an emulated link too): not shared memory
        })
        sync = WeightSync(cfg)
        sync.connect(model)
        start_version = max(sync.server_versions.values())
    step_times, marks = [], []
    t_start = time.perf_counter()
    for step in range(steps):
        t0 = time.perf_counter()
        step_fn()
        if sync is not None:
            sync.wait_snapshot()
        optimizer_step(model, step)
        if sync is not None:
            sync.publish(model, start_version + step + 1)
        t1 = time.perf_counter()
        step_times.append(t1 - t0)
        marks.append((t0, t1))
    loop_s = time.perf_counter() - t_start
    out: dict[str, Any] = {"mode": mode, "steps": steps, "loop_s": loop_s, "steps_per_s": steps / loop_s,
                           "step_median_s": statistics.median(step_times), "step_marks": marks}
    if sync is not None:
        sync.close()
        m = sync.metrics.as_dict()
        out.update(sent=m["sent"], superseded=m["superseded"], failed=m["failed"], stall_s=m["boundary_stall_s"],
                   syncs=[{k: getattr(r, k) for k in ("version", "started", "send_started", "finished", "snapshot_s",
                                                     "pack_s", "wire_s", "apply_s", "total_s")} for r in sync.metrics.history],
                   sync_median_s=statistics.median(r.total_s for r in sync.metrics.history))
    return out


def publish_latency(servers: list[ServerProcess], calls: int, bucket_bytes: str) -> dict[str, float]:
    """Wall time of publish() alone, async mode, over ``calls`` calls (most versions supersede)."""
    model = build_model(MODEL)
    cfg = WeightSyncConfig.from_dict({"async_weight_update": True, "servers": [s.url for s in servers], "bucket_bytes": bucket_bytes,
                                      "transport": "collective"})
    with WeightSync(cfg) as sync:
        sync.connect(model)
        base = max(sync.server_versions.values())
        lat = []
        for i in range(calls):
            t0 = time.perf_counter_ns()
            sync.publish(model, base + i + 1)
            lat.append((time.perf_counter_ns() - t0) / 1e3)
            if i % 50 == 49:
                sync.wait_snapshot()  # as a trainer would, once per step
    lat.sort()
    return {"calls": calls, "p50_us": lat[len(lat) // 2], "p99_us": lat[int(len(lat) * 0.99)], "max_us": lat[-1]}


def plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    kinds = list(results["kinds"])
    modes = ["none", "blocking", "async"]
    width = 0.25
    for i, mode in enumerate(modes):
        vals = [results["kinds"][k][mode]["steps_per_s"] for k in kinds]
        bars = ax1.bar([x + (i - 1) * width for x in range(len(kinds))], vals, width, label=f"{mode} sync" if mode != "none" else "no sync")
        ax1.bar_label(bars, fmt="%.2f", fontsize=8)
    ax1.set_xticks(range(len(kinds)), ["(a) simulated accelerator\n(host waits)", "(b) real CPU step\n(2 shared cores)"])
    ax1.set_ylabel("training steps / s")
    link = f", {results['link_gbit']:g} gbit/s link" if results["link_gbit"] else ", loopback"
    ax1.set_title(f"Throughput, 2 reference servers{link}")
    ax1.legend()

    run = results["kinds"]["simulated"]["async"]
    marks = run["step_marks"]
    k = len(marks) // 2
    t_ref = marks[k][0]
    lo, hi = marks[k][0] - 0.1, marks[k + 1][1] + 0.05
    for j, (a, b) in enumerate(marks[k - 1 : k + 3]):
        ax2.barh(4, b - a, left=a - t_ref, color="tab:gray", edgecolor="white")
    colors = {"snapshot": "tab:blue", "wire": "tab:orange", "apply": "tab:green"}
    for s in run["syncs"]:
        if s["finished"] < lo or s["started"] > hi:
            continue
        ax2.barh(3, s["snapshot_s"], left=s["started"] - t_ref, color=colors["snapshot"])
        ax2.barh(2, s["wire_s"], left=s["send_started"] - t_ref, color=colors["wire"])
        ax2.barh(1, s["apply_s"], left=s["finished"] - s["apply_s"] - t_ref, color=colors["apply"])
        ax2.text(s["send_started"] - t_ref, 2.3, f"v{s['version']}", fontsize=7)
    ax2.set_yticks([4, 3, 2, 1], ["training step", "snapshot (pack)", "wire (broadcast)", "apply (servers)"])
    ax2.set_xlim(lo - t_ref, hi - t_ref)
    ax2.set_xlabel("seconds (0 = start of a step)")
    ax2.set_title("One async step: the sync runs under the next step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--publish-calls", type=int, default=2000)
    parser.add_argument("--bucket-bytes", default="32MiB")
    parser.add_argument("--link-gbit", type=float, help="run on an emulated link of this rate (asyncsync.netns)")
    parser.add_argument("--on-link", action="store_true", help=argparse.SUPPRESS)  # already inside the namespace
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    netns.rerun_on_link("benchmarks.overlap", args.link_gbit, args.on_link)
    name = "overlap_link" if args.link_gbit else "overlap"
    torch.set_num_threads(1)
    servers = [ServerProcess(build_model, (MODEL,), start_timeout_s=300) for _ in range(2)]
    try:
        for s in servers:
            s.start()
        calib = run_mode("blocking", lambda: None, 5, servers, args.bucket_bytes)
        step_s = calib["sync_median_s"]
        nbytes = sum(t.nbytes for t in build_model(MODEL).state_dict().values())
        print(f"model {nbytes / 1e6:.0f} MB; one blocking sync to 2 servers takes {step_s * 1e3:.0f} ms: "
              f"each training step is sized to that", flush=True)
        cpu_step = CpuStep(step_s)
        kinds: dict[str, dict[str, Any]] = {"simulated": {}, "cpu": {}}
        for kind, fn in (("simulated", lambda: time.sleep(step_s)), ("cpu", cpu_step)):
            for mode in ("none", "blocking", "async"):
                r = run_mode(mode, fn, args.steps, servers, args.bucket_bytes)
                kinds[kind][mode] = r
                extra = f", {r['sent']} sent / {r['superseded']} superseded" if mode != "none" else ""
                print(f"  {kind:9s} {mode:8s}: {r['steps_per_s']:.2f} steps/s, median step {r['step_median_s'] * 1e3:.0f} ms{extra}", flush=True)
        latency = publish_latency(servers, args.publish_calls, args.bucket_bytes)
    finally:
        for s in servers:
            s.stop()
    ratios = {}
    for kind, modes in kinds.items():
        ratios[kind] = {
            "async_step_vs_nosync": modes["async"]["step_median_s"] / modes["none"]["step_median_s"],
            "async_vs_blocking_throughput": modes["async"]["steps_per_s"] / modes["blocking"]["steps_per_s"],
        }
    print(f"(a) simulated accelerator step: async step = {ratios['simulated']['async_step_vs_nosync']:.3f}x no-sync "
          f"(target <= 1.05x); async throughput = {ratios['simulated']['async_vs_blocking_throughput']:.2f}x blocking (target >= 1.4x)")
    print(f"(b) real CPU step: async step = {ratios['cpu']['async_step_vs_nosync']:.3f}x no-sync; "
          f"async throughput = {ratios['cpu']['async_vs_blocking_throughput']:.2f}x blocking (CPU shared with the sync)")
    print(f"publish() latency over {latency['calls']} calls: p50 {latency['p50_us']:.1f} us, p99 {latency['p99_us']:.1f} us "
          f"(target p99 <= 100 us)")
    results = {"model_bytes": nbytes, "step_s": step_s, "kinds": kinds, "ratios": ratios, "link_gbit": args.link_gbit,
               "publish_latency": latency,
               "note": "(a) simulates an accelerator: the host sleeps while the 'GPU' computes; (b) computes on the CPU"}
    save(name, results, plot)


if __name__ == "__main__":
    main()
