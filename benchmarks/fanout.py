"""One version to N servers, each on a host with its own link: what the trainer's link pays per server.

On an emulated cluster (``asyncsync.cluster``: a network namespace per host, each host's link shaped
to ``--link-gbit`` in both directions) a trainer host and 8 server hosts run reference servers of a
model of at least 100 MB. For N = 1, 2, 4, 8 the trainer publishes blocking versions to the first N
servers and measures, per version, the time until every server serves it (``version_s``) and the
bytes that left the trainer's link (``trainer_bytes``, its interface's transmit counter, so TCP/IP
framing is included). Every server is checked to serve the trainer's bytes (a digest of its weights).

Paths, measured one after the other in one run over the same servers:

* ``direct`` (``fanout: direct``): one data-plane group over the trainer and every server. gloo's
  broadcast in such a group is a binomial tree: the root sends ceil(log2(world)) copies and the
  receivers forward to each other, a whole buffer per step, unpipelined and unverified per hop, so
  both figures grow as log2(N + 1).
* ``relay`` (``fanout: auto``): the trainer sends one copy to the first server; each server forwards
  every bucket down the planned tree as it lands and verifies every bucket itself
  (``protocol/relay.py``); with these bucket counts ``auto`` plans a chain.

Last, one more relayed version to the 8 servers with the chain's second server killed (SIGKILL) a
third of the way in: ``kill`` (its ``version_s``, ``extra_s`` over a version, how many servers
below it were ``repaired``: sent the version again), every other server checked to serve it.

Writes benchmarks/results/fanout.{json,png}; keys per path and N: ``version_s``, ``trainer_bytes``;
per path: ``time_ratio_8_to_1`` (version time at N = 8 over N = 1) and ``trainer_bytes_ratio`` (the
most bytes that left the trainer's link per version, at any N, over the version's bytes). Skipped,
saying why, where no cluster can be made (not root, no ``ip``).

    python -m benchmarks.fanout [--link-gbit 1] [--versions 3] [--servers 1 2 4 8] [--bucket-mib 4]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from asyncsync import cluster
from asyncsync.cluster import Cluster
from asyncsync.netns import Link

log = logging.getLogger("benchmarks.fanout")

# Qwen2 in float32, 105 MB: large enough that a version is bound by the link, small enough that 8 servers
# (each holding it twice: live and staged) fit this machine's memory. Its largest tensors (3 MB) fit a
# bucket: a relay forwards a bucket once it landed whole, so each hop adds the largest bucket's time.
MODEL = {"family": "qwen2", "vocab_size": 2048, "hidden_size": 512, "intermediate_size": 1536, "num_layers": 8,
         "num_heads": 8, "num_kv_heads": 2, "seed": 3}
PORT = 8000
TARGETS = {"relay": {"time_ratio_8_to_1": 1.5, "trainer_bytes_ratio": 1.1}}
FANOUT = {"direct": "direct", "relay": "auto"}  # each path's config


def trainer_side(urls: list[str], address: str, versions: int, fanout: str, bucket_mib: int,
                 victim_pid: int | None = None) -> dict[str, Any]:
    """Inside the trainer's namespace: ``versions`` blocking versions to ``urls``, each timed and counted.
    With ``victim_pid`` (the server process of ``urls[1]``: interior in a chain), one version more, the
    victim killed with SIGKILL a third of a version in: its time, and whether every other server serves it."""
    import os
    import signal
    import threading

    import torch

    from asyncsync import WeightSync, WeightSyncConfig
    from asyncsync.launch.http import wait_healthy
    from asyncsync.models import ModelConfig, build_model

    for url in urls:
        wait_healthy(url, 300, f"the server at {url}")
    model = build_model(ModelConfig.from_dict(dict(MODEL)))
    version_bytes = sum(t.nbytes for t in model.state_dict().values())
    cfg = WeightSyncConfig.from_dict({"servers": urls, "transport": "collective", "delta": "off", "fanout": fanout,
                                      "master_addr": address, "bucket_bytes": f"{bucket_mib}MiB"})
    tx = Path("/sys/class/net/eth0/statistics/tx_bytes")
    times, sent = [], []
    with WeightSync(cfg) as sync:
        sync.connect(model)
        start = max(sync.server_versions.values(), default=0)
        for v in range(start + 1, start + 1 + versions):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1e-3)
            before, t0 = int(tx.read_text()), time.perf_counter()
            result = sync.publish(model, v)
            times.append(time.perf_counter() - t0)
            sent.append(int(tx.read_text()) - before)
            assert result is not None and not result.failures, result and result.failures
        check_served(urls, model, start + versions)
        row = {"version_s": statistics.median(times), "trainer_bytes": max(sent), "version_bytes": version_bytes,
               "all_version_s": times, "all_trainer_bytes": sent}
        if victim_pid is not None:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1e-3)
            after = row["version_s"] / 3
            killer = threading.Timer(after, os.kill, (victim_pid, signal.SIGKILL))
            t0 = time.perf_counter()
            killer.start()
            result = sync.publish(model, start + versions + 1)
            killed_s = time.perf_counter() - t0
            killer.join()
            assert result is not None and set(result.failures) == {urls[1]}, result and result.failures
            check_served([u for u in urls if u != urls[1]], model, start + versions + 1)
            row["kill"] = {"killed": urls[1], "after_s": after, "version_s": killed_s,
                           "extra_s": killed_s - row["version_s"], "repaired": len(result.repaired)}
    return row


def check_served(urls: list[str], model: Any, version: int) -> None:
    """Every server serves ``version`` with exactly the trainer's bytes."""
    from asyncsync.launch.http import http_call
    from asyncsync.receivers.reference.receiver import tensor_bytes

    want = {n: hashlib.sha256(tensor_bytes(t)).hexdigest() for n, t in model.state_dict().items()}
    for url in urls:
        answer = http_call(url, "GET", "/weights/digest")[1]
        assert answer["version"] == version, (url, answer["version"])
        common = want.keys() & answer["digest"].keys()
        assert common and all(answer["digest"][n] == want[n] for n in common), f"{url} serves other bytes"


