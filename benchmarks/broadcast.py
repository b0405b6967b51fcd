"""Blocking sync throughput vs a raw flat broadcast and a tensor-by-tensor broadcast, in one run.

The model has Qwen2-0.5B's layout at half width in bfloat16 (~315 MB, 290 tensors). For 1 and 2
receivers it measures, side by side:
  - raw flat:    one broadcast of a single flat buffer of the same bytes (the wire's ceiling);
  - per tensor:  one broadcast per tensor (what a naive sync does);
  - asyncsync:   WeightSync.publish to reference servers: plan, pack, checksum, broadcast, verify,
                 stage and swap in on every server, HTTP control included.
All three on gloo over loopback, interleaved round by round (flat, per tensor, sync, repeat) so
each ratio compares runs that saw the same machine. Writes benchmarks/results/broadcast.{json,png}.

    python -m benchmarks.broadcast [--repeats 5] [--bucket-bytes 64MiB]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from typing import Any

import torch
import torch.multiprocessing as mp

from asyncsync import WeightSync, WeightSyncConfig
from asyncsync.config import parse_bytes
from asyncsync.protocol.device import HostRuntime
from asyncsync.protocol.group import DataPlaneGroup, free_port
from asyncsync.protocol.wire import GroupSpec
from asyncsync.models import ModelConfig, build_model
from asyncsync.trainer.source import named_tensors
from asyncsync.receivers.reference.launch import ServerProcess, running
from benchmarks.common import RESULTS, write_json

QWEN2_05B_HALF = ModelConfig(
    family="qwen2", vocab_size=151936, hidden_size=448, intermediate_size=2432, num_layers=24,
    num_heads=14, num_kv_heads=2, tie_word_embeddings=True, dtype="bfloat16",
)


def _raw_receiver(spec: GroupSpec, rank: int, shapes: list[tuple[torch.dtype, tuple[int, ...]]], rounds: int) -> None:
    """A plain receiver: per round, one flat broadcast then one broadcast per tensor."""
    torch.set_num_threads(1)
    group = DataPlaneGroup.join(spec, rank, HostRuntime())
    flat = torch.empty(sum(torch.empty(s, dtype=d).nbytes for d, s in shapes), dtype=torch.uint8)
    tensors = [torch.empty(s, dtype=d) for d, s in shapes]
    for _ in range(rounds):
        group.broadcast(flat)
        group.barrier()
        for t in tensors:
            group.broadcast(t)
        group.barrier()
    group.close()


def measure(model: torch.nn.Module, receivers: int, repeats: int, bucket_bytes: int) -> dict[str, Any]:
    """Seconds for a raw flat broadcast, a tensor-by-tensor broadcast and a blocking sync of the same
    bytes to ``receivers`` receivers, interleaved round by round so all three see the same machine."""
    named = named_tensors(model)
    spec = GroupSpec("127.0.0.1", free_port(), receivers + 1, "raw", "gloo", 300.0)
    shapes = [(t.dtype, tuple(t.shape)) for t in named.values()]
    ctx = mp.get_context("spawn")
    raw = [ctx.Process(target=_raw_receiver, args=(spec, r, shapes, repeats + 1), daemon=True) for r in range(1, receivers + 1)]
    servers = [ServerProcess(build_model, (QWEN2_05B_HALF,), start_timeout_s=300) for _ in range(receivers)]
    try:
        for p in raw:
            p.start()
        group = DataPlaneGroup.join(spec, 0, HostRuntime())
        with running(servers):
            cfg = WeightSyncConfig.from_dict({"servers": [s.url for s in servers], "bucket_bytes": bucket_bytes})
            with WeightSync(cfg) as sync:
                sync.connect(model)
                flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in named.values()])
                times: dict[str, list[float]] = {"flat_s": [], "per_tensor_s": [], "sync_s": []}
                results = []
                for round_ in range(repeats + 1):  # round 0 warms every path up
                    t0 = time.perf_counter()
                    group.broadcast(flat)
                    group.barrier()
                    t1 = time.perf_counter()
                    for t in named.values():
                        group.broadcast(t)
                    group.barrier()
                    t2 = time.perf_counter()
                    results.append(sync.publish(model, round_ + 1))
                    t3 = time.perf_counter()
                    if round_:
                        for key, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
                            times[key].append(dt)
                last = results[-1]
                out = {k: statistics.median(v) for k, v in times.items()}
                out.update(buckets=last.buckets, pack_backend=sync.pack_backend,
                           last={"pack_s": last.pack_s, "wire_s": last.wire_s, "apply_s": last.apply_s, "total_s": last.total_s})
        group.close()
        return out
    finally:
        for p in raw:
            p.join(60)
            if p.is_alive():
                p.kill()


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ["raw flat", "asyncsync sync", "per tensor"]
    keys = ["flat_gbps", "sync_gbps", "per_tensor_gbps"]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.25
    for i, (label, key) in enumerate(zip(labels, keys)):
        xs = [r["receivers"] + (i - 1) * width for r in rows]
        bars = ax.bar(xs, [r[key] for r in rows], width, label=label)
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_xticks([r["receivers"] for r in rows], [f"{r['receivers']} receiver(s)" for r in rows])
    ax.set_ylabel("GB/s (model bytes / wall time)")
    ax.set_title(f"{rows[0]['model_mb']:.0f} MB model, gloo on loopback, CPU only")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-bytes", default="64MiB")
    parser.add_argument("--receivers", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    bucket_bytes = parse_bytes(args.bucket_bytes, "--bucket-bytes")

    model = build_model(QWEN2_05B_HALF)
    named = named_tensors(model)
    nbytes = sum(t.nbytes for t in named.values())
    rows = []
    for n in args.receivers:
        m = measure(model, n, args.repeats, bucket_bytes)
        row = {
            "receivers": n, "model_mb": nbytes / 1e6, "tensors": len(named), **m,
            "flat_gbps": nbytes / m["flat_s"] / 1e9, "per_tensor_gbps": nbytes / m["per_tensor_s"] / 1e9,
            "sync_gbps": nbytes / m["sync_s"] / 1e9,
            "sync_vs_flat": m["flat_s"] / m["sync_s"], "sync_vs_per_tensor": m["per_tensor_s"] / m["sync_s"],
        }
        rows.append(row)
        print(f"{n} receiver(s): {nbytes / 1e6:.0f} MB, {len(named)} tensors, {row['buckets']} buckets | "
              f"raw flat {m['flat_s']:.3f}s ({row['flat_gbps']:.2f} GB/s) | "
              f"per tensor {m['per_tensor_s']:.3f}s ({row['per_tensor_gbps']:.2f} GB/s) | "
              f"asyncsync {m['sync_s']:.3f}s ({row['sync_gbps']:.2f} GB/s) | "
              f"sync/flat {row['sync_vs_flat']:.2f}x (target >= 0.9x), "
              f"sync/per-tensor {row['sync_vs_per_tensor']:.2f}x (target >= 2x)", flush=True)
    targets = {"sync_vs_flat": 0.9, "sync_vs_per_tensor": 2.0}
    path = write_json("broadcast", {"bucket_bytes": bucket_bytes, "repeats": args.repeats, "targets": targets, "rows": rows})
    plot(rows, str(RESULTS / "broadcast.png"))
    print(f"wrote {path} and {RESULTS / 'broadcast.png'}")


if __name__ == "__main__":
    main()
