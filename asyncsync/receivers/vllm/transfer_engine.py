"""The worker side of asyncsync's vLLM backend: receive a version, verify it, load it in one step.

vLLM calls, per version: ``start_weight_update``, ``update_weights`` (with asyncsync's
``UpdateRequest``), ``finish_weight_update``. This engine does all of its work inside
``update_weights``:

1. receive every bucket into flat staging buffers and verify them (CRC32C manifest, and names,
   dtypes and shapes against the checkpoint the server loaded, every tensor exactly once); a bad
   version is refused here, before the model is touched;
2. only then open vLLM's layerwise reload, ``model.load_weights`` the whole version (HF checkpoint
   names), and close the reload, even when loading raises;
3. re-run the post-load processing of every tied module the load did not reach (a tied ``lm_head``:
   ``receivers/vllm/ties.py``), so no layer keeps computing with derived state of older weights. A
   model with a tied module whose processing cannot be re-run has every version refused in step 1.

The reload (which parks parameters on the meta device until each layer is complete) therefore never
spans two RPCs: a forward pass can run only between RPCs, so none ever meets a half-loaded model,
whether or not the trainer pauses generation and whatever happens to the trainer mid-update.
``start_weight_update`` and ``finish_weight_update`` have nothing left to do.

Contract: a version this engine reports loaded is served by every module, each with the processing
derived from that version's weights; a version that cannot be is refused before the model is touched.
"""

from __future__ import annotations

import glob
import logging
import os
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

from asyncsync.protocol.device import runtime_for
from asyncsync.protocol.specs import TensorSpec, dtype_from_safetensors
from asyncsync.protocol.staging import BucketStager, StagedVersion
from asyncsync.protocol.wire import InitGroupRequest, UpdateRequest
from asyncsync.receivers.vllm.ties import TiedModules

log = logging.getLogger(__name__)

class AsyncsyncWeightTransferEngine(WeightTransferEngine):  # type: ignore[type-arg]
    """Receives asyncsync's buckets over a gloo (CPU) or NCCL (GPU) group and loads them whole."""

    init_info_cls = InitGroupRequest  # type: ignore[assignment]
    update_info_cls = UpdateRequest  # type: ignore[assignment]
    supports_draft_weight_update = False  # the expected tensors are the main checkpoint's

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module):
        super().__init__(config, vllm_config, device, model)
        # The staging arena (one version, on the worker's device) is allocated here, when vLLM creates
        # the engine, not at the first update: see docs/engines/vllm.md for sizing the KV cache around it.
        self.stager = BucketStager(checkpoint_specs(vllm_config), "/init_weight_transfer_engine",
                                   runtime_for(torch.device(device)), arena=True)
        self.version = 0  # the last version this worker loaded; a version must be newer to be loaded
        self.ties = TiedModules(model)
        log.info("asyncsync: %.1f MB staging arena on %s", self.stager.arena.numel() / 1e6, device)

    def parse_init_info(self, init_dict: dict[str, Any]) -> InitGroupRequest:  # type: ignore[override]
        return InitGroupRequest.from_json(init_dict)

    def parse_update_info(self, update_dict: dict[str, Any]) -> UpdateRequest:  # type: ignore[override]
        return UpdateRequest.from_json(update_dict)

    def init_transfer_engine(self, init_info: InitGroupRequest) -> None:  # type: ignore[override]
        pc = self.parallel_config
        rank = init_info.rank_offset + pc.data_parallel_index * pc.world_size + pc.rank
        self.stager.join(init_info.groups, rank)

    def start_weight_update(self) -> None:
        """Nothing to prepare: the reload is opened in ``receive_weights``, once the version is verified."""

    def receive_weights(self, update_info: UpdateRequest) -> None:  # type: ignore[override]
        # From the data plane, or (``transport: shm``, same host) copied once from the trainer's shared
        # memory into the arena; either way verified before the model is touched (raises VersionRejected).
        stager = self.stager
        staged = stager.adopt(update_info, self.version) if update_info.shm is not None else stager.receive(update_info, self.version)
        self.ties.check(staged.version)  # raises VersionRejected; model untouched
        self._load(staged)
        self.version = staged.version
        log.info("loaded version %d (%d buckets)", staged.version, len(staged.buckets))

    def _load(self, staged: StagedVersion) -> None:
        initialize_layerwise_reload(self.model)
        try:
            loaded = self.model.load_weights(staged.tensors())
        finally:
            finalize_layerwise_reload(self.model, self.model_config)
        self.ties.reprocess(loaded)

    def finish_weight_update(self) -> None:
        """Nothing to finish: ``receive_weights`` closed the reload it opened."""

    def shutdown(self) -> None:
        self.stager.close()


def checkpoint_specs(vllm_config: Any) -> dict[str, TensorSpec]:
    """Name, dtype and shape of every tensor in the served checkpoint's safetensors files (headers
    only): the HF names, dtypes and shapes an update must carry."""
    from safetensors import safe_open

    specs: dict[str, TensorSpec] = {}
    for path in _safetensors_files(vllm_config):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                entry = f.get_slice(name)
                specs[name] = TensorSpec(name, dtype_from_safetensors(entry.get_dtype()), tuple(entry.get_shape()))
    return specs


def _safetensors_files(vllm_config: Any) -> list[str]:
    model = vllm_config.model_config.model
    folder = model if os.path.isdir(model) else _cached_snapshot(model, vllm_config)
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise RuntimeError(
            f"asyncsync: no *.safetensors in {folder}: the asyncsync backend verifies updates against the "
            "checkpoint's tensor names and shapes, so serve a safetensors checkpoint"
        )
    return files


def _cached_snapshot(repo_id: str, vllm_config: Any) -> str:
    """The local copy vLLM downloaded at start-up (never downloads anything itself)."""
    from huggingface_hub import snapshot_download

    return snapshot_download(
        repo_id, revision=vllm_config.model_config.revision, cache_dir=vllm_config.load_config.download_dir,
        allow_patterns=["*.safetensors"], local_files_only=True,
    )
