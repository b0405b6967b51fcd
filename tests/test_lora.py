"""``lora: adapter``: a PEFT model's versions are its adapter only, loaded by each engine as ``<name>-v<N>``.

Unit checks: the tensors, names and adapter_config.json are PEFT's own (``get_peft_model_state_dict``,
``save_pretrained``), the base is ``unload()``'s, the receiver's directory loads in PEFT, the messages
refuse what they must. Then two reference servers (child processes, the data plane between them and
the trainer, as between hosts): blocking and async versions, each served under its name exactly as
the trainer's PEFT model decodes it, the base's tokens unchanged, older versions unloaded and their
directories removed; a base the servers do not serve is sent once at connect; a version one engine
refuses to load leaves the other serving it and is reported; and a 2-rank FSDP2 trainer whose engine
takes longer to load a version than the trainer ranks' own deadline: no rank fails.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
import torch

from asyncsync import WeightSync
from asyncsync.config import ConfigError, ServerConfig, WeightSyncConfig
from asyncsync.engines import make_engine
from asyncsync.models import ModelConfig, build_model, generate
from asyncsync.protocol.lora import (
    AdapterCheck, AdapterVersion, BaseCheck, adapter_problems, parse_version_name, version_name,
)
from asyncsync.protocol.specs import TensorSpec
from asyncsync.protocol.wire import SESSION_HEADER, WireError
from asyncsync.receivers.adapters import AdapterFiles
from asyncsync.testing import Faults, ServerProcess, running
from asyncsync.trainer.adapter import Adapter
from asyncsync.trainer.layout import WeightLayout
from asyncsync.trainer.source import module_tensors

CFG = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)
PROMPT = [3, 14, 15, 92, 65, 35]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peft_model(cfg: ModelConfig = CFG, **lora: Any) -> Any:
    from peft import LoraConfig, get_peft_model

    options = {"r": 4, "lora_alpha": 8, "target_modules": TARGETS, **lora}
    return get_peft_model(build_model(cfg), LoraConfig(**options))


def step(model: torch.nn.Module, seed: int) -> None:
    """A training step's change to the adapter (the base is frozen)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n or "modules_to_save" in n:
                noise = torch.randn(p.shape, generator=g).to(p.dtype) * 0.3
                if isinstance(p, DTensor):  # a sharded trainer's parameter: its shard of the same draw
                    noise = distribute_tensor(noise, p.device_mesh, p.placements)
                p.add_(noise)


def served(url: str, adapter: str | None) -> tuple[list[int], int]:
    async def run() -> tuple[list[int], int]:
        engine = make_engine(ServerConfig(url), 30)
        try:
            out = await engine.generate(PROMPT, 1, 8, 0.0, 0, adapter=adapter)
            return out.completions[0], out.version
        finally:
            await engine.close()

    return asyncio.run(run())


def loaded(server: ServerProcess, name: str = "pol") -> dict[str, str]:
    return {m["id"]: m["root"] for m in server.get("/v1/models")["data"] if m["id"].startswith(f"{name}-")}


def base_decode(model: Any) -> list[int]:
    with model.disable_adapter():
        return generate(model, PROMPT, 8)[0]


def config(servers: list[ServerProcess], **overrides: Any) -> dict[str, Any]:
    return {"servers": [s.url for s in servers], "lora": "adapter", "lora_name": "pol", "bucket_bytes": "16KiB",
            "transport": "collective", **overrides}


# -- what a version sends -----------------------------------------------------------------------------

def test_the_adapter_is_peft_s_own_tensors_names_and_config(tmp_path):
    from peft.utils import get_peft_model_state_dict

    model = peft_model(modules_to_save=["lm_head"])
    named = module_tensors(model)
    adapter = Adapter.of(model, named)
    saved = get_peft_model_state_dict(model)
    assert sorted(adapter.saved.values()) == sorted(saved)
    assert all(named[src] is dict(model.named_parameters())[src] for src in adapter.saved), "the live parameters"
    assert "base_model.model.lm_head.weight" in saved, "modules_to_save travels with the adapter"
    model.save_pretrained(tmp_path)
    assert adapter.config == json.loads((tmp_path / "adapter_config.json").read_text())

    layout = adapter.layout(named)
    targets = {t.name for g in layout.groups for t in g.targets}
    assert targets == set(saved) and all(g.renamed for g in layout.groups if g.targets), "renamed, never copied"

    base = WeightLayout.of(model, named, True, base_only=True)
    unloaded = copy.deepcopy(model).unload().state_dict()
    view = base.view(named)
    assert set(view) == set(unloaded) and all(torch.equal(view[n], unloaded[n]) for n in unloaded), "unload()'s base"


