"""The worked conversion of docs/sharded.md (a trainer with fused q/k/v, servers that load Qwen2's
q_proj/k_proj/v_proj), run from the document itself: the servers receive the unfused model bit for
bit at every version, in both modes, with the fused weights changed in place between versions (a
conversion cached across syncs would serve stale bytes)."""

from __future__ import annotations

import re
from functools import partial
from pathlib import Path

import pytest
import torch

from asyncsync.models import build_model
from asyncsync.receivers.reference.app import ReferenceServer
from asyncsync.trainer.allocate import sync_memory
from asyncsync.trainer.sync import WeightSync

from conftest import TINY
from helpers import ThreadedServer, call, digest

DOC = Path(__file__).resolve().parents[1] / "docs" / "sharded.md"


def doc_conversion() -> object:
    """``split_fused_qkv`` as docs/sharded.md defines it (its first python block that defines it)."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    source = next(b for b in blocks if "def split_fused_qkv" in b)
    scope: dict[str, object] = {}
    exec(compile(source, str(DOC), "exec"), scope)
    return scope["split_fused_qkv"]


class FusedTrainer(torch.nn.Module):
    """The tiny Qwen2's tensors with each layer's q/k/v fused into ``qkv_proj`` (under a torch.compile
    style ``_orig_mod.`` prefix): what the trainer holds; the servers load the unfused names."""

    def __init__(self, unfused: torch.nn.Module):
        super().__init__()
        self._orig_mod = torch.nn.Module()
        params = {}
        state = unfused.state_dict()
        for name, t in state.items():
            if ".self_attn.q_proj." in name:
                parts = [state[name.replace("q_proj", p)] for p in ("q_proj", "k_proj", "v_proj")]
                params[name.replace("q_proj", "qkv_proj")] = torch.cat(parts)
            elif ".self_attn.k_proj." not in name and ".self_attn.v_proj." not in name:
                params[name] = t.clone()
        self.flat = torch.nn.ParameterDict({n.replace(".", "__"): torch.nn.Parameter(t) for n, t in params.items()})

    def state(self) -> dict[str, torch.Tensor]:
        return {"_orig_mod." + n.replace("__", "."): p for n, p in self.flat.items()}


@pytest.mark.parametrize("async_mode", [False, True], ids=["blocking", "async"])
def test_the_documented_fused_qkv_conversion_is_bit_exact_version_after_version(async_mode):
    split_fused_qkv = doc_conversion()
    head_dim = TINY.hidden_size // TINY.num_heads
    convert = partial(split_fused_qkv, q_size=TINY.num_heads * head_dim, kv_size=TINY.num_kv_heads * head_dim)
    unfused = build_model(TINY)
    trainer = FusedTrainer(unfused)
    with ThreadedServer(ReferenceServer(build_model(TINY))) as server:
        sync = WeightSync.from_config({"servers": [server.url], "async_weight_update": async_mode, "bucket_bytes": 16384})
        sync.connect(trainer.state(), convert=convert)
        try:
            for version in range(1, 4):
                sync.wait_snapshot()
                with torch.no_grad():
                    for p in unfused.parameters():
                        p.add_(0.01 * version)
                    for p in trainer.parameters():  # the trainer's fused tensors, changed in place
                        p.add_(0.01 * version)
                sync.publish(trainer.state(), version)
                if not async_mode:
                    status, answer = call(server.url, "GET", "/weights/digest")
                    assert answer == {"version": version, "digest": digest(unfused)}
        finally:
            sync.close()
        status, answer = call(server.url, "GET", "/weights/digest")
        assert answer == {"version": 3, "digest": digest(unfused)}, "the last version, unfused, bit for bit"
        assert sync.errors == []


def test_a_conversion_that_returns_no_mapping_is_refused_with_its_type():
    with ThreadedServer(ReferenceServer(build_model(TINY))) as server:
        sync = WeightSync.from_config({"servers": [server.url]})
        with pytest.raises(TypeError, match="conversion function returned a list"):
            sync.connect(build_model(TINY), convert=lambda named: list(named.items()))
        sync.close()


def test_doctor_prints_the_bytes_the_sync_allocates_per_mode(tmp_path):
    """``asyncsync doctor --model-config`` reports, per mode, what connect would allocate: blocking at
    most 2 buckets; async one snapshot of the model on the device, or 2 buckets there and the snapshot
    in host memory (the same figures ``WeightSync.memory`` measures from the buffers)."""
    import subprocess
    import sys

    import yaml

    from asyncsync.config import WeightSyncConfig

    model_yaml = tmp_path / "model.yaml"
    model_yaml.write_text(yaml.safe_dump({"model": TINY.to_dict()}))
    sync_yaml = tmp_path / "sync.yaml"
    sync_yaml.write_text(yaml.safe_dump({"weight_sync": {"bucket_bytes": 16384}}))
    out = subprocess.run([sys.executable, "-m", "asyncsync.cli", "--log-level", "WARNING", "doctor", "--model-config",
                          str(model_yaml), "--config", str(sync_yaml)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    printed = {line.split()[0]: line for line in out.stdout.splitlines() if line.startswith("  ")}
    measured = sync_memory(WeightSyncConfig.from_dict({"servers": ["http://unused"], "bucket_bytes": 16384}),
                           build_model(TINY))
    model_bytes = sum(t.nbytes for t in build_model(TINY).state_dict().values())
    assert measured["async_device"] == {"device": model_bytes, "host": 0, "conversion": 0}  # a dense model: renames only
    assert measured["async_host"]["host"] == model_bytes and measured["async_host"]["device"] <= 2 * 16384 * 4
    assert measured["blocking"]["host"] == 0 and measured["blocking"]["device"] <= 2 * 16384
    for mode, b in measured.items():
        assert f"{b['device'] / 1e6:9.1f} MB on the weights' device, {b['host'] / 1e6:9.1f} MB host" in printed[mode]
