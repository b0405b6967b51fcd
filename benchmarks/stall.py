"""Generation stall per sync: how long a server stops generating while a new version arrives.

For each server kind (the reference server; a real vLLM server when a vLLM environment is found) and
each of its receive modes, one server runs under a steady, bounded generation load from a separate
process (``--concurrency`` clients, each sending one short request after another over loopback:
streaming completions on vLLM, whose every token's arrival is recorded; whole responses on the
reference server, which does not stream). The trainer (this process) first lets the load run
without syncs, then publishes a version every ``--interval-s`` seconds (blocking mode, gloo).

Per row, from the arrival times of all clients together (a "gap" is the time between two
consecutive arrivals, tokens or responses):

* ``transfer_s``: the sync's time on the wire (``SyncResult.wire_s``), median over the syncs;
* ``stall_s``: the longest gap overlapping a sync (from publish to return) minus the same statistic
  without syncs (the median, over windows of the sync's length slid across the no-sync period, of
  the longest gap overlapping the window); median over the syncs (``stall_max_s``: the largest);
* ``switch_s``: how long the server held generation to switch versions (``SyncResult.switch_s``:
  the reference server times its swap, the vLLM client the calls during which vLLM's engine was
  held), median;
* ``stall_vs_transfer``: ``stall_s / transfer_s``;
* ``latency_s``: request latency p50 / p99 without and with syncs.

    python -m benchmarks.stall [--syncs 6] [--interval-s 3] [--vllm-python .venv-vllm/bin/python]

Writes benchmarks/results/stall.{json,png}. The vLLM rows run a stock vLLM server from the
environment of ``--vllm-python`` (default: ``$ASYNCSYNC_VLLM_PYTHON``, else the repository's
``.venv-vllm`` that scripts/test_vllm.sh builds) with this checkout's asyncsync first on its path;
where that interpreter is missing or cannot import vllm, the rows say why instead.
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import multiprocessing as mp
import os
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from asyncsync import WeightSync
from asyncsync.models import ModelConfig, build_model
from asyncsync.protocol.background import lower_thread_priority
from asyncsync.launch.reference import ServerProcess
from asyncsync.launch.vllm import VllmServer
from asyncsync import netns
from benchmarks.common import RESULTS, ROOT, vllm_python, write_json

log = logging.getLogger("benchmarks.stall")

# 428 MB of float32 weights: a sync long enough to see, a decode step of tens of ms on one core.
# head_dim 64: vLLM's CPU attention rejects small heads.
MODEL = ModelConfig(family="qwen2", vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_layers=8,
                    num_heads=16, num_kv_heads=4, max_position_embeddings=512, dtype="float32", seed=0)
PROMPT_TOKENS = 16
REQUEST_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Load:
    """The generation load: ``concurrency`` clients, each sending requests of ``tokens`` new tokens."""

    url: str
    kind: str  # "reference" (whole responses) or "vllm" (streamed tokens)
    concurrency: int
    tokens: int
    model: str = ""  # vLLM's served model name


def _client(load: Load, seed: int, stop: threading.Event, out: list[dict[str, Any]]) -> None:
    """One client: requests back to back until ``stop``; each record has its send time, every
    token's (or the response's) arrival time and its end (time.monotonic, comparable across processes)."""
    rng = random.Random(seed)
    host, port = load.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=REQUEST_TIMEOUT_S)
    while not stop.is_set():
        prompt = [rng.randrange(2, MODEL.vocab_size) for _ in range(PROMPT_TOKENS)]
        sent = time.monotonic()
        try:
            arrivals = list(_request(conn, load, prompt))
        except (OSError, http.client.HTTPException, ValueError) as e:
            out.append({"sent": sent, "error": repr(e), "done": time.monotonic()})
            conn.close()
            conn = http.client.HTTPConnection(host, int(port), timeout=REQUEST_TIMEOUT_S)
            time.sleep(0.2)
            continue
        out.append({"sent": sent, "arrivals": arrivals, "done": time.monotonic()})
    conn.close()


def _request(conn: http.client.HTTPConnection, load: Load, prompt: list[int]) -> Iterator[float]:
    headers = {"Content-Type": "application/json"}
    if load.kind == "reference":
        conn.request("POST", "/generate", json.dumps({"prompt": prompt, "max_new_tokens": load.tokens}), headers)
        resp = conn.getresponse()
        body = resp.read()
        if resp.status != 200:
            raise ValueError(f"HTTP {resp.status}: {body[:200]!r}")
        yield time.monotonic()
        return
    body = {"model": load.model, "prompt": prompt, "max_tokens": load.tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    conn.request("POST", "/v1/completions", json.dumps(body), headers)
    resp = conn.getresponse()
    if resp.status != 200:
        raise ValueError(f"HTTP {resp.status}: {resp.read()[:200]!r}")
    while line := resp.readline():
        text = line.decode().strip()
        if not text.startswith("data:") or text == "data: [DONE]":
            continue
        now = time.monotonic()
        for choice in json.loads(text[5:])["choices"]:
            for _ in choice.get("token_ids") or ():
                yield now


def _run_load(load: Load, stop: Any, results: Any) -> None:
    """The load process: ``concurrency`` client threads until ``stop`` is set, then every record."""
    torch.set_num_threads(1)
    records: list[dict[str, Any]] = []
    halt = threading.Event()
    threads = [threading.Thread(target=_client, args=(load, i, halt, records), daemon=True) for i in range(load.concurrency)]
    for t in threads:
        t.start()
    stop.wait()
    halt.set()
    for t in threads:
        t.join(REQUEST_TIMEOUT_S)
    results.put(records)


class LoadProcess:
    """``_run_load`` in a spawned process (so the trainer's threads never delay a recorded arrival)."""

    def __init__(self, load: Load):
        ctx = mp.get_context("spawn")
        self._stop, self._results = ctx.Event(), ctx.Queue()
        self._process = ctx.Process(target=_run_load, args=(load, self._stop, self._results), daemon=True)

    def __enter__(self) -> LoadProcess:
        self._process.start()
        return self

    def records(self) -> list[dict[str, Any]]:
        self._stop.set()
        records = self._results.get(timeout=REQUEST_TIMEOUT_S + 30)
        self._process.join(30)
        return records

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._process.is_alive():
            self._process.join(REQUEST_TIMEOUT_S + 30)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(10)


# -- analysis ---------------------------------------------------------------------------------------

Gap = tuple[float, float]


def gaps_of(records: list[dict[str, Any]]) -> list[Gap]:
    times = sorted(t for r in records for t in r.get("arrivals", ()))
    return list(zip(times, times[1:]))


def longest_gap(gaps: list[Gap], lo: float, hi: float) -> float:
    """The longest gap overlapping [lo, hi]."""
    return max((b - a for a, b in gaps if b > lo and a < hi), default=0.0)


def typical_longest_gap(gaps: list[Gap], lo: float, hi: float, length: float, step_s: float = 0.05) -> float:
    """The median, over windows of ``length`` slid across [lo, hi], of the longest gap overlapping one."""
    starts = [lo + i * step_s for i in range(max(1, int((hi - lo - length) / step_s)))]
    return statistics.median(longest_gap(gaps, s, s + length) for s in starts)


def percentiles(values: list[float]) -> dict[str, float | None]:
    if len(values) < 2:
        return {"p50": values[0] if values else None, "p99": values[0] if values else None, "n": len(values)}
    q = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": statistics.median(values), "p99": q[98], "n": len(values)}


def analyse(records: list[dict[str, Any]], quiet: tuple[float, float], busy: tuple[float, float],
            syncs: list[dict[str, Any]]) -> dict[str, Any]:
    gaps = gaps_of(records)
    for s in syncs:
        s["longest_gap_s"] = longest_gap(gaps, s["t0"], s["t1"])
        s["baseline_gap_s"] = typical_longest_gap(gaps, *quiet, s["t1"] - s["t0"])
        s["stall_s"] = s["longest_gap_s"] - s["baseline_gap_s"]
    ok = [s for s in syncs if s["ok"]]
    transfer = statistics.median(s["wire_s"] for s in ok) if ok else None
    stall = statistics.median(s["stall_s"] for s in ok) if ok else None
    switches = [s["switch_s"] for s in ok if s["switch_s"] is not None]

    def latencies(lo: float, hi: float) -> list[float]:
        return [r["done"] - r["sent"] for r in records if "arrivals" in r and lo <= r["sent"] and r["done"] <= hi]

    return {
        "transfer_s": transfer,
        "stall_s": stall,
        "stall_max_s": max((s["stall_s"] for s in ok), default=None),
        "switch_s": statistics.median(switches) if switches else None,
        "stall_vs_transfer": stall / transfer if stall is not None and transfer else None,
        "latency_s": {"without_syncs": percentiles(latencies(*quiet)), "with_syncs": percentiles(latencies(*busy))},
        "syncs_ok": len(ok), "syncs": len(syncs),
        "errors": sum(1 for r in records if "error" in r),
        "typical_gap_s": statistics.median(b - a for a, b in gaps) if gaps else None,
    }


# -- one row: a server under load, no syncs, then syncs -----------------------------------------------

def run_row(server: str, receive: str, url: str, load: Load, args: argparse.Namespace) -> dict[str, Any]:
    """The load process starts from this thread; the trainer runs on a thread of lower CPU priority
    (see ``trainer_thread``)."""
    with LoadProcess(load) as loader:
        quiet, busy, syncs, model_bytes = trainer_thread(drive_syncs, server, receive, url, args)
        records = loader.records()
    row = {"server": server, "receive": receive, "model_bytes": model_bytes, "concurrency": load.concurrency,
           "tokens_per_request": load.tokens, **analyse(records, quiet, busy, syncs)}
    origin = quiet[0]
    row["timeline"] = {
        "arrivals": [round(t - origin, 4) for r in records for t in r.get("arrivals", ()) if t >= origin],
        "syncs": [[round(s["t0"] - origin, 4), round(s["t1"] - origin, 4), s["switch_s"]] for s in syncs],
        "quiet": [0.0, round(quiet[1] - origin, 4)],
    }
    row["per_sync"] = [{k: v for k, v in s.items() if k not in ("t0", "t1")} for s in syncs]
    return row


def trainer_thread(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` on a thread at background CPU priority, which the threads it starts (the sync's
    control loop, its data-plane threads) inherit. On this 2-core machine the trainer packs and sends
    on the cores the server generates on; a real trainer does that on its own machine. Lowering its
    priority keeps its CPU work from being counted as the server's stall (the server lowers its own
    receive's priority the same way); the transfer then takes what generation leaves."""
    box: dict[str, Any] = {}

    def run() -> None:
        lower_thread_priority()
        try:
            box["result"] = fn(*args)
        except BaseException as e:
            box["error"] = e

    thread = threading.Thread(target=run, name="trainer")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


def drive_syncs(server: str, receive: str, url: str, args: argparse.Namespace) -> tuple[Any, ...]:
    """Warm-up syncs, ``quiet_s`` without syncs, then a sync every ``interval_s``."""
    model = build_model(MODEL)
    cfg = {"servers": [{"url": url, "kind": server, "receive": receive}], "bucket_bytes": args.bucket_bytes,
           "backend": "gloo", "transport": "collective"}  # a transfer on the data plane (a link too), not shared memory
    with WeightSync.from_config(cfg) as sync:
        sync.connect(model)
        version = max(sync.server_versions.values())
        norm = model.model.norm.weight
        syncs: list[dict[str, Any]] = []

        def publish() -> dict[str, Any]:
            nonlocal version
            version += 1
            with torch.no_grad():
                norm.mul_(1.0001)  # every version differs; a change cheap enough to stay outside the window
            t0 = time.monotonic()
            result = sync.publish(model, version)
            t1 = time.monotonic()
            assert result is not None
            return {"version": version, "t0": t0, "t1": t1, "wire_s": result.wire_s, "total_s": result.total_s,
                    "switch_s": result.switch_s.get(url), "ok": url in result.server_versions,
                    "failure": result.failures.get(url)}

        for _ in range(args.warmup_syncs):  # first versions: deadlines not yet paced, caches cold
            publish()
        time.sleep(args.warmup_s)
        quiet = (time.monotonic(), time.monotonic() + args.quiet_s)
        time.sleep(args.quiet_s)
        busy_start = time.monotonic()
        for i in range(args.syncs):
            time.sleep(max(0.0, busy_start + (i + 0.5) * args.interval_s - time.monotonic()))
            syncs.append(publish())
            log.info("%s/%s sync %d: %s", server, receive, i + 1,
                     {k: round(v, 3) if isinstance(v, float) else v for k, v in syncs[-1].items() if k not in ("t0", "t1")})
        time.sleep(max(0.0, busy_start + args.syncs * args.interval_s - time.monotonic()))
        busy = (busy_start, time.monotonic())
    return quiet, busy, syncs, sum(p.numel() * p.element_size() for p in model.parameters())


def reference_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    with ServerProcess(build_model, (MODEL,)) as server:
        load = Load(server.url, "reference", args.concurrency, args.reference_tokens)
        return [run_row("reference", "background", server.url, load, args)]


def vllm_rows(args: argparse.Namespace, python: str) -> tuple[list[dict[str, Any]], list[str]]:
    """Both receive modes against one vLLM server (the mode travels with each update); also the
    worker's asyncsync log lines (load times)."""
    with tempfile.TemporaryDirectory(prefix="asyncsync-stall-") as tmp:
        model_dir = Path(tmp) / "model"
        build_model(MODEL).save_pretrained(model_dir)
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)  # this checkout's asyncsync
        server = VllmServer(model_dir, Path(tmp) / "vllm.log", python=python, env={"PYTHONPATH": path})
        try:
            log.info("vLLM healthy after %.1fs", server.wait_healthy())
            load = Load(server.url, "vllm", args.concurrency, args.vllm_tokens, str(model_dir))
            rows = [run_row("vllm", receive, server.url, load, args) for receive in ("in_rpc", "background")]
            return rows, [line for line in server.log_tail(4000).splitlines() if "asyncsync" in line][-60:]
        finally:
            server.stop()


# -- output ----------------------------------------------------------------------------------------

def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if "timeline" in r]
    fig, axes = plt.subplots(len(shown), 1, figsize=(12, 2.6 * len(shown)), squeeze=False)
    for ax, row in zip(axes[:, 0], shown):
        times = sorted(row["timeline"]["arrivals"])
        gaps = [(b, 1e3 * (b - a)) for a, b in zip(times, times[1:])]
        ax.scatter([t for t, _ in gaps], [g for _, g in gaps], s=4, color="tab:blue", label="gap before an arrival")
        for i, (t0, t1, switch) in enumerate(row["timeline"]["syncs"]):
            ax.axvspan(t0, t1, color="tab:orange", alpha=0.25, label="sync (publish to return)" if i == 0 else None)
        ax.axvspan(*row["timeline"]["quiet"], color="tab:green", alpha=0.08, label="no syncs")
        ax.set_ylabel("gap (ms)")
        ax.set_title(f"{row['server']} / receive {row['receive']}: stall {1e3 * (row['stall_s'] or 0):.0f} ms, "
                     f"transfer {1e3 * (row['transfer_s'] or 0):.0f} ms, switch {1e3 * (row['switch_s'] or 0):.0f} ms",
                     fontsize=10)
        ax.legend(loc="upper left", fontsize=7)
    axes[-1, 0].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def summary(row: dict[str, Any]) -> str:
    """One line per row, as printed at the end of a run."""
    if "skipped" in row:
        return f"{row['server']:9s} {row['skipped']}"
    lat = row["latency_s"]
    return (f"{row['server']:9s} {row['receive']:10s} transfer {row['transfer_s']:.3f}s  stall {row['stall_s']:.3f}s "
            f"(max {row['stall_max_s']:.3f})  switch {row['switch_s'] or 0:.3f}s  stall/transfer "
            f"{row['stall_vs_transfer']:.2f}  latency p50/p99 {lat['without_syncs']['p50']:.3f}/{lat['without_syncs']['p99']:.3f}s "
            f"without syncs, {lat['with_syncs']['p50']:.3f}/{lat['with_syncs']['p99']:.3f}s with  ({row['syncs_ok']}/{row['syncs']} syncs)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--syncs", type=int, default=6)
    parser.add_argument("--interval-s", type=float, default=3.0)
    parser.add_argument("--quiet-s", type=float, default=12.0, help="load without syncs before the first sync")
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--warmup-syncs", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--reference-tokens", type=int, default=1,
                        help="new tokens per reference request (1: each response is one generation step)")
    parser.add_argument("--vllm-tokens", type=int, default=20, help="new tokens per streamed vLLM request")
    parser.add_argument("--bucket-bytes", default="64MiB")
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument("--skip", choices=["reference", "vllm"], action="append", default=[])
    parser.add_argument("--link-gbit", type=float, help="run on an emulated link of this rate (asyncsync.netns): "
                                                        "writes stall_link.{json,png}")
    parser.add_argument("--on-link", action="store_true", help=argparse.SUPPRESS)  # already inside the namespace
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    netns.rerun_on_link("benchmarks.stall", args.link_gbit, args.on_link)
    name = "stall_link" if args.link_gbit else "stall"
    torch.set_num_threads(1)

    rows: list[dict[str, Any]] = []
    worker_log: list[str] = []
    if "reference" not in args.skip:
        rows += reference_rows(args)
    if "vllm" not in args.skip:
        python, why = vllm_python(args.vllm_python)
        if python is None:
            log.warning("%s", why)
            rows.append({"server": "vllm", "skipped": why})
        else:
            vllm, worker_log = vllm_rows(args, python)
            rows += vllm
    for row in rows:
        print(summary(row))
    settings = {k: v for k, v in vars(args).items() if k not in ("vllm_python", "on_link")}
    out = write_json(name, {"model": MODEL.to_dict(), "settings": settings, "link_gbit": args.link_gbit, "rows": rows,
                            "vllm_worker_log": worker_log})
    plot(rows, RESULTS / f"{name}.png")
    print(f"wrote {out} and {RESULTS / f'{name}.png'}")


if __name__ == "__main__":
    main()