def test_a_model_without_exactly_one_active_peft_adapter_is_refused_at_connect(recording_server):
    cfg = {"servers": [recording_server.url], "lora": "adapter"}
    with WeightSync.from_config(cfg) as sync, pytest.raises(ConfigError, match="peft.PeftModel"):
        sync.connect(build_model(CFG))
    two = peft_model()
    from peft import LoraConfig

    two.add_adapter("other", LoraConfig(r=2, target_modules=["q_proj"]))
    two.base_model.set_adapter(["default", "other"])
    with WeightSync.from_config(cfg) as sync, pytest.raises(ConfigError, match="2 are active"):
        sync.connect(two)
    with WeightSync.from_config(cfg) as sync, pytest.raises(ConfigError, match="without convert="):
        sync.connect(peft_model(), convert=dict)
    assert recording_server.calls == [], "refused before any server was contacted"


def test_config_values():
    with pytest.raises(ConfigError, match="lora: 'lora'"):
        WeightSyncConfig(lora="lora")
    with pytest.raises(ConfigError, match="layout: checkpoint"):
        WeightSyncConfig(lora="adapter", layout="trainer")
    with pytest.raises(ConfigError, match="lora_name"):
        WeightSyncConfig(lora_name="../x")


# -- the receiver's side ------------------------------------------------------------------------------

def test_messages_refuse_names_that_would_escape_the_directory():
    config = {"r": 4, "peft_type": "LORA"}
    for bad in ("..", "a/b", "", "x" * 65, ".hidden"):
        with pytest.raises(WireError):
            AdapterVersion(bad, "slot", config)
        with pytest.raises(WireError):
            AdapterVersion("pol", bad, config)
    with pytest.raises(WireError, match="rank"):
        AdapterVersion("pol", "slot", {"r": 0})
    check = AdapterCheck("pol", config, (TensorSpec("base_model.model.a.lora_A.weight", torch.float32, (4, 8)),), 3)
    assert AdapterCheck.from_json(json.loads(json.dumps(check.to_json()))) == check and check.rank == 4
    assert BaseCheck.from_json(BaseCheck((("w", 7),)).to_json()).crcs == (("w", 7),)
    with pytest.raises(WireError):
        BaseCheck.from_json({"base_check": [["w", 2**32]]})
    assert parse_version_name(version_name("pol", 12), "pol") == 12 and parse_version_name("pol-v3", "other") is None


def test_adapter_problems_name_what_does_not_fit_the_base():
    base = {"m.q.weight": TensorSpec("m.q.weight", torch.float32, (16, 8)), "head.weight": TensorSpec("head.weight", torch.float32, (5, 8))}
    a = lambda shape: TensorSpec("base_model.model.m.q.lora_A.weight", torch.float32, shape)  # noqa: E731
    b = lambda shape: TensorSpec("base_model.model.m.q.lora_B.weight", torch.float32, shape)  # noqa: E731
    config = {"r": 4}
    assert adapter_problems(base, [a((4, 8)), b((16, 4))], config) == []
    assert adapter_problems(base, [a((4, 8)), b((16, 4))], {"r": 2, "rank_pattern": {"q": 4}}) == []
    assert "needs (2, 8)" in adapter_problems(base, [a((4, 8)), b((16, 4))], {"r": 2})[0]
    assert "lora_B is missing" in adapter_problems(base, [a((4, 8))], config)[0]
    assert "no linear weight" in adapter_problems(base, [TensorSpec("base_model.model.x.lora_A.weight", torch.float32, (4, 8))], config)[0]
    assert adapter_problems(base, [TensorSpec("base_model.model.head.weight", torch.float32, (5, 8))], config) == []
    assert "is torch.float32 (5, 9)" in adapter_problems(base, [TensorSpec("base_model.model.head.weight", torch.float32, (5, 9))], config)[0]
    assert "not a PEFT adapter tensor" in adapter_problems(base, [TensorSpec("m.q.weight", torch.float32, (16, 8))], config)[0]


