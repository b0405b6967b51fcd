"""asyncsync against SGLang's own code, taken from the sglang 0.5.23 wheel (tests/sglang_wheel.py).

The wheel is downloaded once with pip into a cache; without a package registry these tests skip.
A child process serves SGLang's scheduler, named process groups (``init_custom_process_group``) and
receive path (``FlattenedTensorBucket``) behind the reference server's SGLang HTTP layer, and
asyncsync's real trainer path (``WeightSync``, blocking and async) syncs to it: bit-exact versions,
the live version read back by the client, a refusal before the receive, a restarted trainer. The
message structs, routes and bucket checks of ``asyncsync.protocol.sglang`` are compared with the
wheel's source.
"""

from __future__ import annotations

import ast
import dataclasses
import time
import typing
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from asyncsync import WeightSync
from asyncsync.protocol import sglang as messages
from asyncsync.protocol.sglang import SGLANG_RELEASE, UpdateWeightsFromDistributed, consumed
from asyncsync.receivers.reference.sglang_api import SglangApi
from asyncsync.testing import mixed_dtype_model

from conftest import TINY
from helpers import Trainer, call, digest, live_version, sglang_config
from sglang_wheel import SRT, WheelServer, WheelUnavailable, load_tensor_bucket, sglang_source

STRUCTS = [cls for cls in vars(messages).values()
           if isinstance(cls, type) and issubclass(cls, messages.SglangRequest) and cls.STRUCT]


@pytest.fixture(scope="module")
def sglang_root() -> Path:
    try:
        return sglang_source()
    except WheelUnavailable as e:
        pytest.skip(f"needs SGLang's own code from the sglang {SGLANG_RELEASE} wheel, which could not be downloaded "
                    f"(no package registry?): {e}")


@pytest.fixture(scope="module")
def server(sglang_root: Path) -> Iterator[WheelServer]:
    with WheelServer(sglang_root) as started:
        yield started


