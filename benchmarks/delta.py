"""Delta versions vs whole versions, side by side, on a real RL-like update: what changes, what crosses
the wire, how long a sync takes, on plain loopback and on emulated 1 and 8 gbit/s links.

Three regimes, each a ~300 MB model (as sent) trained for ``--steps`` steps with AdamW on next-token
loss over random tokens (seeded, so every run trains the same trajectory):
  - ``bf16_lr1e-6``:  bfloat16 parameters, lr 1e-6 (the regime PULSE and verl's delta sync target);
  - ``fp32_master_bf16_lr1e-6``: fp32 master weights, a bfloat16 copy sent, lr 1e-6;
  - ``dense_fp32_lr1e-3``: fp32 parameters, lr 1e-3: nearly every element changes, ``auto`` must
    send whole versions and cost no more than ``delta: off``.
Each regime is trained once (the versions are stored as the changes between them), then replayed
in one process per link (``asyncsync.netns``: a private network namespace whose loopback is shaped
to R gbit/s; every byte to the server crosses it). Per link and regime, four lanes, each a
``WeightSync`` with a reference server of its own (``transport: collective``, 64 MiB buckets):
blocking and async, ``delta: auto`` and ``delta: off``, each step's version published to the auto
lanes and, at sampled steps, to the off lanes (a whole version costs the same at every step; the
dense regime's lanes all sample every 2nd step), lanes one after another. Sync time is wall time from ``publish`` until the server serves the version.
Every lane first takes the initial weights twice (warm-up: the server allocates its two buffer sets).

Per row (a mode and a sparse regime; the contract keys of the issue):
  ``density``          changed elements / all elements of the version sent, median over steps
  ``bytes_ratio``      bytes broadcast by ``auto`` / the version's bytes, median over steps
  ``time_ratio_1gbit`` / ``time_ratio_8gbit`` (and ``time_ratio_loopback``): the median auto sync
                       over the median off sync of the same run
  ``dense_time_ratio`` the same in the dense regime, for the row's mode, the worst of the links
and per step everything behind them, with each step's trainer-side encode time (``encode_s``).
``break_even``: a synthetic sweep (the bf16 model's buckets with a given fraction of elements
changed, deltas forced) of blocking sync time with deltas vs whole, per link: where deltas stop
paying, on which ``asyncsync.packing.delta.MAX_FRACTION`` is based.

    python -m benchmarks.delta [--steps 20] [--links 1 8] [--no-loopback]
Writes benchmarks/results/delta.{json,png}. CPU-heavy: run it once, on as quiet a machine as you have.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from asyncsync.packing.delta import MAX_FRACTION
from asyncsync import netns
from benchmarks.common import save

STEPS = 20
OFF_EVERY = 4        # off lanes publish every 4th step, plus the first
DENSE_EVERY = 2      # every lane of the dense regime publishes every 2nd step, plus the first
BUCKET_BYTES = "64MiB"
SEQ_LEN = 32
TARGETS = {"bytes_ratio": 0.05, "time_ratio_1gbit": 0.2, "time_ratio_8gbit": 0.5, "dense_time_ratio": 1.05}
SWEEP_DENSITIES = (0.005, 0.02, 0.05, 0.1, 0.2, 0.35, 0.5)
SWEEP_REPEATS = 3
LINK_RUN_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class Regime:
    name: str
    model: dict[str, Any]   # ModelConfig fields of the trained model (its dtype: the parameters')
    lr: float
    sent: str               # dtype of the version sent (and of the servers' model)


SPARSE = dict(family="qwen2", vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_layers=8,
              num_heads=16, num_kv_heads=4, seed=0)   # 156 M parameters: 311 MB in bfloat16
DENSE = dict(family="qwen2", vocab_size=32000, hidden_size=768, intermediate_size=2048, num_layers=4,
             num_heads=12, num_kv_heads=4, seed=0)    # 74 M parameters: 296 MB in float32
REGIMES = (
    Regime("bf16_lr1e-6", {**SPARSE, "dtype": "bfloat16"}, 1e-6, "bfloat16"),
    Regime("fp32_master_bf16_lr1e-6", {**SPARSE, "dtype": "float32"}, 1e-6, "bfloat16"),
    Regime("dense_fp32_lr1e-3", {**DENSE, "dtype": "float32"}, 1e-3, "float32"),
)


def shrink() -> None:
    """``--tiny``: the same regimes on small models, to check the benchmark in seconds."""
    global REGIMES, SWEEP_DENSITIES
    small = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)
    REGIMES = tuple(Regime(r.name, {**r.model, **small}, r.lr, r.sent) for r in REGIMES)
    SWEEP_DENSITIES = (0.02, 0.3)


# -- training, once: the versions sent, stored as the changes between them ------------------------

def train(regime: Regime, steps: int, folder: Path) -> dict[str, Any]:
    """Train ``regime`` for ``steps`` AdamW steps; store the initial version sent (``v0.pt``) and each
    step's changes to it (``step{k}.pt``: per tensor its changed flat indices and new values, or the
    whole tensor where most changed). Returns each step's density, loss and seconds."""
    from asyncsync.models import ModelConfig, build_model

    torch.manual_seed(0)
    model = build_model(ModelConfig(**regime.model))
    sent_dtype = getattr(torch, regime.sent)
    opt = torch.optim.AdamW(model.parameters(), lr=regime.lr)
    tokens = torch.Generator().manual_seed(1)

    def sent() -> dict[str, torch.Tensor]:
        return {n: t.detach().to(sent_dtype).clone() for n, t in model.state_dict().items()}

    prev = sent()
    torch.save(prev, folder / "v0.pt")
    out: dict[str, Any] = {"density": [], "loss": [], "step_s": [],
                           "params": sum(p.numel() for p in model.parameters()),
                           "nbytes": sum(t.nbytes for t in prev.values())}
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        ids = torch.randint(0, regime.model["vocab_size"], (1, SEQ_LEN), generator=tokens)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        cur = sent()
        patch, changed, total = {}, 0, 0
        for name, new in cur.items():
            diff = (new.view(-1).view(torch.int16 if new.element_size() == 2 else torch.int32)
                    != prev[name].view(-1).view(torch.int16 if new.element_size() == 2 else torch.int32))
            n = int(diff.sum())
            changed, total = changed + n, total + diff.numel()
            if n > diff.numel() // 2:
                patch[name] = ("whole", new)
            elif n:
                idx = diff.nonzero().view(-1)
                patch[name] = ("sparse", idx, new.view(-1)[idx].clone())
        torch.save(patch, folder / f"step{step}.pt")
        prev = cur
        out["density"].append(changed / total)
        out["loss"].append(float(loss.detach()))
        out["step_s"].append(time.perf_counter() - t0)
        print(f"  {regime.name} step {step}: loss {out['loss'][-1]:.4f}, density {changed / total:.4%}, "
              f"{out['step_s'][-1]:.1f}s", flush=True)
    return out