def run(link_gbit: float, versions: int, counts: list[int], bucket_mib: int) -> dict[str, Any]:
    hosts = {"trainer": Link(link_gbit), **{f"s{i}": Link(link_gbit) for i in range(max(counts))}}
    out: dict[str, Any] = {"link_gbit": link_gbit, "model": MODEL, "versions": versions, "bucket_mib": bucket_mib,
                           "paths": {path: {} for path in FANOUT}, "targets": TARGETS}
    with tempfile.TemporaryDirectory() as tmp, Cluster(hosts) as c:
        model_yaml = Path(tmp) / "model.yaml"
        model_yaml.write_text(yaml.safe_dump({"model": MODEL}))
        servers = [c.popen(h, [sys.executable, "-m", "asyncsync.cli", "--log-level", "WARNING", "serve", "--host",
                                c.address(h), "--port", str(PORT), "--model-config", str(model_yaml)])
                   for h in hosts if h != "trainer"]
        try:
            for n in counts:
                for path, fanout in FANOUT.items():
                    urls = [f"http://{c.address(f's{i}')}:{PORT}" for i in range(n)]
                    result = Path(tmp) / f"{path}-{n}.json"
                    # The last run of all kills the chain's second server once its versions are timed.
                    victim = servers[1].pid if path == "relay" and n == counts[-1] and n > 2 else None
                    args = json.dumps([urls, c.address("trainer"), versions, fanout, bucket_mib, victim, str(result)])
                    done = c.popen("trainer", [sys.executable, "-m", "benchmarks.fanout", "--trainer-side", args])
                    if done.wait(900) != 0:
                        raise RuntimeError(f"the trainer's {path} run to {n} server(s) failed (exit code {done.returncode})")
                    row = json.loads(result.read_text())
                    out["paths"][path][str(n)] = row
                    log.info("%s to %d server(s): %.2f s per version, %.0f MB left the trainer's link", path, n,
                             row["version_s"], row["trainer_bytes"] / 1e6)
        finally:
            for p in servers:
                p.kill()
                p.wait()
    for path, rows in out["paths"].items():
        first, last = rows.get("1"), rows.get(str(max(counts)))
        rows_bytes = [r["trainer_bytes"] / r["version_bytes"] for r in rows.values()]
        out["paths"][path] = {**rows, "time_ratio_8_to_1": last["version_s"] / first["version_s"] if first and last else None,
                              "trainer_bytes_ratio": max(rows_bytes)}
    out["kill"] = next((row["kill"] for row in out["paths"]["relay"].values() if isinstance(row, dict) and "kill" in row), None)
    out["targets_met"] = {path: all(out["paths"][path][k] is not None and out["paths"][path][k] <= limit
                                     for k, limit in targets.items()) for path, targets in TARGETS.items()}
    return out


def plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name, rows in results["paths"].items():
        ns = sorted(int(k) for k in rows if k.isdigit())
        left.plot(ns, [rows[str(n)]["version_s"] for n in ns], marker="o", label=name)
        right.plot(ns, [rows[str(n)]["trainer_bytes"] / rows[str(n)]["version_bytes"] for n in ns], marker="o", label=name)
    left.set(xlabel="servers", ylabel="seconds per version", title=f"version time, {results['link_gbit']:g} gbit/s per host")
    right.set(xlabel="servers", ylabel="trainer bytes / version bytes", title="bytes out of the trainer's link")
    for ax in (left, right):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    from benchmarks.common import save

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--link-gbit", type=float, default=1.0)
    parser.add_argument("--versions", type=int, default=3)
    parser.add_argument("--servers", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--bucket-mib", type=int, default=4)
    parser.add_argument("--trainer-side", help=argparse.SUPPRESS)  # JSON: the trainer's run inside its namespace
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.trainer_side:
        *call, result = json.loads(args.trainer_side)
        Path(result).write_text(json.dumps(trainer_side(*call)))
        return
    why = cluster.unavailable()
    if why is not None:
        print(f"skipped: cannot emulate a cluster here: {why}")
        return
    save("fanout", run(args.link_gbit, args.versions, sorted(set(args.servers)), args.bucket_mib), plot)


if __name__ == "__main__":
    main()