def drift(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """A training step's worth of change to every parameter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_((torch.randn(p.shape, generator=g) * 0.05).to(p.dtype))
    return model


def groups(server: WheelServer) -> list[str]:
    return server.get("/test/groups")["groups"]


# -- the wheel's source, read ---------------------------------------------------------------------

def struct_fields(root: Path, name: str) -> dict[str, tuple[str, str | None]]:
    """``name``'s own fields in SGLang's io_struct.py: field -> (annotation, default) as source text."""
    tree = ast.parse((root / SRT / "managers/io_struct.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
    return {n.target.id: (ast.unparse(n.annotation), ast.unparse(n.value) if n.value else None)
            for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def sglang_type(tp: typing.Any) -> str:
    """How SGLang spells the type of one of our fields (tuples are its lists)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is tuple:
        return f"List[{sglang_type(args[0])}]"
    if origin is typing.Literal:
        return f"Literal[{', '.join(repr(a) for a in args)}]"
    if type(None) in args:
        return f"Optional[{sglang_type(next(a for a in args if a is not type(None)))}]"
    return tp.__name__


@pytest.mark.parametrize("message", STRUCTS, ids=lambda c: c.STRUCT)
def test_each_message_is_the_struct_sglang_defines(sglang_root, message):
    theirs = struct_fields(sglang_root, message.STRUCT)
    hints = typing.get_type_hints(message)
    ours = {f.name: (sglang_type(hints[f.name]), None if f.default is dataclasses.MISSING else repr(f.default))
            for f in dataclasses.fields(message)}
    assert ours == theirs


def test_routes_and_methods_are_sglangs(sglang_root):
    tree = ast.parse((sglang_root / SRT / "entrypoints/http_server.py").read_text())
    theirs: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        for d in getattr(node, "decorator_list", []):
            if (isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and getattr(d.func.value, "id", "") == "app"
                    and d.args and isinstance(d.args[0], ast.Constant)):
                path = d.args[0].value
                if d.func.attr in ("get", "post", "put"):
                    theirs.setdefault(path, set()).add(d.func.attr.upper())
                elif d.func.attr == "api_route":
                    (methods,) = [ast.literal_eval(k.value) for k in d.keywords if k.arg == "methods"]
                    theirs.setdefault(path, set()).update(methods)
    ours: dict[str, set[str]] = {}
    for route in SglangApi(None, None, {}).routes():  # type: ignore[arg-type]
        ours.setdefault(route.path, set()).add(route.method)
    assert {path: theirs.get(path) for path in ours} == ours
    assert "/get_weight_version" not in theirs and "/weight_version" not in theirs


LAYOUTS = [
    (["w", "b"], ["float32", "bfloat16"], [[4, 6], [3]]),
    (["a", "b"], ["float16", "float32"], [[1], [1]]),      # b would start at byte 2
    (["a", "b"], ["float32"], [[1], [1]]),                  # lists of different lengths
    (["a"], ["torch.float32"], [[2]]),                      # not an attribute of torch
    (["a"], ["float32"], [[2, -1]]),
    ([], [], []),
    (["s", "e"], ["float32", "int64"], [[], [0]]),          # a 0-dim tensor and an empty one
]


@pytest.mark.parametrize("names, dtypes, shapes", LAYOUTS)
def test_bucket_layouts_are_judged_as_sglang_judges_them(sglang_root, names, dtypes, shapes):
    bucket = load_tensor_bucket(sglang_root).FlattenedTensorBucket
    req = UpdateWeightsFromDistributed(tuple(names), tuple(dtypes), tuple(tuple(s) for s in shapes))
    try:
        theirs: object = bucket.empty(names, dtypes, shapes, "cpu").get_flattened_tensor().numel()
    except Exception as e:
        theirs = (type(e), str(e))
    try:
        ours: object = req.flattened_nbytes()
    except Exception as e:
        ours = (type(e), str(e))
    assert ours == theirs


# -- asyncsync's trainer against SGLang's code ----------------------------------------------------

@pytest.mark.parametrize("async_weight_update, versions", [(False, (1, 2, 3)), (True, (4, 5, 6))], ids=["blocking", "async"])
def test_versions_arrive_bit_exact_and_the_client_reads_the_live_version(server, async_weight_update, versions):
    model = mixed_dtype_model(TINY)
    with WeightSync(sglang_config(server.url, async_weight_update=async_weight_update)) as sync:
        sync.connect(model)
        (name,) = groups(server)
        for version in versions:
            sync.wait_snapshot()
            result = sync.publish(drift(model, version), version)
            if result is not None:
                assert result.server_versions == {server.url: version}, result.failures
                assert server.get("/weights/digest")["digest"] == digest(model)
        sync.close()
        assert sync.server_versions == {server.url: versions[-1]}, sync.events
        assert sync.errors == [] and [e.kind for e in sync.events] == []
    assert server.get("/weights/digest") == {"digest": digest(model), "scheduler_version": str(versions[-1])}
    assert live_version(server.url) == str(versions[-1])
    assert name not in groups(server), "close() destroys the server's group"


def test_a_refusal_before_the_receive_costs_no_collective_deadline(server):
    model = mixed_dtype_model(TINY)
    cfg = sglang_config(server.url, deadlines={"collective_s": 60, "broadcast_floor_s": 30, "rendezvous_s": 60, "http_s": 30})
    with WeightSync(cfg) as sync:
        sync.connect(model)
        server.post("/test/refuse_next_update", {})
        start = time.monotonic()
        result = sync.publish(drift(model, 7), 7)
        took = time.monotonic() - start
        assert took < 10, f"the refused version held the trainer {took:.1f}s (a broadcast may take 30 s)"
        failure = result.failures[server.url]
        assert "Failed to receive weights: Group" in failure and "Please call `init_weights_update_group` first" in failure
        assert [(e.kind, e.server) for e in sync.events] == [("refused", server.url)]
        assert len(groups(server)) == 1 and groups(server)[0].split(".")[1] == "2", "a new epoch, a new group"
        assert sync.publish(drift(model, 8), 8).server_versions == {server.url: 8}
    assert server.get("/weights/digest")["digest"] == digest(model)


def test_a_refusal_after_the_receive_keeps_the_group(server):
    """The model refuses a tensor it does not have after the bucket arrived (SGLang's loader): the
    client posts the rest of the version, so the group stays aligned and is kept."""
    model = mixed_dtype_model(TINY)
    trainer = Trainer(sglang_config(server.url))
    try:
        before = groups(server)
        named = {**drift(model, 9).state_dict(), "no.such.tensor": torch.zeros(4)}
        failure = trainer.publish(named, 9)[server.url]
        assert "Failed to update parameter online" in str(failure) and consumed(str(failure).split("HTTP 400: ")[1])
        assert groups(server) == before and trainer.fleet.epochs.current.number == 1
        assert trainer.publish(dict(drift(model, 10).state_dict()), 10) == {server.url: 10}
        assert server.get("/weights/digest")["digest"] == digest(model)
    finally:
        trainer.close()


def test_a_restarted_trainer_meets_no_group_or_session_of_the_one_before(server):
    model = mixed_dtype_model(TINY)
    first = Trainer(sglang_config(server.url))
    assert first.publish(dict(drift(model, 11).state_dict()), 11) == {server.url: 11}
    (dead,) = groups(server)
    # The first trainer dies in the middle of a version: its group and its open session stay behind.
    assert call(server.url, "POST", "/begin_weight_update", {})[0] == 200
    first.fleet.epochs.drop()
    for engine in first.fleet.engines:
        first.control.run(engine.http.close())
    first.control.close()

    with WeightSync(sglang_config(server.url)) as second:
        second.connect(model)
        (mine,) = set(groups(server)) - {dead}
        assert mine.split(".")[2] != dead.split(".")[2], "a new trainer session, a new group name"  # <name>.<epoch>.<random>
        assert second.publish(drift(model, 12), 12).server_versions == {server.url: 12}
    assert server.get("/weights/digest")["digest"] == digest(model)
    assert groups(server) == [dead], "the closed trainer's group is destroyed; the dead one's stays"
    assert call(server.url, "POST", "/destroy_weights_update_group", {"group_name": dead}) == (
        200, {"success": True, "message": "Succeeded to destroy custom process group."})