def apply_patch(weights: dict[str, torch.Tensor], patch: dict[str, Any]) -> None:
    for name, change in patch.items():
        if change[0] == "whole":
            weights[name].copy_(change[1])
        else:
            weights[name].view(-1)[change[1]] = change[2]


# -- one link: every regime's lanes, replayed -----------------------------------------------------

@dataclass
class Lane:
    mode: str    # blocking | async
    delta: str   # auto | off
    sync: Any
    url: str
    version: int = 0

    @property
    def name(self) -> str:
        return f"{self.mode}_{self.delta}"

    def publish(self, weights: dict[str, torch.Tensor]) -> dict[str, Any]:
        """One version; its wall time until the server serves it, and what the sync reported."""
        self.version += 1
        t0 = time.perf_counter()
        if self.mode == "blocking":
            result = self.sync.publish(weights, self.version)
        else:
            self.sync.publish(weights, self.version)
            if not self.sync.wait_for_fresh_servers(self.version + self.sync.config.max_staleness, timeout=300):
                raise RuntimeError(f"{self.name}: version {self.version} not served within 300 s")
            for _ in range(10_000):  # the sender records its result just after the server answered
                if self.sync.metrics.last is not None and self.sync.metrics.last.version == self.version:
                    break
                time.sleep(0.001)
            result = self.sync.metrics.last
        elapsed = time.perf_counter() - t0
        if result is None or result.server_versions != {self.url: self.version}:
            raise RuntimeError(f"{self.name}: version {self.version} failed: {result and result.failures}")
        encode = result.pack_s if self.mode == "blocking" else result.snapshot_s
        return {"time_s": elapsed, "wire_bytes": result.wire_bytes, "nbytes": result.nbytes,
                "delta_base": result.delta_base, "delta_buckets": result.delta_buckets, "encode_s": encode}

    def settle(self) -> None:
        """Before the weights change: async mode's snapshot of the last version is taken."""
        self.sync.wait_snapshot()