def test_a_written_version_loads_in_peft_as_the_trainer_computes_it(tmp_path):
    from peft import PeftModel

    model = peft_model()
    step(model, 1)
    named = module_tensors(model)
    adapter = Adapter.of(model, named)
    files = AdapterFiles(str(tmp_path))
    target = AdapterVersion("pol", "slot", adapter.config)
    view = adapter.layout(named).view(named)
    paths = [files.write(target, v, ((n, view[n]) for n in view)) for v in (1, 2, 3)]
    assert files.retain(AdapterVersion("pol", "slot", adapter.config, keep=(2,)), 3) == [1]
    assert [os.path.isdir(p) for p in paths] == [False, True, True]
    served_model = PeftModel.from_pretrained(build_model(CFG), paths[2]).eval()
    assert generate(served_model, PROMPT, 8) == generate(model, PROMPT, 8)
    files.close()
    assert not (tmp_path / "slot").exists()
    dead = tmp_path / "left-behind"  # a receiver killed before its clean-up
    dead.mkdir()
    (dead / ".writer").write_text("999999999")
    AdapterFiles(str(tmp_path))
    assert not dead.exists(), "the next receiver on the host removes it"


# -- reference servers ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def servers() -> Any:
    with running([ServerProcess(build_model, (CFG,)) for _ in range(2)]) as started:
        yield started


@pytest.mark.parametrize("async_mode", [False, True], ids=["blocking", "async"])
def test_each_version_is_served_under_its_name_as_the_trainer_decodes_it(servers, async_mode):
    model = peft_model()
    base = base_decode(model)
    start = max((parse_version_name(n, "pol") or 0 for s in servers for n in loaded(s)), default=0)
    with WeightSync.from_config(config(servers, async_weight_update=async_mode)) as sync:
        sync.connect(model)
        assert [s.get("/version")["version"] for s in servers] == [0, 0], "they serve the base: it is not sent"
        assert all(".lora_" in s.name for s in sync.plan.specs)
        for version in range(start + 1, start + 4):
            sync.wait_snapshot()
            step(model, version)
            result = sync.publish(model, version)
            if async_mode:
                assert result is None
                deadline = time.monotonic() + 30
                while set(sync.server_versions.values()) != {version} and time.monotonic() < deadline:
                    time.sleep(0.05)
            else:
                assert result.server_versions == {s.url: version for s in servers}, result.failures
            assert sync.server_versions == {s.url: version for s in servers}, (sync.events, sync.errors)
            want = generate(model, PROMPT, 8)[0]
            for s in servers:
                assert served(s.url, sync.adapter_name(version)) == (want, version), f"{s.url} v{version}"
                assert served(s.url, None) == (base, 0), "the base's tokens are unchanged"
                dirs = loaded(s)
                assert set(dirs) == {f"pol-v{v}" for v in (version - 1, version) if v > 0}, "older versions unloaded"
                assert all(os.path.isdir(p) for p in dirs.values())
        paths = [p for s in servers for p in loaded(s).values()]
        sync.close()
        assert sync.errors == [] and sync.events == []
    assert len(set(paths)) == len(paths), "one directory per server, never shared"
    slots = {os.path.dirname(p) for p in paths}
    assert all(sorted(v for v in os.listdir(slot) if parse_version_name(v, "pol")) ==
               sorted(os.path.basename(p) for p in paths if p.startswith(slot)) for slot in slots), \
        "a version no engine holds is removed from disk"


def test_a_base_the_servers_do_not_serve_is_sent_once_at_connect():
    other = ModelConfig(**{**CFG.to_dict(), "seed": 7})
    with running([ServerProcess(build_model, (other,))]) as (server,):
        model = peft_model()
        with WeightSync.from_config(config([server])) as sync:
            sync.connect(model)
            assert server.get("/version")["version"] == 1, "the base, as version 1"
            assert served(server.url, None)[0] == base_decode(model)
            step(model, 1)
            assert sync.publish(model, 1).server_versions == {server.url: 1}
            assert served(server.url, "pol-v1")[0] == generate(model, PROMPT, 8)[0]
        with WeightSync.from_config(config([server])) as sync:
            sync.connect(model)
            assert server.get("/version")["version"] == 1, "served now: not sent again"


