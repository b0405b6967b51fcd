"""The LoRA routes under hostile input (found by ``benchmarks/fuzz.py``): an adapter is loaded only
from a directory the server wrote under its adapter root, a damaged one is refused, and an adapter
config's ``rank_pattern`` is never compiled as an arbitrary regular expression. Each answer is a
short 4xx and the server keeps serving the same tokens."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator

import pytest
import torch

from asyncsync.models import build_model
from asyncsync.protocol.lora import CONFIG_FILE, LORA_ROOT, PEFT_PREFIX, WEIGHTS_FILE, AdapterCheck, adapter_dir
from asyncsync.protocol.wire import MAX_ERROR_CHARS, WireError
from asyncsync.receivers.reference.app import ReferenceServer

from conftest import TINY
from helpers import ThreadedServer, call

GREEDY = {"prompt": [5, 6, 7], "max_new_tokens": 4}
LOAD_ROUTES = ["/v1/load_lora_adapter", "/load_lora_adapter"]


@pytest.fixture(scope="module")
def server() -> Iterator[ThreadedServer]:
    with ThreadedServer(ReferenceServer(build_model(TINY))) as s:
        yield s


@pytest.fixture
def slot() -> Iterator[str]:
    """A slot of the adapter root this test writes into by hand (removed after)."""
    name = f"test-{os.getpid()}-{time.monotonic_ns()}"
    yield name
    shutil.rmtree(os.path.join(LORA_ROOT, name), ignore_errors=True)


def adapter_like(folder: str, weights: bytes) -> None:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, CONFIG_FILE), "w") as f:
        json.dump({"r": 2, "peft_type": "LORA", "target_modules": ["q_proj"], "lora_alpha": 4}, f)
    with open(os.path.join(folder, WEIGHTS_FILE), "wb") as f:
        f.write(weights)


def assert_still_serving(server: ThreadedServer, tokens: list[list[int]]) -> None:
    assert call(server.url, "POST", "/generate", GREEDY)[1]["completions"] == tokens
    assert call(server.url, "GET", "/v1/models")[1]["data"] == [{"id": "base", "object": "model"}], "nothing loaded"


@pytest.mark.parametrize("route", LOAD_ROUTES)
@pytest.mark.parametrize("path", [
    "/", "/etc", ".", "gpt2", "some-org/some-model", LORA_ROOT, os.path.join(LORA_ROOT, "..", "..", "etc"),
    adapter_dir("fuzz-slot", "fz", 9) + "/../../..", adapter_dir("fuzz-slot", "fz", 9),  # under the root, not written
    "x" * 5000, "a\x00b", "\ud800",
])
def test_an_adapter_path_out_of_the_root_or_never_written_is_refused_before_peft_sees_it(server, route, path):
    """Before: PEFT was handed any path (a 500 for most; a model hub id would be fetched; any
    adapter directory on the host loaded)."""
    tokens = call(server.url, "POST", "/generate", GREEDY)[1]["completions"]
    status, body = call(server.url, "POST", route, raw=json.dumps({"lora_name": "fz-v9", "lora_path": path}).encode())
    assert status == 400, body
    assert len(json.dumps(body)) < MAX_ERROR_CHARS + 200
    assert "lora_path" in json.dumps(body)
    assert_still_serving(server, tokens)


@pytest.mark.parametrize("route", LOAD_ROUTES)
def test_a_link_in_the_root_that_leads_out_of_it_is_refused(server, slot, tmp_path, route):
    outside = tmp_path / "elsewhere"
    adapter_like(str(outside), b"\x00" * 16)
    os.makedirs(os.path.join(LORA_ROOT, slot))
    os.symlink(outside, adapter_dir(slot, "fz", 1))
    tokens = call(server.url, "POST", "/generate", GREEDY)[1]["completions"]
    status, body = call(server.url, "POST", route, {"lora_name": "fz-v1", "lora_path": adapter_dir(slot, "fz", 1)})
    assert status == 400 and "loads only the adapter directories it wrote" in json.dumps(body), body
    assert_still_serving(server, tokens)


@pytest.mark.parametrize("route", LOAD_ROUTES)
def test_a_damaged_adapter_directory_in_the_root_is_refused_not_a_500(server, slot, route):
    """Before: whatever PEFT or safetensors raised (here a weights file of garbage, or tensors that
    do not fit the model) was a 500, and PEFT had already injected its layers into the model."""
    from safetensors.torch import save_file

    tokens = call(server.url, "POST", "/generate", GREEDY)[1]["completions"]
    adapter_like(adapter_dir(slot, "fz", 1), b"not a safetensors file" * 10)
    adapter_like(adapter_dir(slot, "fz", 2), b"")
    save_file({f"{PEFT_PREFIX}model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(2, 7),
               f"{PEFT_PREFIX}model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(64, 2)},
              os.path.join(adapter_dir(slot, "fz", 2), WEIGHTS_FILE))
    for version in (1, 2):
        status, body = call(server.url, "POST", route, {"lora_name": f"fz-v{version}",
                                                        "lora_path": adapter_dir(slot, "fz", version)})
        why = "no adapter this server can load" if version == 1 else "does not fit the served model"
        assert status == (409 if route.startswith("/v1/") else 400) and why in json.dumps(body), (status, body)  # SGLang: 400
    assert_still_serving(server, tokens)
    assert not any("lora" in n for n, _ in server.server.model.named_modules()), "PEFT injected nothing"


def check(config: dict) -> dict:
    spec = [f"{PEFT_PREFIX}model.layers.0.self_attn.q_proj.lora_A.weight", "float32", [2, 64]]
    return {"adapter_check": {"name": "fz", "config": {"r": 2, **config}, "specs": [spec], "loaded": 1}}


@pytest.mark.parametrize("config", [
    {"rank_pattern": {"(": 2}},                      # before: re.error, a 500
    {"rank_pattern": {".*.*.*.*.*.*.*=": 2}},        # before: backtracking that held the event loop for minutes
    {"rank_pattern": {"q_proj\n": 2}}, {"rank_pattern": {"q_proj": "8"}}, {"rank_pattern": {"q_proj": 2**70}},
    {"rank_pattern": [1]}, {"alpha_pattern": {"q_proj": float("nan")}}, {"r": 2**70},
])
def test_an_adapter_config_pattern_that_is_no_module_name_is_refused_at_once(server, config):
    with pytest.raises(WireError):
        AdapterCheck.from_json(check(config))
    start = time.monotonic()
    status, body = call(server.url, "POST", "/check_adapter", raw=json.dumps(check(config)).encode())
    assert status == 400 and time.monotonic() - start < 2.0, body
    assert call(server.url, "GET", "/health")[0] == 200


def test_a_name_with_a_trailing_newline_is_no_path_component():
    """``$`` matches before a final newline: names are matched whole."""
    with pytest.raises(WireError):
        AdapterCheck.from_json({"adapter_check": {**check({})["adapter_check"], "name": "fz\n"}})
    assert AdapterCheck.from_json(check({"rank_pattern": {"q_proj": 4}})).rank == 4
