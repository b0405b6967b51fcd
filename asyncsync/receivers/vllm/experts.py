"""MoE experts in a vLLM model: re-running the kernel's own post-load step after every version.

vLLM 0.32 builds an unquantized MoE layer's kernel at the first load, and that kernel's
``fused_experts.process_weights_after_loading`` transforms the weights once more for itself: on
CPU it prepacks ``w13_weight`` / ``w2_weight`` into its grouped-GEMM layout. On a weight update
(the layerwise reload re-runs the layer's ``process_weights_after_loading``) the method copies the
reloaded weights into place but skips that step (``UnquantizedFusedMoEMethod._setup_kernel``: "Setup
moe kernel only on the first call"), so on CPU the kernel reads plain weights as if they were
prepacked: every version is reported loaded, and the engine decodes with weights of no version
(seen here: even the original checkpoint sent back gave other tokens).

Only the unquantized method skips it. Quantized MoE methods re-run their kernel's step themselves on
reload (vLLM 0.33, read in its source), and several of those steps are not idempotent (NVFP4's
``w13_weight_scale_2.mul_(w13_input_scale)`` in ``fused_moe/experts/cutlass_moe.py``, the FlashInfer
CUTLASS / CuteDSL and TRT-LLM NVFP4 experts): running them twice would multiply the scales twice per
version. GPU kernels of the unquantized method have steps too (weights shuffled to a runtime layout
on ROCm AITER, for one), which the skip leaves as stale as the CPU prepack.

The rule this module implements (a post-load fix, ``fixes.py``): after a version is loaded, every MoE layer whose method is vLLM's
``UnquantizedFusedMoEMethod`` (or a subclass) has its kernel's step re-run on the reloaded weights, as
the first load ran it; no other method's.
"""

from __future__ import annotations

import logging
from collections.abc import Set

import torch

log = logging.getLogger(__name__)


class ExpertKernels:
    """The MoE layers of a loaded model whose kernel has its own post-load step, found once."""

    def __init__(self, layers: list[tuple[str, torch.nn.Module]]):
        self.layers = layers

    @classmethod
    def of(cls, model: torch.nn.Module) -> ExpertKernels | None:
        """The MoE layers of ``model`` whose step the reload skips, or None where there are none."""
        layers = [(name, m) for name, m in model.named_modules() if _kernel_step(m) is not None]
        return cls(layers) if layers else None

    def refusal(self) -> None:
        """Never: every such step can be re-run."""
        return None

    @torch.no_grad()
    def repair(self, loaded: Set[str] | None) -> None:
        """After a load: re-run the kernel step of every MoE layer, whatever ``loaded`` says. A version
        is always whole, so the load reached every one (``load_weights``' returned names are not the
        layers' own: vLLM nests the experts of some families, DeepSeek's, one module deeper than it
        names them)."""
        for _, layer in self.layers:
            step = _kernel_step(layer)
            if step is not None:
                step(layer)
        log.debug("re-ran the experts kernel step of %d MoE layer(s)", len(self.layers))


def _kernel_step(layer: torch.nn.Module):  # noqa: ANN202 - vLLM's bound method
    """The kernel step the reload skipped: only an unquantized method's (the module doc)."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    method = getattr(layer, "quant_method", None)
    if not isinstance(method, UnquantizedFusedMoEMethod):
        return None
    experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
    return getattr(experts, "process_weights_after_loading", None)
