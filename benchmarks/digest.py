"""What the trainer's digests cost (``digest: on``): the hash's rate per core, and a whole version's time
at 8 gbit/s with and without them, in one run.

  - ``hash_gbps``: GB/s of one thread over a 64 MiB buffer in host memory, for the CRC32C every
    version already pays (the ``crc32c`` package) and for the digests' BLAKE3 (the ``blake3``
    package, what ``protocol/digest.py`` runs), with BLAKE2b-256 and SHA-256 (``hashlib``, no
    dependency) for comparison; ``blake3_2_threads``: two threads hashing two buffers at once (the GIL
    is freed), what the trainer's two hashers can use.
  - ``version_s``: a blocking ``publish`` of the same ~315 MB bfloat16 model (``benchmarks/broadcast.py``'s
    Qwen2-0.5B-at-half-width) to one reference server, every version whole (``delta: off``), digests
    off and on in alternate rounds, inside a network namespace whose loopback is shaped to
    ``--link-gbit`` (8 gbit/s: ``asyncsync.netns``). Medians; ``digest_cost`` is on over off.
Writes benchmarks/results/digest.{json,png}.

    python -m benchmarks.digest [--repeats 5] [--link-gbit 8]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import blake3
import crc32c
import torch

from asyncsync import WeightSync, WeightSyncConfig, netns
from asyncsync.launch.reference import ServerProcess, running
from asyncsync.models import build_model
from asyncsync.netns import Link
from benchmarks.broadcast import QWEN2_05B_HALF
from benchmarks.common import save

BUFFER_BYTES = 64 << 20
RUN_TIMEOUT_S = 1800


def rate(fn: Any, buffers: list[memoryview], rounds: int = 5) -> float:
    """GB/s of ``fn`` over each of ``buffers`` at once (one thread each), best of ``rounds``."""
    best = float("inf")
    for _ in range(rounds):
        threads = [threading.Thread(target=fn, args=(b,)) for b in buffers]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        best = min(best, time.perf_counter() - t0)
    return sum(len(b) for b in buffers) / best / 1e9


def hash_rates() -> dict[str, float]:
    data = [memoryview(torch.randint(0, 256, (BUFFER_BYTES,), dtype=torch.uint8).numpy()) for _ in range(2)]
    ours = lambda b: blake3.blake3(b).digest()  # noqa: E731 - what protocol/digest.py runs
    return {"crc32c": rate(crc32c.crc32c, data[:1]), "blake3": rate(ours, data[:1]),
            "blake2b": rate(lambda b: hashlib.blake2b(b, digest_size=32).digest(), data[:1]),
            "sha256": rate(lambda b: hashlib.sha256(b).digest(), data[:1]), "blake3_2_threads": rate(ours, data)}


def version_times(repeats: int) -> dict[str, Any]:
    """Seconds per whole version, digests off and on in alternate rounds (here: on the caller's link),
    each mode with a server of its own (one trainer session per server) sharing the one link."""
    model = build_model(QWEN2_05B_HALF)
    modes = ("off", "on")
    times: dict[str, list[float]] = {m: [] for m in modes}
    servers = {m: ServerProcess(build_model, (QWEN2_05B_HALF,), start_timeout_s=300) for m in modes}
    with running(list(servers.values())), ExitStack() as stack:
        syncs = {m: stack.enter_context(WeightSync(WeightSyncConfig.from_dict({
            "servers": [servers[m].url], "delta": "off", "transport": "collective", "digest": m}))) for m in modes}
        for sync in syncs.values():
            sync.connect(model)
        for version in range(1, repeats + 2):  # the first round warms each server's buffers and pages
            for m, sync in syncs.items():
                t0 = time.perf_counter()
                result = sync.publish(model, version)
                assert result is not None and result.server_versions == {servers[m].url: version}, result
                if version > 1:
                    times[m].append(time.perf_counter() - t0)
    nbytes = sum(t.nbytes for t in model.state_dict().values())
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    return {"nbytes": nbytes, "off_s": off, "on_s": on, "digest_cost": on / off, "rounds": times}


def plot(results: dict[str, Any], path: str) -> None:
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    rates = results["hash_gbps"]
    a.bar(list(rates), list(rates.values()), color=["#888", "#3a7", "#a73", "#a73", "#3a7"])
    a.set_ylabel("GB/s")
    a.set_title("hash rate, host memory")
    v = results.get("version_s")
    if v:
        b.bar(["digest off", "digest on"], [v["off_s"], v["on_s"]], color=["#888", "#3a7"])
        b.set_ylabel("seconds per whole version")
        b.set_title(f"{v['nbytes'] / 1e6:.0f} MB at {results['link_gbit']:g} gbit/s: x{v['digest_cost']:.3f}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--link-gbit", type=float, default=8.0)
    parser.add_argument("--inside-json", help=argparse.SUPPRESS)  # the run inside the shaped namespace
    args = parser.parse_args()
    if args.inside_json:
        Path(args.inside_json).write_text(json.dumps(version_times(args.repeats)))
        return
    results: dict[str, Any] = {"hash_gbps": hash_rates(), "link_gbit": args.link_gbit}
    print("hash GB/s per core:", {k: round(x, 2) for k, x in results["hash_gbps"].items()})
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "version.json"
        done = netns.run(Link(args.link_gbit), [sys.executable, "-m", "benchmarks.digest", "--repeats",
                                                str(args.repeats), "--inside-json", str(out)], timeout_s=RUN_TIMEOUT_S)
        if done.skipped is not None:
            results["skipped"] = done.skipped
        elif done.returncode != 0:
            raise SystemExit(f"the run on a {args.link_gbit:g} gbit/s link exited with code {done.returncode}")
        else:
            results["version_s"] = json.loads(out.read_text())
            v = results["version_s"]
            print(f"whole version, {v['nbytes'] / 1e6:.0f} MB at {args.link_gbit:g} gbit/s: digest off "
                  f"{v['off_s']:.3f} s, on {v['on_s']:.3f} s (x{v['digest_cost']:.3f})")
    save("digest", results, plot)


if __name__ == "__main__":
    main()
