"""MoE experts in a vLLM model: re-running the kernel's own post-load step after every version.

vLLM 0.32 builds an unquantized MoE layer's kernel at the first load, and that kernel's
``fused_experts.process_weights_after_loading`` transforms the weights once more for itself: on
CPU it prepacks ``w13_weight`` / ``w2_weight`` into its grouped-GEMM layout. On a weight update
(the layerwise reload re-runs the layer's ``process_weights_after_loading``) the method copies the
reloaded weights into place but skips that step (``UnquantizedFusedMoEMethod._setup_kernel``: "Setup
moe kernel only on the first call"), so on CPU the kernel reads plain weights as if they were
prepacked: every version is reported loaded, and the engine decodes with weights of no version
(seen here: even the original checkpoint sent back gave other tokens). GPU kernels have no such
step (its default is a no-op), so re-running it there changes nothing.

The rule this module implements: after a version is loaded, every MoE layer the load reached has
its kernel's step re-run on the reloaded weights, as the first load ran it.
"""

from __future__ import annotations

import logging
import torch

log = logging.getLogger(__name__)


class ExpertKernels:
    """The MoE layers of a loaded model whose kernel has its own post-load step, found once."""

    def __init__(self, model: torch.nn.Module):
        self.layers = [(name, m) for name, m in model.named_modules() if _kernel_step(m) is not None]

    @torch.no_grad()
    def reprocess(self) -> None:
        """After a load: re-run the kernel step of every MoE layer. A version is always whole, so
        the load reached every one (``load_weights``' returned names are not the layers' own: vLLM
        nests the experts of some families, DeepSeek's, one module deeper than it names them)."""
        for _, layer in self.layers:
            step = _kernel_step(layer)
            if step is not None:
                step(layer)
        if self.layers:
            log.debug("re-ran the experts kernel step of %d MoE layer(s)", len(self.layers))


def _kernel_step(layer: torch.nn.Module):  # noqa: ANN202 - vLLM's bound method
    kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    return getattr(experts, "process_weights_after_loading", None)
