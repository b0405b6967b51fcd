"""Blocking sync throughput vs a raw flat broadcast and a tensor-by-tensor broadcast, in one run.

The model has Qwen2-0.5B's layout at half width in bfloat16 (~315 MB, 290 tensors). For 1 and 2
receivers it measures, side by side:
  - raw flat:    one broadcast of a single flat buffer of the same bytes (the wire's ceiling);
  - per tensor:  one broadcast per tensor (what a naive sync does);
  - asyncsync:   WeightSync.publish to reference servers: plan, pack, checksum, broadcast, verify,
                 stage and swap in on every server, HTTP control included (``transport: collective``);
  - shm:         (plain loopback only; rows with ``transport: "shm"``) the same publish to the same
                 servers through shared memory (``transport: shm``): packed into a segment, mapped,
                 verified and adopted by every server, no socket copy; ``shm_vs_flat`` is the raw flat
                 broadcast's time over the shm sync's, from rounds interleaved with it.
All three on gloo, interleaved round by round (flat, per tensor, sync, repeat) so each ratio
compares runs that saw the same machine, in two regimes:
  - plain loopback (rows with ``link_gbit: null``): the wire is a kernel memcpy on the same cores
    that pack, checksum and verify, so the ratios measure CPU contention;
  - emulated links (``link_gbit: R``, ``link_delay_us: D``): the same measurement inside a network
    namespace whose loopback is shaped to R gbit/s (+ D us each way), as ``asyncsync.netns`` makes
    it; every byte to every receiver crosses that one link, so the wire is the bottleneck, as on a
    cluster. A link that cannot be made here is listed under ``skipped`` with the reason.
Writes benchmarks/results/broadcast.{json,png}.

    python -m benchmarks.broadcast [--repeats 5] [--bucket-bytes 64MiB] [--link-gbit 4 8 16]
                                   [--link-delay-us 0 25] [--no-loopback]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
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
from asyncsync.launch.reference import ServerProcess, running
from asyncsync import netns
from benchmarks.common import RESULTS, write_json
from asyncsync.netns import Link

QWEN2_05B_HALF = ModelConfig(
    family="qwen2", vocab_size=151936, hidden_size=448, intermediate_size=2432, num_layers=24,
    num_heads=14, num_kv_heads=2, tie_word_embeddings=True, dtype="bfloat16",
)


# On plain loopback the wire is a memcpy on the cores that also pack and verify (CPU contention);
# on an emulated link the wire is the bottleneck, as on a cluster.
TARGETS = {"sync_vs_flat": 0.9, "sync_vs_per_tensor": 2.0, "shm_vs_flat": 3.0}
LINK_TARGETS = {"sync_vs_flat": 0.95, "sync_vs_flat_at_gbit": [4.0, 8.0],
                "sync_vs_per_tensor": 2.0, "sync_vs_per_tensor_at_delay_us": 25.0}
# Rounds of each block not measured: a receiver allocates its two buffer sets (the one it serves
# from and the one it receives into) in the first two versions of a layout.
WARMUP_ROUNDS = 2
LINK_RUN_TIMEOUT_S = 1200.0  # one link's rows: model, servers and every round, with room to spare


def _raw_receiver(spec: GroupSpec, rank: int, shapes: list[tuple[torch.dtype, tuple[int, ...]]], rounds: int,
                  flat_rounds: int) -> None:
    """A plain receiver: per round, one flat broadcast then one broadcast per tensor; then
    ``flat_rounds`` flat broadcasts alone (the shared-memory block's)."""
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
    for _ in range(flat_rounds):
        group.broadcast(flat)
        group.barrier()
    group.close()


def measure(model: torch.nn.Module, receivers: int, repeats: int, bucket_sizes: list[int]) -> dict[str, Any]:
    """Seconds for a raw flat broadcast, a tensor-by-tensor broadcast and a blocking sync of the same
    bytes to ``receivers`` receivers, interleaved round by round so all three see the same machine.

    One block of rounds per bucket size (a sync connects once per block); the first size gives the
    row's figures, every size an entry of ``bucket_sweep`` with its block's flat and sync medians."""
    named = named_tensors(model)
    spec = GroupSpec("127.0.0.1", free_port(), receivers + 1, "raw", "gloo", 300.0)
    shapes = [(t.dtype, tuple(t.shape)) for t in named.values()]
    rounds = repeats + WARMUP_ROUNDS
    ctx = mp.get_context("spawn")
    raw = [ctx.Process(target=_raw_receiver, args=(spec, r, shapes, rounds * len(bucket_sizes), rounds), daemon=True)
           for r in range(1, receivers + 1)]
    servers = [ServerProcess(build_model, (QWEN2_05B_HALF,), start_timeout_s=300) for _ in range(receivers)]
    try:
        for p in raw:
            p.start()
        group = DataPlaneGroup.join(spec, 0, HostRuntime())
        flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in named.values()])
        blocks, version = [], 0
        with running(servers):
            for bucket_bytes in bucket_sizes:
                # Whole versions, as the raw broadcast sends: deltas have their own benchmark (benchmarks/delta.py).
                cfg = WeightSyncConfig.from_dict({"servers": [s.url for s in servers], "bucket_bytes": bucket_bytes,
                                                  "transport": "collective", "delta": "off"})
                with WeightSync(cfg) as sync:
                    sync.connect(model)
                    times: dict[str, list[float]] = {"flat_s": [], "per_tensor_s": [], "sync_s": []}
                    for round_ in range(rounds):
                        t0 = time.perf_counter()
                        t1 = t0 + timed_flat(group, flat)
                        for t in named.values():
                            group.broadcast(t)
                        group.barrier()
                        t2 = time.perf_counter()
                        version += 1
                        last = sync.publish(model, version)
                        t3 = time.perf_counter()
                        assert last is not None and last.wire_bytes == last.nbytes == flat.numel(), (
                            "the sync must broadcast the whole version, as the raw broadcast does", last)
                        if round_ >= WARMUP_ROUNDS:
                            for key, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
                                times[key].append(dt)
                    assert last is not None
                    block = {k: statistics.median(v) for k, v in times.items()}
                    block.update(bucket_bytes=bucket_bytes, buckets=last.buckets, buffer_bytes=sync.footprint.device,
                                 pack_backend=sync.pack_backend,
                                 last={"pack_s": last.pack_s, "wire_s": last.wire_s, "apply_s": last.apply_s, "total_s": last.total_s})
                    blocks.append(block)
            shm = _shm_block(group, flat, model, servers, bucket_sizes[0], rounds, version)
        group.close()
        main = blocks[0]
        out = {k: main[k] for k in ("flat_s", "per_tensor_s", "sync_s", "buckets", "pack_backend", "last")}
        out["bucket_sweep"] = [{k: b[k] for k in ("bucket_bytes", "buckets", "buffer_bytes", "flat_s", "sync_s")}
                               | {"sync_vs_flat": b["flat_s"] / b["sync_s"]} for b in blocks]
        out["shm"] = shm
        return out
    finally:
        for p in raw:
            p.join(60)
            if p.is_alive():
                p.kill()


