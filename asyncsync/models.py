"""Small causal LMs built from a config (transformers' Qwen2 or Llama classes), never downloaded.

The trainer's policy and the reference server's model come from the same ``ModelConfig`` and seed, so
they start bit-identical; ``generate`` is the one decoding loop both sides use.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from asyncsync.config import ConfigError, from_mapping
from asyncsync.protocol.specs import dtype_from_name

FAMILIES = ("qwen2", "llama", "qwen2_moe")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a small causal LM. ``head_dim = hidden_size / num_heads`` (vLLM's CPU attention needs >= 32)."""

    family: str = "qwen2"
    vocab_size: int = 256
    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = False
    dtype: str = "float32"
    seed: int = 0
    # qwen2_moe only: many parameters, few FLOPs per token, the shape where a sync weighs most.
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ConfigError(f"family: {self.family!r} is not one of {list(FAMILIES)}")
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                  "max_position_embeddings", "num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"{f}: expected a positive integer, got {v!r}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ConfigError("hidden_size: must divide by num_heads, and num_heads by num_kv_heads")
        try:
            dtype_from_name(self.dtype)
        except ValueError as e:
            raise ConfigError(f"dtype: {e}") from None

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None, prefix: str = "model.") -> ModelConfig:
        return from_mapping(cls, data or {}, prefix)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def hf_config(self) -> Any:
        common = dict(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads, max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings, bos_token_id=0, eos_token_id=1, pad_token_id=0,
        )
        if self.family == "qwen2":
            from transformers import Qwen2Config

            return Qwen2Config(**common)
        if self.family == "qwen2_moe":
            from transformers import Qwen2MoeConfig

            return Qwen2MoeConfig(
                **common, num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size, shared_expert_intermediate_size=self.moe_intermediate_size,
                decoder_sparse_step=1,
            )
        from transformers import LlamaConfig

        return LlamaConfig(**common)


def build_model(cfg: ModelConfig) -> torch.nn.Module:
    """A randomly initialised model, identical for identical configs (seeded, CPU, eval mode)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(cfg.seed)
    hf = cfg.hf_config()
    hf._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(hf)
    return model.to(dtype_from_name(cfg.dtype)).eval()


@torch.no_grad()
def generate(
    model: torch.nn.Module, prompt: list[int], max_new_tokens: int, n: int = 1,
    temperature: float = 0.0, generator: torch.Generator | None = None,
) -> list[list[int]]:
    """``n`` completions of one prompt (greedy at temperature 0), decoded with the model's KV cache."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt] * n, dtype=torch.long, device=device)
    key = cache_argument(model)
    out = model(input_ids=ids, use_cache=True)
    past, completions = out[key], []
    logits = out.logits[:, -1, :]
    for _ in range(max_new_tokens):
        if temperature > 0:
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            token = torch.multinomial(probs, 1, generator=generator)
        else:
            token = logits.argmax(dim=-1, keepdim=True)
        completions.append(token)
        if len(completions) == max_new_tokens:
            break
        out = model(input_ids=token, use_cache=True, **{key: past})
        past, logits = out[key], out.logits[:, -1, :]
    if not completions:
        return [[] for _ in range(n)]
    return torch.cat(completions, dim=1).tolist()


@torch.no_grad()
def score(model: torch.nn.Module, tokens: list[int]) -> list[float]:
    """The log-probability of each of ``tokens[1:]`` given the tokens before it, in float64: one forward
    of the model (a transformers causal LM; a sharded one called on every rank, as its forward needs),
    in eval mode and without gradients, whatever mode the caller holds it in (``evaluating``): what an
    engine computes, deterministic where training mode is not (dropout, PhiMoE's sampled routing).
    What the served check (``verify``) compares between the trainer and its servers."""
    device = next(model.parameters()).device
    with evaluating(model):
        logits = model(input_ids=torch.tensor([tokens], dtype=torch.long, device=device)).logits
    if hasattr(logits, "full_tensor"):  # a DTensor (a tensor-parallel head)
        logits = logits.full_tensor()
    logprobs = torch.log_softmax(logits[0, :-1].double(), dim=-1)
    return logprobs.gather(1, torch.tensor(tokens[1:], device=logprobs.device)[:, None])[:, 0].tolist()


@contextmanager
def evaluating(model: torch.nn.Module) -> Iterator[None]:
    """``model`` in eval mode inside, and every one of its modules back in the mode it was in after
    (each flag as it was: a trainer may hold some modules in eval mode, frozen, and the rest training).
    Only the modes change, on this rank alone (no collective: a sharded module's ranks each call it)."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        model.train(modes[0][1])  # through train(), as the caller set it (a module's own train() runs)
        for module, training in modes:  # then the flags that were otherwise
            module.training = training


def cache_argument(model: torch.nn.Module) -> str:
    """The name transformers gives the KV cache in ``forward`` and its outputs: ``cache`` from 5.20 on
    (``past_key_values`` is deprecated there, with a warning at every call), ``past_key_values`` before."""
    forward = getattr(model, "forward", None)
    return "cache" if forward is not None and "cache" in inspect.signature(forward).parameters else "past_key_values"


def word_tokenizer(vocab_size: int) -> Any:
    """A tokenizer built locally for a model of ``vocab_size`` (no download): token ``i`` is the word
    ``t{i}``, words split on whitespace; 0 is padding (and BOS), 1 is EOS, as in ``hf_config``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", bos_token="t0", eos_token="t1", unk_token="t2")
