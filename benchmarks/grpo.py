"""The main job, blocking vs async, in both regimes: benchmarks/results/grpo_compare.{json,png}.

    python -m benchmarks.grpo [--config configs/grpo_tiny.yaml] [--vllm] [KEY=VALUE ...]

The figures are the ones ``asyncsync grpo --compare --regimes host,link`` prints (``asyncsync.grpo.compare``:
one copy of the arithmetic): the demo's GRPO run with reference servers, blocking then async with the
same seed, on this host (shared memory) and on an emulated link of the config's ``link_gbit``
(a private network namespace, the collective transport). Keys other tools read: ``host_ratio``,
``link_ratio`` (async / blocking steps/s), ``sync_share_blocking`` (on the link: the time a blocking
sync holds the trainer / the blocking step), and ``link_gbit``. ``--vllm`` adds both regimes with
stock vLLM servers (``configs/grpo_vllm.yaml``; needs the vllm and bench extras in one environment): ``vllm_host_ratio``,
``vllm_link_ratio``, no target (vLLM on 2 CPU cores generates slowly).
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from asyncsync.grpo.compare import RegimeFigures, compare
from asyncsync.grpo.config import GRPOConfig
from benchmarks.common import save

TARGETS = {"link_ratio": 1.3, "host_ratio": 0.97}


def figures(config: str, overrides: list[str]) -> list[RegimeFigures]:
    return compare(GRPOConfig.load(config, overrides), ["host", "link"], progress=False, overrides=overrides,
                   config_path=config)


def plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(label, r) for label, key in (("reference", "regimes"), ("vLLM", "vllm_regimes")) for r in results.get(key, [])]
    fig, (bars, curves) = plt.subplots(1, 2, figsize=(13, 4.5))
    labels, width = [f"{label}\n{r['regime'].split(' (')[0]}" for label, r in runs], 0.38
    for i, mode in enumerate(("blocking", "async")):
        values = [next(m["steps_per_s"] for m in r["modes"] if m["mode"] == mode) for _, r in runs]
        bars.bar([x + (i - 0.5) * width for x in range(len(runs))], values, width, label=mode)
    for x, (_, r) in enumerate(runs):
        bars.annotate(f"{r['ratio']:.2f}x", (x, 0), textcoords="offset points", xytext=(0, 3), ha="center")
    bars.set_xticks(range(len(runs)), labels)
    bars.set_ylabel("steps/s")
    bars.set_title("GRPO demo: async / blocking throughput")
    bars.legend()
    for label, r in runs[:2]:
        for m in r["modes"]:
            curves.plot(m["rewards"], label=f"{label} {r['regime'].split(' (')[0]} {m['mode']}")
    curves.set_xlabel("step")
    curves.set_ylabel("mean reward")
    curves.set_title("reward (same seed)")
    curves.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/grpo_tiny.yaml")
    parser.add_argument("--vllm", action="store_true", help="also run both regimes with vLLM servers")
    parser.add_argument("--vllm-config", default="configs/grpo_vllm.yaml")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    results: dict[str, Any] = {"config": args.config, "overrides": args.overrides, "targets": TARGETS}
    host, link = figures(args.config, args.overrides)
    results.update(regimes=[host.as_dict(), link.as_dict()], host_ratio=host.ratio, link_ratio=link.ratio,
                   sync_share_blocking=link.sync_share_blocking, sync_share_blocking_host=host.sync_share_blocking,
                   link_gbit=GRPOConfig.load(args.config, args.overrides).link_gbit, link_regime=link.regime)
    for r in (host, link):
        print(r.line())
    if args.vllm:
        vhost, vlink = figures(args.vllm_config, args.overrides)
        results.update(vllm_regimes=[vhost.as_dict(), vlink.as_dict()], vllm_host_ratio=vhost.ratio,
                       vllm_link_ratio=vlink.ratio, vllm_sync_share_blocking=vlink.sync_share_blocking)
        for r in (vhost, vlink):
            print(f"vLLM {r.line()}")
    save("grpo_compare", results, plot)


if __name__ == "__main__":
    main()
