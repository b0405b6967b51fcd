"""Tiny transformers models of the families vLLM serves, built from configs (nothing is downloaded):
the real-vLLM model tests, the family sweep (``tests/test_vllm_models.py``) and ``benchmarks/verify.py``.

Each is saved with ``save_pretrained`` as a server's checkpoint (``save``, its config as the published
checkpoint's where transformers writes another) and loaded by the trainer with ``from_pretrained``
(``load``), as users hold them: transformers 5 keeps a MoE's experts fused in memory.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

# head_dim 64 (vLLM's CPU attention rejects small heads), float32 (bfloat16 crashed the CPU worker).
COMMON = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=4, max_position_embeddings=512, bos_token_id=0, eos_token_id=1, pad_token_id=0)


FAMILIES = ("qwen2", "llama_tied", "qwen2_moe", "qwen3_moe", "mixtral", "phimoe", "granitemoe", "olmoe", "deepseek_v2",
            "deepseek_v3")


def build(family: str) -> torch.nn.Module:
    """``family``'s tiny model, randomly initialised with seed 0 (the same weights every time)."""
    import transformers as tf

    torch.manual_seed(0)
    if family == "qwen2_moe":
        return tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2,
                                                          moe_intermediate_size=128, shared_expert_intermediate_size=128))
    if family == "qwen3_moe":
        return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2,
                                                          moe_intermediate_size=128, head_dim=64))
    if family == "mixtral":
        return tf.MixtralForCausalLM(tf.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2))
    if family == "deepseek_v3":  # vLLM's CPU MLA takes DeepSeek's own head sizes (qk 128 + 64, kv rank 512)
        cfg = tf.DeepseekV3Config(**COMMON, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                                  n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=96,
                                  qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, n_group=1, topk_group=1)
        cfg.topk_method = "noaux_tc"  # vLLM creates e_score_correction_bias only for this routing
        cfg.scoring_func = "sigmoid"  # what transformers computes; vLLM reads it (default softmax), as published configs have it
        return tf.DeepseekV3ForCausalLM(cfg)
    if family == "deepseek_v2":  # DeepSeek-V2-Lite's shape: MLA without a q projection rank, greedy routing
        cfg = tf.DeepseekV2Config(**COMMON, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                                  n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None,
                                  qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, n_group=1, topk_group=1)
        cfg.scoring_func = "softmax"  # what transformers' DeepSeek-V2 computes, as published configs say
        return tf.DeepseekV2ForCausalLM(cfg)
    if family == "phimoe":  # a tiny Phi-3.5-MoE: attention and lm_head biases, as the published checkpoint has them
        return tf.PhimoeForCausalLM(tf.PhimoeConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2,
                                                    attention_bias=True, lm_head_bias=True))
    if family == "granitemoe":
        return tf.GraniteMoeForCausalLM(tf.GraniteMoeConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2))
    if family == "olmoe":
        return tf.OlmoeForCausalLM(tf.OlmoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2))
    if family == "llama_tied":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**COMMON, tie_word_embeddings=True))
    if family == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**COMMON))
    raise ValueError(f"{family!r} is not one of {list(FAMILIES)}")


# The architecture names the published checkpoints carry, where transformers saves another: vLLM picks
# its model by this name (PhiMoE's "PhimoeForCausalLM" would get vLLM's generic Transformers backend).
PUBLISHED_ARCHITECTURES = {"phimoe": "PhiMoEForCausalLM"}


# The vLLM arguments a family's float32 tiny model needs on any CPU: vLLM picks its AMX MLA kernels where
# the CPU has AMX, and they refuse float32 weights at load ("expect weight to be bfloat16, float16,
# ..."); its reference CPU MLA takes them everywhere.
VLLM_ARGS = {"deepseek_v2": ("--attention-backend", "CPU_MLA"), "deepseek_v3": ("--attention-backend", "CPU_MLA")}


def save(family: str, model_dir: Path) -> None:
    """``family``'s tiny model saved with ``save_pretrained``, its config as the published checkpoint's."""
    build(family).save_pretrained(model_dir)
    if family in PUBLISHED_ARCHITECTURES:
        config = json.loads((model_dir / "config.json").read_text())
        config["architectures"] = [PUBLISHED_ARCHITECTURES[family]]
        (model_dir / "config.json").write_text(json.dumps(config))


def load(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    return model.eval()