def run_link(folder: Path, regimes: list[str], steps: int, out_path: Path, sweep: bool) -> None:
    """Inside one link (or plain loopback): every regime's four lanes over the stored versions."""
    from asyncsync import WeightSync, WeightSyncConfig
    from asyncsync.models import ModelConfig, build_model
    from asyncsync.launch.reference import ServerProcess, running

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(2)
    results: dict[str, Any] = {"regimes": {}}
    for regime in (r for r in REGIMES if r.name in regimes):
        server_cfg = ModelConfig(**{**regime.model, "dtype": regime.sent})
        lanes_spec = [(m, d) for m in ("blocking", "async") for d in ("auto", "off")]
        weights = torch.load(folder / regime.name / "v0.pt")
        with running([ServerProcess(build_model, (server_cfg,), start_timeout_s=600) for _ in lanes_spec]) as servers:
            lanes = []
            try:
                for (mode, delta), server in zip(lanes_spec, servers):
                    cfg = WeightSyncConfig.from_dict({
                        "servers": [server.url], "transport": "collective", "bucket_bytes": BUCKET_BYTES,
                        "async_weight_update": mode == "async", "delta": delta, "max_staleness": 0,
                        "deadlines": {"collective_s": 600, "http_s": 600, "broadcast_floor_s": 60}})
                    sync = WeightSync(cfg)
                    sync.connect(weights)
                    lanes.append(Lane(mode, delta, sync, server.url))
                for lane in lanes:  # warm-up: both of the server's buffer sets, and the baseline
                    for _ in range(2):
                        lane.publish(weights)
                        lane.settle()
                per_lane: dict[str, list[dict[str, Any]]] = {lane.name: [] for lane in lanes}
                dense = regime.name.startswith("dense")
                for step in range(1, steps + 1):
                    apply_patch(weights, torch.load(folder / regime.name / f"step{step}.pt"))
                    every = DENSE_EVERY if dense else OFF_EVERY
                    sampled = step == 1 or step % every == 0
                    order = lanes[step % len(lanes):] + lanes[: step % len(lanes)]  # spread the machine's drift
                    for lane in order:
                        if (lane.delta == "off" or dense) and not sampled:
                            continue
                        per_lane[lane.name].append({"step": step, **lane.publish(weights)})
                    for lane in lanes:
                        lane.settle()
                    print(f"  {regime.name} step {step}: " + ", ".join(
                        f"{n} {r[-1]['time_s']:.3f}s" for n, r in per_lane.items() if r and r[-1]["step"] == step),
                        flush=True)
                results["regimes"][regime.name] = per_lane
                if sweep and regime.name == "bf16_lr1e-6":
                    results["break_even"] = break_even(lanes, weights)
            finally:
                for lane in lanes:
                    lane.sync.close()
    out_path.write_text(json.dumps(results))


