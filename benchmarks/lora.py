"""LoRA training: bytes and sync time per version, the adapter alone (``lora: adapter``) vs merged weights.

    python -m benchmarks.lora [--versions 6] [--link-gbit 8]

A ~310 MB bfloat16 Qwen2 base (hidden 1024, 8 layers, vocabulary 32000, untied) under a PEFT LoRA
adapter of rank 16 on all seven projections (PEFT keeps the adapter in float32), two reference
servers built from the same config (they serve the base, so adapter mode, measured first, sends
none at connect), the data-plane collective (as between hosts: no shared filesystem), blocking
``publish``, both modes measured in the same run, one after the other. Per version: ``bytes`` (the version's buckets, each
broadcast to every server) and ``sync_s`` (``publish`` until every server serves the version:
merged, swapped in; adapter, received, written to tmpfs and loaded through the engine's own
``/v1/load_lora_adapter`` under ``<name>-v<N>``, older versions unloaded). ``--link-gbit R`` runs it
in a network namespace whose loopback is an emulated R gbit/s link (``asyncsync/netns.py``).
Writes benchmarks/results/lora.{json,png}.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from typing import Any

import torch

from asyncsync import WeightSync
from asyncsync.models import ModelConfig, build_model
from asyncsync.launch.reference import ServerProcess, running
from benchmarks.common import save
from asyncsync.netns import rerun_on_link

BASE = ModelConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_layers=8, num_heads=16,
                   num_kv_heads=4, dtype="bfloat16")
RANK = 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def policy() -> Any:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(build_model(BASE), LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS))


def step(model: torch.nn.Module, seed: int) -> None:
    """A training step's change: the adapter moves, the base is frozen."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.01)


def measure(urls: list[str], mode: str, versions: int, first: int) -> dict[str, Any]:
    model = policy()
    cfg = {"servers": urls, "lora": mode, "transport": "collective", "bucket_bytes": "64MiB", "lora_name": "bench"}
    with WeightSync.from_config(cfg) as sync:
        t0 = time.perf_counter()
        sync.connect(model)
        connect_s = time.perf_counter() - t0
        rows = []
        for v in range(first, first + versions):
            step(model, v)
            result = sync.publish(model, v)
            assert result is not None and not result.failures, result.failures
            rows.append({"version": v, "bytes": result.nbytes, "sync_s": result.total_s, "pack_s": result.pack_s,
                         "wire_s": result.wire_s, "apply_s": result.apply_s})
    steady = rows[1:] or rows  # the first version also warms the pace and the engines' first load
    return {"connect_s": connect_s, "bytes_per_version": rows[0]["bytes"], "buckets": len(sync.plan.buckets),
            "median_sync_s": statistics.median(r["sync_s"] for r in steady), "versions": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--versions", type=int, default=6)
    parser.add_argument("--link-gbit", type=float, default=None, help="run on an emulated link of this rate")
    parser.add_argument("--on-link", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    rerun_on_link("benchmarks.lora", args.link_gbit, args.on_link)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    base = policy()
    base_bytes = sum(t.numel() * t.element_size() for n, t in base.state_dict().items() if "lora_" not in n)
    adapter_bytes = sum(p.numel() * p.element_size() for n, p in base.named_parameters() if "lora_" in n)
    del base
    with running([ServerProcess(build_model, (BASE,), start_timeout_s=300) for _ in range(2)]) as servers:
        urls = [s.url for s in servers]
        adapter = measure(urls, "adapter", args.versions, 1)  # first: the servers still serve the base
        merged = measure(urls, "merged", args.versions, 1)
    results = {
        "base": {**BASE.to_dict(), "bytes": base_bytes}, "adapter_rank": RANK, "adapter_targets": TARGETS,
        "adapter_bytes": adapter_bytes, "servers": 2, "transport": "collective",
        "link": f"{args.link_gbit} gbit/s emulated" if args.link_gbit else "loopback",
        "note": "2 shared CPU cores (other engineers' work ran on them); blocking publish; the first version of "
                "each mode is left out of the medians (warm-up)",
        "merged": merged, "adapter": adapter,
        "bytes_ratio": merged["bytes_per_version"] / adapter["bytes_per_version"],
        "sync_ratio": merged["median_sync_s"] / adapter["median_sync_s"],
    }
    save("lora", results, plot)
    print(f"per version: merged {merged['bytes_per_version'] / 1e6:.1f} MB in {merged['median_sync_s'] * 1e3:.0f} ms, "
          f"adapter {adapter['bytes_per_version'] / 1e6:.2f} MB in {adapter['median_sync_s'] * 1e3:.0f} ms "
          f"({results['bytes_ratio']:.0f}x fewer bytes, {results['sync_ratio']:.1f}x faster)")


def plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    modes = ("merged", "adapter")
    left.bar(modes, [results[m]["bytes_per_version"] / 1e6 for m in modes], color=["tab:gray", "tab:blue"])
    left.set_yscale("log")
    left.set_ylabel("MB per version (each to every server)")
    left.set_title(f"bytes: {results['bytes_ratio']:.0f}x fewer")
    for m, color in zip(modes, ("tab:gray", "tab:blue")):
        rows = results[m]["versions"]
        right.plot([r["version"] for r in rows], [r["sync_s"] * 1e3 for r in rows], "o-", color=color, label=m)
    right.set_xlabel("version")
    right.set_ylabel("blocking publish, ms")
    right.set_title(f"sync time: {results['sync_ratio']:.1f}x faster ({results['link']})")
    right.legend()
    fig.suptitle(f"rank-{results['adapter_rank']} LoRA on a {results['base']['bytes'] / 1e6:.0f} MB base, 2 servers")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
