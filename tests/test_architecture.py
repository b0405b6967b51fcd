"""The seams of the architecture: what a receiver imports, lazy registries that do what they say, the
pack backend chosen before any server is touched, and one layout policy for both modes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asyncsync import ConfigError, WeightSync, WeightSyncConfig
from asyncsync.engines import engine_class, make_engine, register_engine
from asyncsync.engines.reference import ReferenceEngine
from asyncsync.packing import PackBackendUnavailable
from asyncsync.trainer.source import LayoutChanged

from conftest import TINY

REPO = Path(__file__).resolve().parents[1]
TRAINER_STACK = ("aiohttp", "prometheus_client", "yaml", "transformers", "asyncsync.trainer", "asyncsync.transport",
                 "asyncsync.engines", "asyncsync.config", "asyncsync.packing")


def imported_after(code: str) -> list[str]:
    """The modules loaded in a fresh interpreter after running ``code``."""
    probe = f"import sys\n{code}\nimport json\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_the_receiver_side_imports_only_torch():
    loaded = imported_after(
        "import asyncsync.protocol.specs, asyncsync.protocol.wire, asyncsync.protocol.sglang, "
        "asyncsync.protocol.checksum, asyncsync.protocol.group, asyncsync.protocol.staging, asyncsync.protocol.shm, "
        "asyncsync.protocol.lora\n"
        "import torch\n"
        "from asyncsync.protocol.checksum import crc32c_of\n"
        "assert crc32c_of(torch.arange(9, dtype=torch.uint8)) > 0"
    )
    heavy = [m for m in loaded if any(m == s or m.startswith(s + ".") for s in TRAINER_STACK)]
    assert heavy == [], f"the receiver side pulled in the trainer's stack: {heavy}"


def test_importing_asyncsync_loads_nothing():
    loaded = imported_after("import asyncsync")
    assert "torch" not in loaded and not [m for m in loaded if m.startswith("asyncsync.")]
    loaded = imported_after("import asyncsync.packing")
    assert "asyncsync.packing.native" not in loaded, "listing pack backends must not load (or compile) any"


def test_pack_backend_cpp_is_usable_by_name_in_a_fresh_process():
    loaded = imported_after(
        "import torch\n"
        "from asyncsync.config import WeightSyncConfig\n"
        "from asyncsync.packing import get_backend\n"
        "cfg = WeightSyncConfig(pack_backend='cpp')\n"
        "out = torch.zeros(8, dtype=torch.uint8)\n"
        "assert get_backend(cfg.pack_backend, 'cpu').pack([torch.ones(2, dtype=torch.int32)], [0], out, True) is not None"
    )
    assert "asyncsync.packing.native" in loaded


def test_names_are_checked_when_the_config_loads():
    with pytest.raises(ConfigError, match=r"^pack_backend: 'fastest' is not one of \['auto', 'cpp', 'cuda', 'torch'\]"):
        WeightSyncConfig.from_dict({"pack_backend": "fastest"})
    with pytest.raises(ConfigError, match=r"^servers\[1\]\.kind: 'tgi' is not a registered engine kind"):
        WeightSyncConfig.from_dict({"servers": ["http://127.0.0.1:1", {"url": "http://127.0.0.1:2", "kind": "tgi"}]})


class EchoEngine(ReferenceEngine):
    """A new engine kind: the reference server's protocol under another name."""


def test_a_registered_engine_kind_is_accepted_and_built(monkeypatch):
    from asyncsync import engines

    monkeypatch.setattr(engines, "_REGISTRY", dict(engines._REGISTRY))
    register_engine("echo", f"{__name__}:EchoEngine")
    cfg = WeightSyncConfig.from_dict({"servers": [{"url": "http://127.0.0.1:1", "kind": "echo"}]})
    assert isinstance(make_engine(cfg.servers[0], 1.0), EchoEngine)
    register_engine("broken", "asyncsync.config:WeightSyncConfig")
    with pytest.raises(TypeError, match="not an EngineClient subclass"):
        engine_class("broken")


async def test_a_pack_backend_that_cannot_load_fails_before_any_server_is_contacted(recording_server):
    cfg = WeightSyncConfig.from_dict({"servers": [recording_server.url], "pack_backend": "cuda"})
    sync = WeightSync(cfg)
    with pytest.raises(PackBackendUnavailable, match="needs a CUDA device|packs cuda buffers"):
        sync.connect(torch.nn.Linear(2, 2))  # CPU weights: the CUDA backend cannot pack them
    assert recording_server.calls == [], "no server may be asked to join before the pack backend is known to work"
    assert sync.server_versions == {}


@pytest.mark.parametrize("async_weight_update", [False, True], ids=["blocking", "async"])
def test_a_changed_layout_is_refused_the_same_way_in_both_modes(two_servers, async_weight_update):
    from asyncsync.testing import mixed_dtype_model

    model = mixed_dtype_model(TINY)  # what the servers serve
    start = max(s.get("/version")["version"] for s in two_servers)
    cfg = WeightSyncConfig.from_dict({"servers": [s.url for s in two_servers], "async_weight_update": async_weight_update})
    with WeightSync(cfg) as sync:
        sync.connect(model)
        grown = {**model.state_dict(), "extra.weight": torch.zeros(3)}
        if async_weight_update:
            sync.publish(grown, start + 1)
            sync.wait_snapshot()
            sync.close()
            assert len(sync.errors) == 1 and "the weights changed since connect(): tensor 'extra.weight'" in sync.errors[0]
        else:
            with pytest.raises(LayoutChanged, match="tensor 'extra.weight' was not in the plan; servers only accept"):
                sync.publish(grown, start + 1)
    assert sync.metrics.sent == 0
    assert {s.get("/version")["version"] for s in two_servers} == {start}, "nothing reached the servers"
