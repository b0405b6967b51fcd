"""An LM head's bias that a vLLM model loads but leaves out of its logits, put back in.

vLLM's ``LogitsProcessor`` adds a bias only when the model's ``compute_logits`` hands it one
(``embedding_bias``); it never reads ``lm_head.bias`` itself. A model that builds a biased head,
loads ``lm_head.bias`` and forgets to pass it computes logits without it, while transformers adds
it: vLLM 0.32's PhiMoE (``phimoe.py``: ``ParallelLMHead(..., bias=True)``, then
``self.logits_processor(self.lm_head, hidden_states)``). A checkpoint whose head bias is zero (a
model fresh from its config) decodes exactly, so nothing shows until a version changes the bias;
with a published Phi-3.5-MoE, whose bias is not zero, vLLM serves the checkpoint itself wrong
(seen here: a checkpoint with a random head bias decodes as transformers does with the bias
zeroed). The class: a parameter the engine loads and its forward never reads, so every version of
it is "loaded" and none is served.

``HeadBias.of(model)`` (a post-load fix, ``fixes.py``) asks the model's own ``compute_logits`` which bias it hands its logits
processor (the processor's ``forward`` replaced by a recorder for that one call: no kernel runs, no
collective is entered), and where the head has a bias and none was handed over, from then on hands
the processor the head's bias (its own vocabulary shard under tensor parallelism, as vLLM's GPT-J
passes it) whenever the model passes none. The processor then reads the head's bias at every call,
so it follows every version loaded in place and nothing is left to repair after a load. Models that
pass their bias, or have none, are left as they are.
"""

from __future__ import annotations

import logging
from collections.abc import Set
from typing import Any

import torch

log = logging.getLogger(__name__)


class HeadBias:
    """Whether a model's logits include its head's bias, and the fix where they do not."""

    @staticmethod
    def dropped(model: torch.nn.Module) -> bool:
        """True when ``model`` has an LM head with a bias that its ``compute_logits`` does not pass on."""
        head, processor = getattr(model, "lm_head", None), getattr(model, "logits_processor", None)
        bias = getattr(head, "bias", None)
        if not isinstance(bias, torch.Tensor) or processor is None or not hasattr(model, "compute_logits"):
            return False
        handed: list[Any] = []

        def record(lm_head: Any, hidden_states: torch.Tensor, embedding_bias: Any = None, *args: Any, **kwargs: Any) -> Any:
            handed.append(embedding_bias)
            return hidden_states

        weight = head.weight
        processor.forward = record  # an instance attribute: nn.Module.__call__ finds it first
        try:
            model.compute_logits(torch.zeros(1, weight.shape[-1], dtype=weight.dtype, device=weight.device))
        except Exception as e:  # a model whose logits need more than hidden states: leave it as it is
            log.debug("could not ask %s's compute_logits for its head bias: %s", type(model).__name__, e)
            return False
        finally:
            del processor.forward
        return bool(handed) and handed[0] is None

    @classmethod
    def of(cls, model: torch.nn.Module) -> HeadBias | None:
        """Where ``model`` drops its head's bias: the fix, installed (see ``__init__``); else None."""
        return cls(model) if cls.dropped(model) else None

    def __init__(self, model: torch.nn.Module):
        """Hand the head's bias to ``model``'s logits processor whenever the model passes none."""
        head, processor = model.lm_head, model.logits_processor
        forward = type(processor).forward

        def with_bias(lm_head: Any, hidden_states: torch.Tensor, embedding_bias: Any = None, *args: Any,
                      **kwargs: Any) -> Any:
            if embedding_bias is None and lm_head is head:
                embedding_bias = head.bias
            return forward(processor, lm_head, hidden_states, embedding_bias, *args, **kwargs)

        processor.forward = with_bias
        log.warning("asyncsync: %s loads lm_head.bias but computes its logits without it; the bias is added "
                    "(as transformers does)", type(model).__name__)

    def refusal(self) -> None:
        """Never: the bias is handed over from the start."""
        return None

    def repair(self, loaded: Set[str] | None) -> None:
        """Nothing: the processor reads the head's bias at every call, the one a load wrote in place."""