def timed_flat(group: DataPlaneGroup, flat: torch.Tensor) -> float:
    """Seconds for one raw broadcast of ``flat`` to every receiver (until all of them have it)."""
    t0 = time.perf_counter()
    group.broadcast(flat)
    group.barrier()
    return time.perf_counter() - t0


def _shm_block(group: DataPlaneGroup, flat: torch.Tensor, model: torch.nn.Module, servers: list[ServerProcess],
               bucket_bytes: int, rounds: int, version: int) -> dict[str, Any]:
    """Rounds of (raw flat broadcast, blocking sync through shared memory) to the same servers; the
    raw receivers take part in the flat broadcasts as in every other block."""
    cfg = WeightSyncConfig.from_dict({"servers": [s.url for s in servers], "bucket_bytes": bucket_bytes, "transport": "shm",
                                      "delta": "off"})
    times: dict[str, list[float]] = {"flat_s": [], "sync_s": [], "pack_s": [], "transfer_s": []}
    with WeightSync(cfg) as sync:
        sync.connect(model)
        for round_ in range(rounds):
            flat_s = timed_flat(group, flat)
            version += 1
            t0 = time.perf_counter()
            last = sync.publish(model, version)
            sync_s = time.perf_counter() - t0
            assert last is not None and len(last.server_versions) == len(servers), last and last.failures
            assert last.wire_bytes == 0, "shared memory: no byte of the version crosses a socket"
            if round_ >= WARMUP_ROUNDS:
                times["flat_s"].append(flat_s)
                times["sync_s"].append(sync_s)
                times["pack_s"].append(last.pack_s)
                times["transfer_s"].append(sync_s - last.pack_s)
        shm_bytes = sync.footprint.device
    block: dict[str, Any] = {k: statistics.median(v) for k, v in times.items()}
    return block | {"bucket_bytes": bucket_bytes, "shm_bytes": shm_bytes,
                    "last": {"pack_s": last.pack_s, "wire_s": last.wire_s, "apply_s": last.apply_s, "total_s": last.total_s}}