def break_even(lanes: list[Lane], weights: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    """Blocking sync time with deltas forced (any size) vs whole, for versions with a given fraction of
    their elements changed: versions alternate between two states, so each delta has that density."""
    from asyncsync.packing import delta as packing_delta
    from asyncsync.trainer import delta as trainer_delta

    auto = next(lane for lane in lanes if lane.name == "blocking_auto")
    off = next(lane for lane in lanes if lane.name == "blocking_off")
    saved = packing_delta.MAX_FRACTION, trainer_delta.PAYS_BELOW
    packing_delta.MAX_FRACTION, trainer_delta.PAYS_BELOW = 1.0, 2.0  # deltas at every density
    rows = []
    try:
        for k, density in enumerate(SWEEP_DENSITIES):
            def flip() -> None:  # the lowest bit of the chosen bfloat16 elements, in place: twice restores
                g = torch.Generator().manual_seed(k)
                for t in weights.values():
                    words = t.view(-1).view(torch.int16)
                    words[torch.rand(words.numel(), generator=g) < density] ^= 1

            times: dict[str, list[float]] = {"delta": [], "whole": []}
            ratios = []
            for rep in range(2 * SWEEP_REPEATS):
                auto.settle()
                off.settle()
                flip()  # odd repetitions flip back: every delta has this density
                a = auto.publish(weights)
                times["delta"].append(a["time_s"])
                ratios.append(a["wire_bytes"] / a["nbytes"])
                if rep % 2 == 0:
                    times["whole"].append(off.publish(weights)["time_s"])
            rows.append({"density": density, "bytes_ratio": statistics.median(ratios[1:]),
                         "delta_s": statistics.median(times["delta"][1:]), "whole_s": statistics.median(times["whole"])})
            print(f"  break-even sweep: density {density:.3f}: bytes {rows[-1]['bytes_ratio']:.3f}, delta "
                  f"{rows[-1]['delta_s']:.3f}s vs whole {rows[-1]['whole_s']:.3f}s", flush=True)
    finally:
        packing_delta.MAX_FRACTION, trainer_delta.PAYS_BELOW = saved
    return rows


# -- the whole run ----------------------------------------------------------------------------------

def summarize(trained: dict[str, Any], links: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Rows per (mode, sparse regime) with the issue's keys, from every link's lanes."""

    def median(values: list[float]) -> float | None:
        return statistics.median(values) if values else None

    def ratio(link: str, regime: str, mode: str) -> float | None:
        lanes = links.get(link, {}).get("regimes", {}).get(regime)
        if not lanes:
            return None
        auto = median([r["time_s"] for r in lanes[f"{mode}_auto"]])
        off = median([r["time_s"] for r in lanes[f"{mode}_off"]])
        return auto / off if auto and off else None

    rows = []
    dense = "dense_fp32_lr1e-3"
    for mode in ("blocking", "async"):
        dense_ratios = [r for r in (ratio(link, dense, mode) for link in links) if r is not None]
        for regime in ("bf16_lr1e-6", "fp32_master_bf16_lr1e-6"):
            if regime not in trained:
                continue
            any_link = next((l for l in links.values() if regime in l.get("regimes", {})), None)
            auto = any_link["regimes"][regime][f"{mode}_auto"] if any_link else []
            rows.append({
                "mode": mode, "regime": regime,
                "density": median(trained[regime]["density"]),
                "bytes_ratio": median([r["wire_bytes"] / r["nbytes"] for r in auto]),
                "time_ratio_loopback": ratio("loopback", regime, mode),
                "time_ratio_1gbit": ratio("1gbit", regime, mode),
                "time_ratio_8gbit": ratio("8gbit", regime, mode),
                "dense_time_ratio": max(dense_ratios) if dense_ratios else None,
                "encode_s": median([r["encode_s"] for r in auto]),
                "whole_pack_s": median([r["encode_s"] for r in any_link["regimes"][regime][f"{mode}_off"]]) if any_link else None,
            })
    return {"rows": rows, "dense": {link: {mode: ratio(link, dense, mode) for mode in ("blocking", "async")}
                                    for link in links}}


def plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    ax = axes[0]
    for name, t in results["trained"].items():
        ax.plot(range(1, len(t["density"]) + 1), [100 * d for d in t["density"]], marker="o", ms=3, label=name)
    ax.set_yscale("log")
    ax.set_xlabel("training step")
    ax.set_ylabel("elements changed (%)")
    ax.set_title("density per step")
    ax.legend(fontsize=7)
    ax = axes[1]
    links = [link for link in ("loopback", "1gbit", "8gbit") if link in results["links"]]
    width = 0.8 / max(1, len(results["summary"]["rows"]))
    for i, row in enumerate(results["summary"]["rows"]):
        values = [row.get(f"time_ratio_{link}") or 0 for link in links]
        ax.bar([x + i * width for x in range(len(links))], values, width, label=f"{row['mode']} {row['regime']}")
    for j, link in enumerate(links):
        for mode_i, mode in enumerate(("blocking", "async")):
            dense = results["summary"]["dense"].get(link, {}).get(mode)
            if dense:
                ax.plot([j + (2 * mode_i + 0.5) * width], [dense], "kx")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks([x + 1.5 * width for x in range(len(links))], links)
    ax.set_ylabel("delta: auto sync time / delta: off")
    ax.set_title("sync time ratio (x: dense regime)")
    ax.legend(fontsize=7)
    ax = axes[2]
    for link, data in results["links"].items():
        sweep = data.get("break_even")
        if sweep:
            ax.plot([100 * r["density"] for r in sweep], [r["delta_s"] / r["whole_s"] for r in sweep], marker="o",
                    label=link)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("elements changed (%)")
    ax.set_ylabel("delta sync time / whole (blocking)")
    ax.set_title("break-even (deltas forced)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--links", type=float, nargs="*", default=[1.0, 8.0], help="emulated link rates, gbit/s")
    parser.add_argument("--no-loopback", action="store_true")
    parser.add_argument("--regimes", nargs="*", default=[r.name for r in REGIMES])
    parser.add_argument("--tiny", action="store_true",
                        help="a smoke run with small models and 3 steps: checks the benchmark, writes no results")
    parser.add_argument("--replay", help=argparse.SUPPRESS)  # inside a link: the stored versions' folder
    parser.add_argument("--train", help=argparse.SUPPRESS)   # one regime, in a process of its own
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--sweep", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tiny:
        shrink()
        args.steps = 3
    torch.set_num_threads(2)
    if args.replay:
        run_link(Path(args.replay), args.regimes, args.steps, Path(args.out), args.sweep)
        return
    if args.train:
        regime = next(r for r in REGIMES if r.name == args.train)
        Path(args.out).write_text(json.dumps(train(regime, args.steps, Path(args.out).parent)))
        return
    tiny = ["--tiny"] if args.tiny else []
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="asyncsync-delta-") as tmp:
        folder = Path(tmp)
        trained = {}
        for regime in (r for r in REGIMES if r.name in args.regimes):
            print(f"training {regime.name} for {args.steps} steps", flush=True)
            (folder / regime.name).mkdir()
            # Each regime trains in a process of its own, whose memory is gone when it ends.
            stats = folder / regime.name / "trained.json"
            subprocess.run([sys.executable, "-m", "benchmarks.delta", "--train", regime.name, "--out", str(stats),
                            "--steps", str(args.steps), *tiny], check=True, timeout=LINK_RUN_TIMEOUT_S)
            trained[regime.name] = json.loads(stats.read_text())
        links: dict[str, dict[str, Any]] = {}
        skipped: dict[str, str] = {}
        runs = ([] if args.no_loopback else [("loopback", None)]) + [(f"{g:g}gbit", g) for g in args.links]
        for label, gbit in runs:
            out = folder / f"{label}.json"
            argv = [sys.executable, "-m", "benchmarks.delta", "--replay", str(folder), "--out", str(out),
                    "--steps", str(args.steps), "--regimes", *args.regimes, "--sweep", *tiny]
            print(f"replaying on {label}", flush=True)
            if gbit is None:
                subprocess.run(argv, check=True, timeout=LINK_RUN_TIMEOUT_S)
            else:
                done = netns.run(netns.Link(gbit), argv, timeout_s=LINK_RUN_TIMEOUT_S)
                if done.skipped is not None:
                    skipped[label] = done.skipped
                    continue
                if done.returncode:
                    raise SystemExit(f"the {label} run failed with exit code {done.returncode}")
            links[label] = json.loads(out.read_text())
    results = {
        "command": "python -m benchmarks.delta " + " ".join(sys.argv[1:]),
        "load_average_1_5_15": {"before": load_before, "after": os.getloadavg()},  # the machine's other work
        "note": ("measured on this project's 2-core machine; ratios come from lanes run one after another in "
                 "the same process, so they saw the same load"),
        "regimes": {r.name: {"model": r.model, "lr": r.lr, "sent": r.sent} for r in REGIMES if r.name in trained},
        "steps": args.steps, "bucket_bytes": BUCKET_BYTES, "off_lanes_every": OFF_EVERY, "dense_lanes_every": DENSE_EVERY,
        "max_fraction": MAX_FRACTION, "targets": TARGETS,
        "trained": trained, "links": links, "skipped": skipped,
    }
    results["summary"] = summarize(trained, links)
    results["rows"] = results["summary"]["rows"]
    if args.tiny:
        print(json.dumps(results["summary"], indent=1))
        return
    save("delta", results, plot)
    for row in results["rows"]:
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()})


if __name__ == "__main__":
    main()