def test_a_version_one_engine_refuses_to_load_leaves_the_other_serving_it_and_is_reported(servers):
    model = peft_model()
    with WeightSync.from_config(config(servers)) as sync:
        sync.connect(model)
        first = max(sync.server_versions.values()) + 1
        step(model, first)
        assert sync.publish(model, first).server_versions == {s.url: first for s in servers}
        taken = version_name("pol", first + 1)  # loaded there under the next version's name, by the owner's session
        as_owner(sync, servers[1], "/v1/load_lora_adapter", {"lora_name": taken, "lora_path": loaded(servers[1])[f"pol-v{first}"]})
        step(model, first + 1)
        result = sync.publish(model, first + 1)
        assert result.server_versions == {servers[0].url: first + 1}
        assert "has already been loaded" in result.failures[servers[1].url]
        assert [(e.kind, e.server, e.version) for e in sync.events] == [("refused", servers[1].url, first + 1)]
        assert sync.server_versions == {servers[0].url: first + 1, servers[1].url: first}, "the other keeps its own"
        step(model, first + 2)
        assert sync.publish(model, first + 2).server_versions == {s.url: first + 2 for s in servers}
        as_owner(sync, servers[1], "/v1/unload_lora_adapter", {"lora_name": taken})
        with pytest.raises(urllib.error.HTTPError) as unknown:
            as_owner(sync, servers[1], "/v1/unload_lora_adapter", {"lora_name": taken})
        assert unknown.value.code == 404
        with pytest.raises(urllib.error.HTTPError) as other:
            servers[1].post("/v1/unload_lora_adapter", {"lora_name": version_name("pol", first + 2)})
        assert other.value.code == 423, "only the trainer that owns the server changes its adapters"