def shm_row(receivers: int, nbytes: int, tensors: int, m: dict[str, Any]) -> dict[str, Any]:
    """The shared-memory row measured beside a loopback row. ``shm_vs_flat``: the raw flat broadcast's
    time over the whole blocking publish (packing the live weights into the segment included, which
    the flat broadcast, sending a buffer already flat, does not pay); ``shm_transfer_vs_flat``: over
    the publish less that packing (``transfer_s``: from a packed version to every server serving it)."""
    s = m["shm"]
    return {"transport": "shm", "receivers": receivers, "link_gbit": None, "link_delay_us": 0.0, "model_mb": nbytes / 1e6,
            "tensors": tensors, "bucket_bytes": s["bucket_bytes"], "flat_s": s["flat_s"], "sync_s": s["sync_s"],
            "flat_gbps": nbytes / s["flat_s"] / 1e9, "sync_gbps": nbytes / s["sync_s"] / 1e9,
            "pack_s": s["pack_s"], "transfer_s": s["transfer_s"], "shm_vs_flat": s["flat_s"] / s["sync_s"],
            "shm_transfer_vs_flat": s["flat_s"] / s["transfer_s"], "shm_bytes": s["shm_bytes"], "last": s["last"]}


def row(receivers: int, nbytes: int, tensors: int, m: dict[str, Any], link: Link | None) -> dict[str, Any]:
    """One row of the results: the measured seconds, GB/s and the two ratios, and the link they crossed."""
    return {
        "transport": "collective", "receivers": receivers, "link_gbit": link.gbit if link else None, "link_delay_us": link.delay_us if link else 0.0,
        "model_mb": nbytes / 1e6, "tensors": tensors, **{k: v for k, v in m.items() if k != "shm"},
        "flat_gbps": nbytes / m["flat_s"] / 1e9, "per_tensor_gbps": nbytes / m["per_tensor_s"] / 1e9,
        "sync_gbps": nbytes / m["sync_s"] / 1e9,
        "sync_vs_flat": m["flat_s"] / m["sync_s"], "sync_vs_per_tensor": m["per_tensor_s"] / m["sync_s"],
    }


def where(r: dict[str, Any]) -> str:
    if r["link_gbit"] is None:
        return "loopback"
    return Link(r["link_gbit"], r["link_delay_us"]).describe()


