"""Bucket packing: the C++ extension against memcpy, the tensor-by-tensor torch backend and torch.cat.

Two buckets, all buffers preallocated and touched before timing, medians of interleaved repeats:
  - big:   250 MiB in 4 large tensors (3 bf16 + 1 fp32). Extension pack vs a plain memcpy of the
           same bytes (``dst.copy_(src)`` on one flat uint8 tensor); target >= 0.9x memcpy speed.
  - small: 20,000 tensors of 1-8 KiB (MoE-like). Extension pack vs TorchPackBackend (one
           ``copy_`` per tensor); target >= 5x.
For both: the fused CRC32C's cost over pack alone (target <= 10% on the big bucket), the torch
backend with its checksum (copy_ loop, then the crc32c package), and ``torch.cat`` for reference.
Runs with 1 thread and with torch's default thread count. Writes benchmarks/results/pack.{json,png}
and prints a table.

    python -m benchmarks.pack [--repeats 9] [--threads 1 2 ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from asyncsync.packing import PackBackend, get_backend
from asyncsync.packing.torch_backend import TorchPackBackend
from asyncsync.protocol.specs import BucketPlan
from benchmarks.common import RESULTS, write_json

MIB = 1024 * 1024
TARGETS = {"big_vs_memcpy": 0.9, "small_vs_torch": 5.0, "checksum_overhead": 0.10}


def big_bucket() -> list[torch.Tensor]:
    """250 MiB: three 64 MiB bf16 matrices and one 58 MiB fp32 matrix."""
    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(8192, 4096, generator=g).to(torch.bfloat16) for _ in range(3)]
    ts.append(torch.randn(3712, 4096, generator=g))
    return ts


def small_bucket(count: int = 20_000) -> list[torch.Tensor]:
    """``count`` tensors of 1-8 KiB, fp32 and bf16 mixed, like many experts' small weights."""
    g = torch.Generator().manual_seed(1)
    sizes = torch.randint(512, 2049, (count,), generator=g).tolist()
    return [torch.randn(n, generator=g).to(torch.bfloat16 if i % 2 else torch.float32) for i, n in enumerate(sizes)]


def lay_out(ts: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int], int]:
    """The tensors in BucketPlan order with their offsets, as one bucket."""
    plan = BucketPlan.from_tensors([(f"t{i}", t) for i, t in enumerate(ts)], bucket_bytes=1 << 40)
    (bucket,) = plan.buckets
    by_name = {f"t{i}": t for i, t in enumerate(ts)}
    return [by_name[s.name] for s in bucket.specs], list(bucket.offsets), bucket.nbytes


def interleaved_medians(cases: dict[str, Callable[[], object]], repeats: int, warmup: int = 2) -> dict[str, float]:
    """Median seconds per case, the cases taking turns round by round.

    Taking turns spreads background load (this machine is shared) over every case alike instead of
    letting it land on whichever case happened to be running.
    """
    times: dict[str, list[float]] = {label: [] for label in cases}
    for round_ in range(warmup + repeats):
        for label, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            if round_ >= warmup:
                times[label].append(time.perf_counter() - t0)
    return {label: statistics.median(ts) for label, ts in times.items()}


def measure(name: str, ts: list[torch.Tensor], cpp: PackBackend, repeats: int) -> dict[str, Any]:
    srcs, offsets, nbytes = lay_out(ts)
    out = torch.zeros(nbytes, dtype=torch.uint8)  # zero_ touches every page before timing
    ref = torch.zeros(nbytes, dtype=torch.uint8)
    flat_src = torch.cat([t.reshape(-1).view(torch.uint8) for t in srcs])
    flat_dst = torch.zeros(nbytes, dtype=torch.uint8)
    torch_backend = TorchPackBackend()

    # Same bytes and checksum as the reference before any timing.
    if cpp.pack(srcs, offsets, out, True) != torch_backend.pack(srcs, offsets, ref, True) or not torch.equal(out, ref):
        raise RuntimeError(f"{name}: the extension's bytes or checksum differ from TorchPackBackend's")

    views = [t.reshape(-1).view(torch.uint8) for t in srcs]
    cases: dict[str, Callable[[], object]] = {
        "memcpy (copy_ of one flat buffer)": lambda: flat_dst.copy_(flat_src),
        "torch.cat": lambda: torch.cat(views, out=ref),
        "torch backend (copy_ per tensor)": lambda: torch_backend.pack(srcs, offsets, ref, False),
        "torch backend + crc32c": lambda: torch_backend.pack(srcs, offsets, ref, True),
        "cpp pack": lambda: cpp.pack(srcs, offsets, out, False),
        "cpp pack + fused crc32c": lambda: cpp.pack(srcs, offsets, out, True),
    }
    seconds = interleaved_medians(cases, repeats)
    return {
        "tensors": len(srcs),
        "bytes": nbytes,
        "seconds": seconds,
        "gb_per_s": {label: nbytes / s / 1e9 for label, s in seconds.items()},
    }


