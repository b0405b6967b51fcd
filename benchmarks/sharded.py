"""Sharded trainers: sync time with every rank sending the buckets it owns (spread) vs. everything
through rank 0 (funnel), and the memory each rank's sync allocates, per mode.

    python -m benchmarks.sharded [--versions 5]

For trainer_ranks 1 and 2 (spawned CPU ranks, gloo, the policy ``fully_shard``-ed over them with
FSDP2), two reference servers: each row has ``sync_s`` (median blocking ``publish``, spread),
``funnel_sync_s`` (the same with ``funnel: true``), ``spread_vs_funnel`` (funnel / spread: above 1
means spreading is faster) and ``extra_bytes_per_rank`` (the most any rank allocated, on the device
and in host memory) for blocking, async with ``snapshot: device`` and async with ``snapshot: host``.
Writes benchmarks/results/sharded.{json,png}.

On one host every rank shares the same cores and the same loopback, so
spreading cannot use more bandwidth than the funnel: on a cluster each rank has its own NIC. The
memory figures are the buffers' own bytes and do not depend on the machine.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from typing import Any

from asyncsync.models import ModelConfig, build_model
from asyncsync.launch.reference import ServerProcess, running
from asyncsync.trainer.local_ranks import run_local_ranks
from benchmarks.common import save

# The GRPO demo's policy shape with fewer experts: ~50 MB, many tensors, few FLOPs.
MODEL = ModelConfig(family="qwen2_moe", vocab_size=15, hidden_size=256, intermediate_size=512, num_layers=2,
                    num_heads=4, num_kv_heads=2, num_experts=16, num_experts_per_tok=2, moe_intermediate_size=256)
MODES = {"blocking": dict(async_weight_update=False), "async_device": dict(async_weight_update=True, snapshot="device"),
         "async_host": dict(async_weight_update=True, snapshot="host")}


def rank_main(rank: int, world: int, urls: list[str], versions: int, bucket_bytes: str) -> dict[str, Any]:
    """One trainer rank: the blocking sync timed spread and funnel, then each mode's buffers measured."""
    logging.basicConfig(level=logging.WARNING)
    from asyncsync import WeightSync, WeightSyncConfig

    model = build_model(MODEL)
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    version = 1_000_000 * world  # above whatever the servers hold from an earlier row

    def config(**extra: Any) -> Any:
        return WeightSyncConfig.from_dict({"servers": urls, "bucket_bytes": bucket_bytes, **extra})

    out: dict[str, Any] = {}
    for label, extra in (("spread", {}), ("funnel", {"funnel": True})):
        with WeightSync(config(async_weight_update=False, **extra)) as sync:
            sync.connect(model)
            times = []
            for _ in range(versions):
                version += 1
                t0 = time.perf_counter()
                result = sync.publish(model, version)
                times.append(time.perf_counter() - t0)
                assert result is not None and not result.failures, result
            out[f"{label}_sync_s"] = statistics.median(times)
            out["model_bytes"], out["bucket_bytes"] = sync.plan.total_bytes, sync.plan.max_bucket_bytes
    memory = {}
    for mode, extra in MODES.items():
        with WeightSync(config(**extra)) as sync:
            sync.connect(model)
            for _ in range(2):  # a real version through every buffer
                sync.wait_snapshot()
                version += 1
                sync.publish(model, version)
            memory[mode] = {"device": sync.footprint.device, "host": sync.footprint.host}
        assert not sync.errors, sync.errors
    out["memory"] = memory
    return out


def run_world(world: int, urls: list[str], versions: int, bucket_bytes: str) -> dict[str, Any]:
    outcomes = run_local_ranks(rank_main, world, (urls, versions, bucket_bytes))
    for o in outcomes:
        if o.error is not None or o.exitcode != 0:
            raise RuntimeError(f"rank {o.rank} failed (exit code {o.exitcode}):\n{o.error}")
    reports = {o.rank: o.value for o in outcomes}
    lead = reports[0]
    extra = {mode: {kind: max(r["memory"][mode][kind] for r in reports.values()) for kind in ("device", "host")}
             for mode in MODES}
    return {
        "trainer_ranks": world, "model_bytes": lead["model_bytes"], "bucket_bytes": lead["bucket_bytes"],
        "sync_s": lead["spread_sync_s"], "funnel_sync_s": lead["funnel_sync_s"],
        "spread_vs_funnel": lead["funnel_sync_s"] / lead["spread_sync_s"], "extra_bytes_per_rank": extra,
    }


def plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    x = range(len(rows))
    for i, (key, label) in enumerate((("sync_s", "spread (each rank sends its buckets)"), ("funnel_sync_s", "funnel (rank 0 sends all)"))):
        bars = ax1.bar([j + (i - 0.5) * 0.35 for j in x], [r[key] * 1e3 for r in rows], 0.35, label=label)
        ax1.bar_label(bars, fmt="%.0f", fontsize=8)
    ax1.set_xticks(list(x), [f"{r['trainer_ranks']} rank(s)" for r in rows])
    ax1.set_ylabel("blocking sync, ms (median)")
    ax1.set_title(f"{rows[0]['model_bytes'] / 1e6:.0f} MB to 2 servers, loopback")
    ax1.legend(fontsize=8)
    modes = list(MODES)
    width = 0.8 / len(rows)
    for i, r in enumerate(rows):
        dev = [r["extra_bytes_per_rank"][m]["device"] / 1e6 for m in modes]
        host = [r["extra_bytes_per_rank"][m]["host"] / 1e6 for m in modes]
        pos = [j + (i - (len(rows) - 1) / 2) * width for j in range(len(modes))]
        bars = ax2.bar(pos, dev, width, label=f"{r['trainer_ranks']} rank(s): device")
        ax2.bar(pos, host, width, bottom=dev, hatch="//", alpha=0.5, label=f"{r['trainer_ranks']} rank(s): host")
        ax2.bar_label(bars, fmt="%.0f", fontsize=8)
    ax2.axhline(rows[0]["model_bytes"] / 1e6, color="gray", linestyle="--", linewidth=1, label="the model")
    ax2.set_xticks(range(len(modes)), ["blocking", "async\nsnapshot: device", "async\nsnapshot: host"])
    ax2.set_ylabel("MB the sync allocates, most of any rank")
    ax2.set_title("Extra memory per rank")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--versions", type=int, default=5, help="blocking versions timed per row and mode")
    parser.add_argument("--bucket-bytes", default="4MiB")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    name = "sharded"
    rows = []
    with running([ServerProcess(build_model, (MODEL,), start_timeout_s=300) for _ in range(2)]) as servers:
        urls = [s.url for s in servers]
        for world in (1, 2):
            row = run_world(world, urls, args.versions, args.bucket_bytes)
            rows.append(row)
            mem = ", ".join(f"{m} {v['device'] / 1e6:.1f} MB device + {v['host'] / 1e6:.1f} MB host"
                            for m, v in row["extra_bytes_per_rank"].items())
            print(f"trainer_ranks {world}: sync {row['sync_s'] * 1e3:.0f} ms spread, {row['funnel_sync_s'] * 1e3:.0f} ms "
                  f"funnel ({row['spread_vs_funnel']:.2f}x); model {row['model_bytes'] / 1e6:.1f} MB, bucket "
                  f"{row['bucket_bytes'] / 1e6:.1f} MB; per rank: {mem}", flush=True)
    results = {"rows": rows, "bucket_bytes_config": args.bucket_bytes,
               "note": "one host: every rank shares the cores and the link, so spreading cannot add bandwidth here"}
    save(name, results, plot)


if __name__ == "__main__":
    main()
