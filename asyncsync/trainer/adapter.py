"""``lora: adapter``: what a PEFT model's versions send, and the base they apply to.

A LoRA trainer changes a few MB of adapter on a frozen base of many GB; sending merged weights moves
the whole base every version. In adapter mode each version is the active adapter's tensors only,
under the names PEFT saves them by (``get_peft_model_state_dict``: ``base_model.model.<module>.
lora_A.weight``, ``modules_to_save`` copies under their module's name), and the base (the model
without its adapter: ``WeightLayout.of(..., base_only=True)``) is sent once at connect to the
servers that do not already serve it. Both are derived from PEFT itself:

* the tensors and their names: PEFT's ``get_peft_model_state_dict`` run once at ``connect`` over
  the module's own tensors, each result matched to the tensor it is (so the view of every version
  reads the live parameters, never a copy);
* ``adapter_config.json``: PEFT's ``PeftConfig.save_pretrained`` of the adapter's config (in
  inference mode, as ``PeftModel.save_pretrained`` writes it).

``AdapterStage`` is a conversion stage of plain renames, so an adapter version goes through the same
plan, packing, snapshot and sharded gathering (each bucket's owner assembles its pieces) as any
version.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncsync.checkpoint import Conversion, LayoutError, Stage, Tensors, meta_tensors
from asyncsync.protocol.lora import CONFIG_FILE
from asyncsync.protocol.specs import TensorSpec
from asyncsync.trainer.layout import WeightLayout, is_class


@dataclass(frozen=True)
class Adapter:
    """A PEFT model's active adapter as versions send it: ``saved`` maps each of the module's tensor
    names (``module_tensors``) to the name PEFT saves it by; ``config`` is its adapter_config.json."""

    peft_name: str                       # PEFT's name of the adapter ("default")
    config: dict[str, Any] = field(hash=False)
    saved: Mapping[str, str] = field(hash=False)

    @classmethod
    def of(cls, module: torch.nn.Module, named: Mapping[str, torch.Tensor]) -> Adapter:
        """The active adapter of the ``peft.PeftModel`` in ``module`` (it may be wrapped: DDP,
        torch.compile); ``named`` is every tensor of ``module`` by name. Raises ``LayoutError``
        naming what to change for a model without exactly one active LoRA adapter."""
        from peft.utils import get_peft_model_state_dict

        found = [(path, m) for path, m in module.named_modules() if is_class(m, "peft", "PeftModel")]
        if len(found) != 1:
            raise LayoutError(f"lora: adapter sends a peft.PeftModel's adapter, and the model holds {len(found)} "
                              "PeftModel(s): wrap it once with peft.get_peft_model, or use lora: merged")
        path, peft = found[0]
        active = list(peft.active_adapters)
        if len(active) != 1:
            raise LayoutError(f"lora: adapter sends one adapter per version, and {len(active)} are active ({active}): "
                              "set_adapter() the one being trained, or use lora: merged")
        config = peft.peft_config[active[0]]
        if getattr(config, "peft_type", None) != "LORA":
            raise LayoutError(f"lora: adapter serves LoRA adapters; the active adapter is {config.peft_type}: use "
                              "lora: merged")
        prefix = f"{path}." if path else ""
        own = {n[len(prefix):]: t for n, t in named.items() if n.startswith(prefix)}
        state = get_peft_model_state_dict(peft, state_dict=own, adapter_name=active[0])
        by_id = {id(t): n for n, t in own.items()}
        saved: dict[str, str] = {}
        for name, t in state.items():
            source = by_id.get(id(t))
            if source is None:
                raise LayoutError(f"PEFT saves adapter tensor '{name}' as a tensor the model does not hold: "
                                  "asyncsync sends the model's own tensors; use lora: merged")
            saved[prefix + source] = name
        if not saved:
            raise LayoutError(f"the active adapter '{active[0]}' has no tensors to send")
        return cls(active[0], adapter_config(peft, active[0]), saved)

    def layout(self, named: Mapping[str, torch.Tensor]) -> WeightLayout:
        """The layout of a version: the adapter's tensors renamed, every other tensor left out."""
        conversion = Conversion([AdapterStage(self.saved)])
        meta = meta_tensors(named)
        return WeightLayout(conversion, conversion.plan(meta), {n: TensorSpec.of(n, t) for n, t in meta.items()})



def adapter_config(peft: Any, name: str) -> dict[str, Any]:
    """``adapter_config.json`` of adapter ``name`` as ``PeftModel.save_pretrained`` writes it (in
    inference mode, with the base model's path and PEFT's auto mapping of a config without a task
    type), by PEFT's own ``PeftConfig.save_pretrained``; the trainer's config is not changed."""
    saving = copy.copy(peft.peft_config[name])
    saving.inference_mode = True
    if saving.base_model_name_or_path is None:
        saving.base_model_name_or_path = peft.base_model.model.__dict__.get("name_or_path", None) or None
    mapping = None
    if saving.task_type is None:
        base = peft._get_base_model_class(is_prompt_tuning=saving.is_prompt_learning)
        mapping = {"base_model_class": base.__name__, "parent_library": base.__module__}
    with tempfile.TemporaryDirectory(prefix="asyncsync-adapter-config-") as folder:
        saving.save_pretrained(folder, auto_mapping_dict=mapping)
        with open(os.path.join(folder, CONFIG_FILE)) as f:
            return json.load(f)


class AdapterStage(Stage):
    """The adapter's tensors under PEFT's saved names; every other tensor is not sent (the base
    went once, at connect)."""

    def __init__(self, saved: Mapping[str, str]):
        self.saved = dict(saved)

    def partition(self, meta: Tensors) -> list[tuple[str, ...]]:
        return [(n,) for n in meta]

    def __call__(self, tensors: Tensors) -> Tensors:
        return {self.saved[n]: t for n, t in tensors.items() if n in self.saved}