def report(r: dict[str, Any]) -> None:
    if r["transport"] == "shm":
        print(f"[shared memory] {r['receivers']} receiver(s): raw flat {r['flat_s']:.3f}s | asyncsync through shm "
              f"{r['sync_s']:.3f}s ({r['sync_gbps']:.2f} GB/s; packing {r['pack_s']:.3f}s, then {r['transfer_s']:.3f}s) | "
              f"shm vs flat {r['shm_vs_flat']:.2f}x ({r['shm_transfer_vs_flat']:.2f}x without the packing)", flush=True)
        return
    print(f"[{where(r)}] {r['receivers']} receiver(s): {r['model_mb']:.0f} MB, {r['tensors']} tensors, {r['buckets']} buckets | "
          f"raw flat {r['flat_s']:.3f}s ({r['flat_gbps']:.2f} GB/s) | "
          f"per tensor {r['per_tensor_s']:.3f}s ({r['per_tensor_gbps']:.2f} GB/s) | "
          f"asyncsync {r['sync_s']:.3f}s ({r['sync_gbps']:.2f} GB/s) | "
          f"sync/flat {r['sync_vs_flat']:.2f}x, sync/per-tensor {r['sync_vs_per_tensor']:.2f}x", flush=True)
    sweep = ", ".join(f"{b['bucket_bytes'] / 2**20:.0f} MiB {b['sync_vs_flat']:.2f}x" for b in r["bucket_sweep"])
    print(f"    sync/flat by bucket size: {sweep}", flush=True)


def measure_here(receivers: list[int], repeats: int, bucket_sizes: list[int]) -> list[dict[str, Any]]:
    """Rows for each receiver count, measured on whatever loopback this process sees."""
    model = build_model(QWEN2_05B_HALF)
    named = named_tensors(model)
    nbytes = sum(t.nbytes for t in named.values())
    rows = []
    for n in receivers:
        m = measure(model, n, repeats, bucket_sizes)
        rows += [row(n, nbytes, len(named), m, None), shm_row(n, nbytes, len(named), m)]
    return rows


