"""``receivers/vllm/head.py``: an LM head's bias that a model loads but leaves out of its logits is put
back in, through the logits processor's own ``embedding_bias``; a model that passes its bias, or has
none, is left as it is. The models here have vLLM's shape (``lm_head``, a ``logits_processor`` taking
``(lm_head, hidden_states, embedding_bias)``, ``compute_logits``); the real one is vLLM's PhiMoE in
``tests/test_vllm_models.py``."""

from __future__ import annotations

import torch

from asyncsync.receivers.vllm.head import HeadBias


class LogitsProcessor(torch.nn.Module):
    """vLLM's contract: adds a bias only when one is handed over."""

    def forward(self, lm_head: torch.nn.Module, hidden_states: torch.Tensor, embedding_bias: torch.Tensor | None = None):
        logits = hidden_states @ lm_head.weight.t()
        return logits if embedding_bias is None else logits + embedding_bias


class Model(torch.nn.Module):
    def __init__(self, bias: bool, passes_bias: bool):
        super().__init__()
        self.lm_head = torch.nn.Linear(8, 5, bias=bias)
        self.logits_processor = LogitsProcessor()
        self.passes_bias = passes_bias

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.passes_bias:
            return self.logits_processor(self.lm_head, hidden_states, self.lm_head.bias)
        return self.logits_processor(self.lm_head, hidden_states)  # PhiMoE's omission


def reference(model: Model, h: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(h, model.lm_head.weight, model.lm_head.bias)


def test_a_dropped_head_bias_is_added_and_follows_every_later_value():
    torch.manual_seed(0)
    model, h = Model(bias=True, passes_bias=False), torch.randn(3, 8)
    with torch.no_grad():
        model.lm_head.bias.normal_()
    assert HeadBias.dropped(model)
    assert not torch.allclose(model.compute_logits(h), reference(model, h)), "the omission is real"
    fix = HeadBias.of(model)
    assert fix is not None and fix.refusal() is None
    assert torch.equal(model.compute_logits(h), reference(model, h))
    with torch.no_grad():
        model.lm_head.bias.add_(1.0)  # a new version's bias, loaded in place
    fix.repair({"lm_head.bias"})  # nothing to repair: the processor reads the bias at every call
    assert torch.equal(model.compute_logits(h), reference(model, h))


def test_models_that_pass_their_bias_or_have_none_are_left_alone():
    torch.manual_seed(0)
    h = torch.randn(3, 8)
    for model in (Model(bias=True, passes_bias=True), Model(bias=False, passes_bias=False)):
        forward = model.logits_processor.forward
        assert HeadBias.of(model) is None
        assert model.logits_processor.forward == forward
        assert torch.equal(model.compute_logits(h), reference(model, h))