def ratios_of(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    big, small = results["big"]["seconds"], results["small"]["seconds"]
    return {
        "big_vs_memcpy": big["memcpy (copy_ of one flat buffer)"] / big["cpp pack"],
        "small_vs_torch": small["torch backend (copy_ per tensor)"] / small["cpp pack"],
        "checksum_overhead": big["cpp pack + fused crc32c"] / big["cpp pack"] - 1,
        "checksum_overhead_small": small["cpp pack + fused crc32c"] / small["cpp pack"] - 1,
        "big_vs_torch_cat": big["torch.cat"] / big["cpp pack"],
        "small_vs_torch_cat": small["torch.cat"] / small["cpp pack"],
        "big_checksummed_vs_torch_checksummed": big["torch backend + crc32c"] / big["cpp pack + fused crc32c"],
        "small_checksummed_vs_torch_checksummed": small["torch backend + crc32c"] / small["cpp pack + fused crc32c"],
    }


def targets_met(ratios: dict[str, float]) -> dict[str, bool]:
    return {
        "big_vs_memcpy": ratios["big_vs_memcpy"] >= TARGETS["big_vs_memcpy"],
        "small_vs_torch": ratios["small_vs_torch"] >= TARGETS["small_vs_torch"],
        "checksum_overhead": ratios["checksum_overhead"] <= TARGETS["checksum_overhead"],
    }


def plot(runs: dict[int, dict[str, dict[str, Any]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = ["#999999", "#bbbbbb", "#d98c5f", "#c0504d", "#4f81bd", "#1f4e79"]
    fig, axes = plt.subplots(len(runs), 2, figsize=(13, 4.2 * len(runs)), squeeze=False)
    for row, (threads, results) in zip(axes, runs.items()):
        for ax, (name, r) in zip(row, results.items()):
            labels = list(r["seconds"])
            ms = [r["seconds"][k] * 1e3 for k in labels]
            bars = ax.barh(labels, ms, color=colors)
            for bar, label in zip(bars, labels):
                ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2,
                        f" {bar.get_width():.1f} ms ({r['gb_per_s'][label]:.1f} GB/s)", va="center", fontsize=8)
            ax.invert_yaxis()
            ax.set_xlim(0, max(ms) * 1.45)
            ax.set_xlabel("median time per bucket (ms), lower is better")
            ax.set_title(f"{name}: {r['tensors']:,} tensors, {r['bytes'] / MIB:.0f} MiB, {threads} thread(s)")
    fig.suptitle("Packing one bucket on CPU")
    fig.tight_layout()
    fig.savefig(RESULTS / "pack.png", dpi=110)
    plt.close(fig)


def print_run(threads: int, results: dict[str, dict[str, Any]], ratios: dict[str, float], met: dict[str, bool]) -> None:
    for name, r in results.items():
        print(f"\n{name} bucket: {r['tensors']:,} tensors, {r['bytes'] / MIB:.1f} MiB, {threads} thread(s)")
        print(f"  {'path':<36} {'median ms':>10} {'GB/s':>8}")
        for label, s in r["seconds"].items():
            print(f"  {label:<36} {s * 1e3:>10.2f} {r['gb_per_s'][label]:>8.2f}")
    ok = {k: "met" if v else "MISSED" for k, v in met.items()}
    print(f"\ncomparison ({threads} thread(s))                ratio    target")
    print(f"  big: cpp pack speed / memcpy speed      {ratios['big_vs_memcpy']:6.2f}x  >= 0.9x  {ok['big_vs_memcpy']}")
    print(f"  small: cpp pack vs torch copy_ loop     {ratios['small_vs_torch']:6.2f}x  >= 5x    {ok['small_vs_torch']}")
    print(f"  big: fused checksum overhead           {ratios['checksum_overhead']:+7.1%}  <= 10%   {ok['checksum_overhead']}")
    print(f"  small: fused checksum overhead         {ratios['checksum_overhead_small']:+7.1%}")
    print(f"  cpp pack vs torch.cat (big / small)     {ratios['big_vs_torch_cat']:6.2f}x / {ratios['small_vs_torch_cat']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, nargs="+",
                        help="torch thread counts to run (default: 1 and torch's default)")
    args = parser.parse_args()
    thread_counts = args.threads or sorted({1, torch.get_num_threads()})
    cpp = get_backend("auto", "cpu")
    if cpp.name != "cpp":
        from asyncsync.packing.native import status

        raise SystemExit(f"the C++ extension is not active ({status()['cpu_extension_error']}); nothing to compare")

    buckets = {"big": big_bucket(), "small": small_bucket()}
    load_before = os.getloadavg()[0]
    runs: dict[int, dict[str, dict[str, Any]]] = {}
    for threads in thread_counts:
        torch.set_num_threads(threads)
        runs[threads] = {name: measure(name, ts, cpp, args.repeats) for name, ts in buckets.items()}
    load_after = os.getloadavg()[0]

    report = {}
    for threads, results in runs.items():
        ratios = ratios_of(results)
        met = targets_met(ratios)
        report[f"threads={threads}"] = {"results": results, "ratios": ratios, "targets_met": met}
        print_run(threads, results, ratios, met)
    path = write_json("pack", {"repeats": args.repeats, "load_average_1min": [load_before, load_after],
                               "targets": TARGETS, "runs": report})
    plot(runs)
    print(f"\n1-minute load average before/after: {load_before:.2f} / {load_after:.2f} "
          "(other work on this machine makes the figures noisy)")
    print(f"wrote {path} and {RESULTS / 'pack.png'}")


if __name__ == "__main__":
    main()