def measure_on_link(link: Link, args: argparse.Namespace) -> list[dict[str, Any]] | str:
    """The same rows measured in a network namespace whose loopback is shaped as ``link``
    (``asyncsync.netns``), or the reason it could not be made."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        cmd = [sys.executable, "-m", "benchmarks.broadcast", "--rows-json", str(out), "--repeats", str(args.repeats),
               "--bucket-bytes", args.bucket_bytes, "--bucket-sweep", *args.bucket_sweep,
               "--receivers", *map(str, args.receivers)]
        done = netns.run(link, cmd, timeout_s=LINK_RUN_TIMEOUT_S)
        if done.skipped is not None:
            return done.skipped
        if done.returncode != 0:
            raise RuntimeError(f"the broadcast benchmark on a {link.describe()} link exited with code {done.returncode}")
        measured = json.loads(out.read_text())
    return [{**r, "link_gbit": link.gbit, "link_delay_us": link.delay_us} for r in measured if r["transport"] != "shm"]


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """One panel per setting (loopback, then each link), bars per receiver count; on a link, a dashed
    line marks each receiver's share of it (the trainer sends every byte once per receiver)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shm = [r for r in rows if r["transport"] == "shm"]
    rows = [r for r in rows if r["transport"] != "shm"]
    settings = list(dict.fromkeys(where(r) for r in rows))
    fig, axes = plt.subplots(1, len(settings) + 1, figsize=(4.2 * (len(settings) + 1), 4.2), squeeze=False)
    labels = ["raw flat", "asyncsync sync", "per tensor"]
    keys = ["flat_gbps", "sync_gbps", "per_tensor_gbps"]
    width = 0.25
    for ax, setting in zip(axes[0], settings):
        here = [r for r in rows if where(r) == setting]
        for i, (label, key) in enumerate(zip(labels, keys)):
            xs = [r["receivers"] + (i - 1) * width for r in here]
            bars = ax.bar(xs, [r[key] for r in here], width, label=label)
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
        if setting == "loopback" and shm:
            bars = ax.bar([r["receivers"] + 2 * width for r in shm], [r["sync_gbps"] for r in shm], width,
                          label="asyncsync, shared memory")
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
        for r in here:
            if r["link_gbit"] is not None:
                share = r["link_gbit"] / 8 / r["receivers"]
                ax.hlines(share, r["receivers"] - 1.5 * width, r["receivers"] + 1.5 * width, colors="k", linestyles="dashed")
        ax.set_xticks([r["receivers"] for r in here], [f"{r['receivers']} receiver(s)" for r in here])
        ax.set_title(setting)
    sweep_ax = axes[0][-1]
    for r in rows:
        sweep = sorted(r["bucket_sweep"], key=lambda b: b["bucket_bytes"])
        sweep_ax.plot([b["bucket_bytes"] / 2**20 for b in sweep], [b["sync_vs_flat"] for b in sweep], marker="o",
                      label=f"{where(r)}, {r['receivers']} recv.")
    sweep_ax.set_xscale("log", base=2)
    sweep_ax.set_xlabel("bucket_bytes (MiB)")
    sweep_ax.set_ylabel("sync / raw flat")
    sweep_ax.set_title("by bucket size")
    sweep_ax.legend(fontsize=6)
    axes[0][0].set_ylabel("GB/s (model bytes / wall time)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{rows[0]['model_mb']:.0f} MB model, gloo, CPU only; dashed: the link's share per receiver")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-bytes", default="64MiB", help="the bucket size of the rows' sync figures")
    parser.add_argument("--bucket-sweep", nargs="*", default=["16MiB", "32MiB", "128MiB", "512MiB"],
                        help="more bucket sizes whose sync is measured too (each row's bucket_sweep)")
    parser.add_argument("--receivers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--link-gbit", type=float, nargs="*", default=[4.0, 8.0, 16.0],
                        help="emulated link rates (gbit/s) to measure on besides plain loopback; none: loopback only")
    parser.add_argument("--link-delay-us", type=float, nargs="+", default=[0.0, 25.0],
                        help="one-way delays (us) to add on each emulated link (netem); 0: none")
    parser.add_argument("--no-loopback", action="store_true", help="skip the plain-loopback rows")
    parser.add_argument("--results", default="broadcast",
                        help="name of the results files (benchmarks/results/NAME.json and .png): a partial run "
                             "(fewer links, no sweep) under another name leaves the full one in place")
    parser.add_argument("--rows-json", help=argparse.SUPPRESS)  # inside a link: measure, write rows here, stop
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    bucket_bytes = parse_bytes(args.bucket_bytes, "--bucket-bytes")
    bucket_sizes = [bucket_bytes, *(parse_bytes(b, "--bucket-sweep") for b in args.bucket_sweep)]
    if args.rows_json:
        Path(args.rows_json).write_text(json.dumps(measure_here(args.receivers, args.repeats, bucket_sizes)))
        return

    rows: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    if not args.no_loopback:
        rows += measure_here(args.receivers, args.repeats, bucket_sizes)
        for r in rows:
            report(r)
    for gbit in args.link_gbit:
        for delay in args.link_delay_us:
            link = Link(gbit, delay)
            measured = measure_on_link(link, args)
            if isinstance(measured, str):
                print(f"[{link.describe()}] skipped: {measured}", flush=True)
                skipped.append({"link_gbit": gbit, "link_delay_us": delay, "reason": measured})
                continue
            for r in measured:
                report(r)
            rows += measured
    if not rows:
        raise SystemExit("nothing was measured: every link was skipped and --no-loopback was given")
    path = write_json(args.results, {"bucket_bytes": bucket_bytes, "repeats": args.repeats, "targets": TARGETS,
                                    "link_targets": LINK_TARGETS, "rows": rows, "skipped": skipped})
    plot(rows, str(RESULTS / f"{args.results}.png"))
    print(f"wrote {path} and {RESULTS / args.results}.png")


if __name__ == "__main__":
    main()
