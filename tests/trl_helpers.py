"""What the TRL tests share: the tiny model vLLM serves, a GRPO run of it with asyncsync, and the
logprobs of a token sequence as the server and as a transformers model compute them."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Sequence
from typing import Any

import torch

from asyncsync.models import ModelConfig, build_model, word_tokenizer

# head_dim 64 (vLLM's CPU attention rejects small heads), float32 (bfloat16 crashed the CPU worker).
MODEL = ModelConfig(family="qwen2", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                    num_kv_heads=4)
FIXED = [3, 14, 15, 92, 65, 35, 7, 8, 9, 10, 11, 12]  # a prompt and a fixed completion, scored after each step
TOLERANCE = 1e-5
SERVER_ARGS = ["--logprobs-mode", "processed_logprobs"]  # what TRL's importance-sampling correction asks for


def weight_sync(overrides: dict[str, Any], urls: Sequence[str] = ()) -> dict[str, Any]:
    servers = {"servers": [{"url": u, "kind": "vllm"} for u in urls]} if urls else {}
    return {"bucket_bytes": "1MiB", "backend": "gloo", **servers, **overrides}


def reward_even(completion_ids: list[list[int]], **_: Any) -> list[float]:
    """The share of even token ids: any signal that makes GRPO move the weights."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def trainer(servers: str | Sequence[str], sync: dict[str, Any], steps: int, out_dir: str, batch: int = 8,
            peft: bool = False, callbacks: Sequence[Any] = (), **config: Any) -> Any:
    """TRL's GRPOTrainer with asyncsync (``sync``: weight_sync keys) on the tiny model, generating
    from ``servers`` (the first is TRL's ``vllm_server_base_url``)."""
    from datasets import Dataset
    from trl import GRPOConfig

    from asyncsync.integrations.trl import GRPOTrainer

    urls = [servers] if isinstance(servers, str) else list(servers)
    prompts = [" ".join(f"t{(i * 7 + j) % 500 + 3}" for j in range(6)) for i in range(256)]
    args = GRPOConfig(output_dir=out_dir, use_vllm=True, vllm_mode="server", vllm_server_base_url=urls[0],
                      per_device_train_batch_size=batch, num_generations=4, max_completion_length=8, max_steps=steps,
                      learning_rate=1e-2, logging_steps=1, report_to=[], save_strategy="no", bf16=False, use_cpu=True,
                      seed=0, vllm_server_timeout=60, **config)
    return GRPOTrainer(model=build_model(MODEL).train(), reward_funcs=reward_even, args=args,
                       train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=word_tokenizer(MODEL.vocab_size),
                       peft_config=lora() if peft else None, callbacks=list(callbacks),
                       weight_sync=weight_sync(sync, urls if len(urls) > 1 else ()))


def lora() -> Any:
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


def scratch(peft: bool = False) -> torch.nn.Module:
    """A model of the trainer's structure to load a copy of its weights into and score with (a deep
    copy of the trainer's model would keep the forward accelerate wrapped around the original)."""
    model = build_model(MODEL)
    if peft:
        from peft import get_peft_model

        model = get_peft_model(model, lora())
    return model.eval()


def _json(url: str, body: Any = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def served_version(url: str) -> int:
    version = _json(f"{url}/weight_info")["weight_version"]
    return 0 if version in (None, "default") else int(version)


def served_logprobs(url: str, ids: list[int]) -> tuple[list[float], int]:
    """The server's logprob of each token of ``ids`` after the first, and the version that computed
    them (read before and after; asked again when a new version came in between)."""
    for _ in range(20):
        before = served_version(url)
        choice = _json(f"{url}/v1/completions", {"prompt": [ids], "max_tokens": 1, "prompt_logprobs": 0,
                                                  "temperature": 1.0})["choices"][0]
        if served_version(url) == before:
            return [entry[str(t)]["logprob"] for t, entry in zip(ids[1:], choice["prompt_logprobs"][1:])], before
    raise AssertionError(f"{url} kept switching versions while it scored a sequence")


@torch.no_grad()
def model_logprobs(model: torch.nn.Module, ids: Sequence[int], start: int = 1) -> list[float]:
    """``model``'s logprob of each token of ``ids`` from position ``start`` on."""
    was_training = model.training
    model.eval()
    try:
        logits = model(input_ids=torch.tensor([list(ids)])).logits.float()[0]
    finally:
        model.train(was_training)
    logps = torch.log_softmax(logits[:-1], dim=-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return logps[start - 1:].tolist()


def largest_gap(a: Sequence[float], b: Sequence[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) for x, y in zip(a, b))


def checkpoint(model_dir: Any) -> None:
    """The tiny model as vLLM loads it (``save_pretrained``), identical to ``build_model(MODEL)``."""
    build_model(MODEL).save_pretrained(model_dir)
