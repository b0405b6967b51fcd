"""asyncsync's vLLM worker and ``lora: adapter``: the checks at connect, and each version's directory.

The worker receives an adapter version like any version (into its staging arena, verified) and
writes it as a PEFT directory in the host's tmpfs (``receivers/adapters.py``); the trainer then
loads it with ``POST /v1/load_lora_adapter`` (vLLM's own loader reads the directory), so nothing of
vLLM's LoRA machinery is touched here. What only the worker can tell, at connect:

* whether the engine serves LoRA at all (``--enable-lora``), the adapter's rank against
  ``--max-lora-rank`` and the rest of vLLM's own ``PEFTHelper.validate_legal``, its target modules
  against those vLLM wrapped for LoRA (``BaseLayerWithLoRA``, with the model's packed modules
  expanded as vLLM's loader expands them), the versions held at once against ``--max-loras``;
* a target the engine cannot serve: a mixture-of-experts model on vLLM's CPU backend, whose fused-MoE
  LoRA path is Triton-only: its first request, the base model's included, would kill the engine;
* whether it serves the trainer's base (``BaseCheck``): the checkpoint it loaded at start-up, read
  back tensor by tensor, as long as no version replaced it (after one it cannot tell: the base is sent).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, NoReturn

import torch

from asyncsync.protocol.lora import (
    ADAPTER_REFUSED, AdapterCheck, AdapterUpdate, BaseCheck, adapter_problems, adapter_targets,
)
from asyncsync.protocol.specs import TensorSpec
from asyncsync.protocol.admission import VersionRejected
from asyncsync.protocol.staging import StagedVersion
from asyncsync.receivers.adapters import AdapterFiles

log = logging.getLogger(__name__)


class WorkerAdapters:
    """One vLLM worker's side of adapter versions; only the worker of rank 0 writes directories
    (every rank of the server receives and verifies the same bytes)."""

    def __init__(self, vllm_config: Any, model: torch.nn.Module, checkpoint: Mapping[str, TensorSpec], writer: bool):
        self.vllm_config, self.model, self.checkpoint, self.writer = vllm_config, model, checkpoint, writer
        self.files = AdapterFiles()
        self.pending: AdapterUpdate | None = None  # the version being received in the background
        self._written: dict[str, int] = {}  # slot -> the newest version written there

    def check(self, check: AdapterCheck) -> None:
        """Raise ``VersionRejected`` saying what to change unless this engine can serve the adapter."""
        from vllm.lora.layers import BaseLayerWithLoRA
        from vllm.lora.peft_helper import PEFTHelper
        from vllm.lora.utils import is_moe_model
        from vllm.model_executor.utils import get_packed_modules_mapping
        from vllm.platforms import current_platform

        lora = self.vllm_config.lora_config
        if lora is None:
            refuse("this vLLM serves no LoRA adapters: start it with --enable-lora (and "
                   "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, for /v1/load_lora_adapter)")
        if current_platform.is_cpu() and is_moe_model(self.model):
            refuse("a mixture-of-experts model on vLLM's CPU backend cannot serve LoRA adapters (its fused-MoE LoRA "
                   "path is Triton-only: the first request would kill the engine); use lora: merged with a vLLM "
                   "started without --enable-lora")
        try:
            PEFTHelper.from_dict(dict(check.config)).validate_legal(lora)
        except ValueError as e:
            fix = f" (start vLLM with --max-lora-rank {check.rank})" if check.rank > lora.max_lora_rank else ""
            refuse(f"vLLM refuses the adapter: {e}{fix}")
        if lora.max_loras < check.loaded:
            refuse(f"--max-loras {lora.max_loras} is below the {check.loaded} versions served at once "
                   f"(max_staleness + 2): start vLLM with --max-loras {check.loaded}")
        packed = get_packed_modules_mapping(self.model)
        wrapped = {name.rsplit(".", 1)[-1] for name, m in self.model.named_modules() if isinstance(m, BaseLayerWithLoRA)}
        expected = {m for s in wrapped for m in packed.get(s, [s])}
        targets = adapter_targets(check.specs)
        if targets - expected:
            refuse(f"vLLM cannot apply LoRA to {sorted(targets - expected)} of this model (it can to {sorted(expected)})")
        problems = adapter_problems(self.checkpoint, check.specs, check.config)
        if problems:
            refuse("the adapter does not fit the served model: " + "; ".join(problems[:3]))

    def check_base(self, check: BaseCheck, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Raise ``VersionRejected`` unless the engine serves exactly ``check``'s base: ``tensors``,
        the checkpoint loaded at start-up, while ``version`` (the last one loaded) is 0."""
        if version:
            refuse(f"this engine serves version {version}, loaded since start-up: it cannot tell its base")
        problem = check.mismatch(tensors)
        if problem is not None:
            refuse(f"this engine serves another base: {problem}")

    def expected(self, update: AdapterUpdate) -> dict[str, TensorSpec]:
        """The tensors version ``update`` must carry: its own (judged by ``verify`` once received)."""
        return {s.name: s for b in update.update.buckets for s in b.to_bucket(0).specs}

    def served(self, update: AdapterUpdate) -> int:
        """The newest version written in ``update``'s slot: a version must be newer."""
        return self._written.get(update.adapter.slot, 0)

    def verify(self, update: AdapterUpdate, staged: StagedVersion) -> None:
        specs = [TensorSpec.of(name, t) for name, t in staged.tensors()]
        problems = adapter_problems(self.checkpoint, specs, update.adapter.config)
        if problems:
            raise VersionRejected(f"adapter version {staged.version} rejected: " + "; ".join(problems[:3]))

    def write(self, update: AdapterUpdate, staged: StagedVersion) -> None:
        """The verified version as a PEFT directory (rank 0's worker), and the slot's old ones removed."""
        if self.writer:
            path = self.files.write(update.adapter, staged.version, staged.tensors())
            removed = self.files.retain(update.adapter, staged.version)
            log.info("wrote adapter version %d to %s%s", staged.version, path, f" (removed {removed})" if removed else "")
        self._written[update.adapter.slot] = staged.version

    def close(self) -> None:
        self.files.close()


def refuse(reason: str) -> NoReturn:
    """Refuse a check of the trainer's connect: one warning line here (``quiet`` drops vLLM's
    tracebacks of it), the reason in the trainer's ``ConfigError``."""
    log.warning("%s: %s", ADAPTER_REFUSED, reason)
    raise VersionRejected(f"{ADAPTER_REFUSED}: {reason}")

