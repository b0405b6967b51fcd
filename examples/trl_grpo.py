"""GRPO with TRL's GRPOTrainer and asyncsync, on CPU, against a vLLM server this script starts.

    VENV=.venv-vllm EXTRAS=test,vllm,trl bash scripts/setup.sh
    .venv-vllm/bin/python examples/trl_grpo.py              # blocking sync (TRL's semantics)
    .venv-vllm/bin/python examples/trl_grpo.py --async      # the sync overlaps the next step

A tiny Qwen2 is built from a config and saved (nothing is downloaded), a stock vLLM server with
asyncsync's weight-transfer backend serves it, and TRL's GRPOTrainer learns to emit even token ids
(a word-level tokenizer built locally: token i is the word ``t{i}``). The only asyncsync lines are
the import of ``GRPOTrainer`` and its ``weight_sync`` argument. The server is stopped when the
script ends, fails, is interrupted (Ctrl-C) or terminated.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

from datasets import Dataset
from trl import GRPOConfig

from asyncsync.integrations.trl import GRPOTrainer
from asyncsync.models import ModelConfig, build_model, word_tokenizer
from asyncsync.launch.vllm import VllmServer

# head_dim 64 (vLLM's CPU attention needs >= 32), float32 (the CPU worker's safe dtype).
MODEL = ModelConfig(family="qwen2", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                    num_kv_heads=4)


def even_tokens(completion_ids: list[list[int]], **_: Any) -> list[float]:
    """The reward: the share of even token ids in a completion."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def train(url: str, out_dir: str, steps: int, async_update: bool) -> Any:
    prompts = [" ".join(f"t{(i * 7 + j) % 500 + 3}" for j in range(6)) for i in range(512)]
    args = GRPOConfig(output_dir=out_dir, use_vllm=True, vllm_mode="server", vllm_server_base_url=url,
                      per_device_train_batch_size=8, num_generations=4, max_completion_length=8, max_steps=steps,
                      learning_rate=5e-3, logging_steps=5, report_to=[], save_strategy="no", use_cpu=True, bf16=False)
    trainer = GRPOTrainer(model=build_model(MODEL).train(), reward_funcs=even_tokens, args=args,
                          train_dataset=Dataset.from_dict({"prompt": prompts}),
                          processing_class=word_tokenizer(MODEL.vocab_size),
                          weight_sync={"async_weight_update": async_update, "backend": "gloo"})
    trainer.train()
    return trainer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--async", dest="async_update", action="store_true", help="async_weight_update: true")
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the clean-up below on `kill` too
    with tempfile.TemporaryDirectory() as tmp:
        build_model(MODEL).save_pretrained(tmp)
        log = Path(tmp) / "vllm.log"
        with VllmServer(Path(tmp), log, python=sys.executable, args=["--logprobs-mode", "processed_logprobs"]) as server:
            print(f"starting vLLM at {server.url} (log: {log})", flush=True)
            server.wait_healthy()
            trainer = train(server.url, tmp, args.steps, args.async_update)
        logs = [h for h in trainer.state.log_history if "reward" in h]
        print(f"{'async' if args.async_update else 'blocking'} sync, {trainer.state.global_step} steps: reward "
              f"{logs[0]['reward']:.2f} -> {logs[-1]['reward']:.2f}; version lag (mean) "
              f"{logs[-1]['asyncsync/version_lag/mean']:.1f}; TRL's sampling logp difference "
              f"{logs[-1]['sampling/sampling_logp_difference/mean']:.2g}; "
              f"{trainer.state.log_history[-1]['train_steps_per_second']:.2f} steps/s")


if __name__ == "__main__":
    main()
