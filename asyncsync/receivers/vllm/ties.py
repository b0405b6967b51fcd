"""Tied modules in a vLLM model: keeping the post-load processing of every one of them current.

vLLM ties ``lm_head`` to ``model.embed_tokens`` by sharing one ``Parameter`` between two modules, each
with its own ``quant_method`` and the state that method derives from the weight. Its loader skips the
tied name, and the layerwise reload re-runs ``process_weights_after_loading`` only on the modules
that received a tensor (vLLM documents this: "tied parameters will only reflect processing from one
of the parent layers"). The skipped module's derived state then stays at its start-up weights while
the shared values move on: on CPU an unquantized ``lm_head`` computes its logits with a oneDNN copy
of the weight packed at start-up. On CUDA, ROCm and XPU an unquantized head has no derived state (its
processing is a no-op, and its GEMM reads the shared weight), so re-processing it changes nothing.

The rule this module implements (a post-load fix, ``fixes.py``): after a version is loaded, every
tied module that was not loaded itself has its processing re-run, in vLLM's "weights already
processed" mode (the shared tensors are already in runtime format; only derived state such as packed
kernels is rebuilt). A tied module whose processing cannot be re-run that way makes the engine
refuse every version, loudly, instead of serving a stale layer.

vLLM is imported where it is used, so that the list of fixes loads without it.
"""

from __future__ import annotations

import logging
from collections.abc import Set
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TiedModule:
    """A module that shares a parameter's storage with another module's parameter."""

    name: str
    module: torch.nn.Module
    params: tuple[str, ...]       # its own tied parameters, qualified (``lm_head.weight``)
    shares_with: tuple[str, ...]  # the other modules' parameters they share storage with

    @property
    def rerun_by_vllm(self) -> bool:
        """An attention layer whose processing vLLM defers: ``finalize_layerwise_reload`` re-runs it on
        every reload, after every other layer was loaded (MLA's absorbed ``W_UV`` / ``W_UK_T``, derived
        from the ``kv_b_proj`` it shares: a version changing only ``kv_b_proj`` decodes exactly)."""
        from vllm.model_executor.layers.attention import is_deferred_attention_layer

        return bool(is_deferred_attention_layer(self.module))

    @property
    def reprocessable(self) -> bool:
        """Re-run by vLLM itself, nothing to re-run (no ``quant_method``), or a method that declares
        ``supports_pre_processed_weights``: vLLM's contract that its ``process_weights_after_loading``
        runs on runtime-format tensors, rebuilding derived state without transforming them."""
        from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

        if self.rerun_by_vllm:
            return True
        method = getattr(self.module, "quant_method", None)
        return method is None or (isinstance(method, QuantizeMethodBase) and method.supports_pre_processed_weights)

    def describe(self) -> str:
        method = type(getattr(self.module, "quant_method", None)).__name__
        return f"{self.name} ({type(self.module).__name__}, {method}) shares {', '.join(self.shares_with)}"


class TiedModules:
    """The tied modules of a loaded model, found once (the reload restores every parameter into its
    original storage, so the ties found at start-up hold for every version)."""

    def __init__(self, ties: list[TiedModule]):
        self.ties = ties
        self.unsafe = "; ".join(t.describe() for t in ties if not t.reprocessable)

    @classmethod
    def of(cls, model: torch.nn.Module) -> TiedModules | None:
        """The tied modules of ``model``, or None where it has none."""
        ties = tied_modules(model)
        return cls(ties) if ties else None

    def refusal(self) -> str | None:
        """Why every version is refused: a tied module whose processing cannot be re-run."""
        if not self.unsafe:
            return None
        return ("tied module(s) whose post-load processing cannot be re-run on loaded weights, so they would keep "
                f"serving their start-up weights: {self.unsafe}")

    @torch.no_grad()
    def repair(self, loaded: Set[str] | None) -> None:
        """After a load: re-run the processing of every tied module that ``load_weights`` did not load
        itself (``loaded``: the parameter names it loaded; None means it does not say, and then every
        tied module is re-run, which is idempotent in this mode). A version is always whole, so what a
        tied module shares was updated."""
        from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
        from vllm.model_executor.utils import weights_already_processed

        for tie in self.ties:
            method = getattr(tie.module, "quant_method", None)
            if tie.rerun_by_vllm or not isinstance(method, QuantizeMethodBase) or \
                    (loaded is not None and set(tie.params) <= loaded):
                continue  # re-run by vLLM's finalize, nothing to re-run, or loaded (processed by the reload)
            with weights_already_processed():
                method.process_weights_after_loading(tie.module)
            if hasattr(tie.module, "update_param_tp_status"):  # as vLLM does after processing a module
                tie.module.update_param_tp_status()
            log.info("re-processed tied module %s (shares %s)", tie.name, ", ".join(tie.shares_with))


def tied_modules(model: torch.nn.Module) -> list[TiedModule]:
    """Every module with a parameter whose storage another module's parameter shares (views count).
    A module registered under two names is one module, not a tie."""
    owners: dict[tuple[torch.device, int], list[tuple[str, str]]] = {}
    modules = dict(model.named_modules())
    for mname, module in modules.items():
        for pname, p in module._parameters.items():
            if p is None or p.is_meta or p.numel() == 0:
                continue
            owners.setdefault((p.device, p.untyped_storage().data_ptr()), []).append((mname, _qualified(mname, pname)))
    found: dict[str, tuple[list[str], list[str]]] = {}
    for members in owners.values():
        for mname, qualified in members:
            others = [q for m, q in members if m != mname]
            if others:
                own, shared = found.setdefault(mname, ([], []))
                own.append(qualified)
                shared.extend(others)
    return [TiedModule(m, modules[m], tuple(own), tuple(shared)) for m, (own, shared) in found.items()]


def _qualified(module_name: str, param_name: str) -> str:
    return f"{module_name}.{param_name}" if module_name else param_name