def as_owner(sync: WeightSync, server: ServerProcess, path: str, body: dict[str, Any]) -> None:
    """A call made as the trainer session that owns ``server``."""
    request = urllib.request.Request(server.url + path, json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", SESSION_HEADER: sync.session})
    urllib.request.urlopen(request, timeout=30).close()


# -- a slow engine and the trainer ranks' deadline ----------------------------------------------------

SLOW_LOAD_S = 11.0
DEADLINES = {"rendezvous_s": 2, "collective_s": 2, "http_s": 1.5, "load_s": 60}  # the ranks' groups: 2 + 2 + 4 x 1.5 = 10 s


def slow_load_ranks(rank: int, world: int, urls: list[str]) -> dict[str, Any]:
    """A rank of a 2-rank FSDP2 trainer of a PEFT model: one version blocking, one async, against a
    server that takes SLOW_LOAD_S to load each; rank 0 checks what it serves."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    model, reference = peft_model(), peft_model()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    out: dict[str, Any] = {}
    for version, async_mode in ((1, False), (2, True)):
        cfg = {"servers": urls, "lora": "adapter", "lora_name": "pol", "bucket_bytes": "16KiB",
               "async_weight_update": async_mode, "deadlines": DEADLINES}
        with WeightSync.from_config(cfg) as sync:
            sync.connect(model)
            sync.wait_snapshot()
            step(model, version)
            step(reference, version)
            start = time.monotonic()
            result = sync.publish(model, version)
            out[f"publish_s_{async_mode}"] = time.monotonic() - start
            if result is not None and rank == 0:
                out["blocking"] = (result.server_versions, result.failures)
        if rank == 0:
            out[f"served_{async_mode}"] = dict(sync.server_versions)
            want = generate(reference, PROMPT, 8)[0]
            out[f"tokens_{async_mode}"] = [served(u, version_name("pol", version))[0] == want for u in urls]
    return out


@pytest.mark.slow
def test_an_engine_slower_to_load_than_the_trainer_ranks_deadline_fails_no_rank():
    from asyncsync.trainer.local_ranks import run_local_ranks

    slow = Faults(call_delay_s=(("/v1/load_lora_adapter", SLOW_LOAD_S),))
    with running([ServerProcess(build_model, (CFG,), faults=slow)]) as servers:
        urls = [s.url for s in servers]
        outcomes = run_local_ranks(slow_load_ranks, 2, (urls,), timeout_s=240)
    assert [o.error for o in outcomes] == [None, None], [o.error for o in outcomes]
    first = outcomes[0].value
    assert first["blocking"] == ({u: 1 for u in urls}, {}), "blocking: every rank returned once the engine had loaded it"
    assert first["publish_s_False"] >= SLOW_LOAD_S and outcomes[1].value["publish_s_False"] >= SLOW_LOAD_S
    assert first["publish_s_True"] < 5, "async: publish never waits for a load"
    assert first["served_False"] == {u: 1 for u in urls} and first["served_True"] == {u: 2 for u in urls}
    assert first["tokens_False"] == [True] and first["tokens_True"] == [True]


# -- SGLang: its own load routes, the bytes through a receiver on its host ------------------------------

def test_an_sglang_server_loads_each_version_written_by_the_receiver_on_its_host(servers):
    """The reference server answers SGLang's API (``/load_lora_adapter`` with SGLang's request structs,
    checked against SGLang's source in test_sglang_conformance.py) and is its own receiver here."""
    server = servers[0]
    model = peft_model()
    cfg = {**config([server]), "servers": [{"url": server.url, "kind": "sglang", "lora_receiver": server.url}]}
    with WeightSync.from_config(cfg) as sync:
        sync.connect(model)
        start = sync.server_versions[server.url]
        for version in range(start + 1, start + 4):
            step(model, version)
            assert sync.publish(model, version).server_versions == {server.url: version}
            assert served(server.url, sync.adapter_name(version))[0] == generate(model, PROMPT, 8)[0]
            assert set(loaded(server)) == {f"pol-v{v}" for v in (version - 1, version) if v > 0}
    with pytest.raises(ConfigError, match="lora_receiver"):
        WeightSyncConfig.from_dict({"servers": [{"url": server.url, "kind": "sglang"}], "lora": "adapter"})


@pytest.mark.parametrize("info, fix", [
    ({"enable_lora": False}, "--enable-lora"),
    ({"enable_lora": True, "max_lora_rank": 2}, "--max-lora-rank 4"),
    ({"enable_lora": True, "lora_target_modules": ["q_proj"]}, "--lora-target-modules q_proj v_proj"),
    ({"enable_lora": True, "max_loaded_loras": 2}, "--max-loaded-loras 3"),
], ids=["disabled", "rank", "targets", "loaded"])
async def test_sglang_s_lora_settings_are_judged_at_connect(info, fix):
    from conftest import serve_every_path

    from aiohttp import web

    async def answer(request: web.Request) -> web.Response:
        return web.json_response(info)

    stand_in = await serve_every_path(answer)
    try:
        url = str(stand_in.make_url("")).rstrip("/")
        engine = make_engine(ServerConfig(url, kind="sglang", lora_receiver=url), 10)
        specs = tuple(TensorSpec(f"base_model.model.layers.0.{m}.lora_{s}.weight", torch.float32, (4, 8))
                      for m in ("q_proj", "v_proj") for s in "AB")
        assert fix in await engine.check_adapter(AdapterCheck("pol", {"r": 4}, specs, 3))
        await engine.close()
    finally:
        await stand_in.close()


async def test_vllm_without_runtime_lora_updating_is_refused_naming_the_variable():
    from conftest import serve_every_path

    from aiohttp import web

    async def not_found(request: web.Request) -> web.Response:
        return web.json_response({"detail": "Not Found"}, status=404)

    stand_in = await serve_every_path(not_found)
    try:
        engine = make_engine(ServerConfig(str(stand_in.make_url("")).rstrip("/"), kind="vllm"), 10)
        refusal = await engine.check_adapter(AdapterCheck("pol", {"r": 4}, (), 3))
        assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1" in refusal and "--enable-lora" in refusal
        await engine.close()
    finally:
        await stand_in.close()
