"""SGLang's own weight-update code, taken from the sglang wheel, behind the reference server's SGLang
HTTP layer: a stand-in SGLang server whose scheduler, process groups and receive path are SGLang's.

The sglang package cannot be imported with torch alone (its ``__init__`` pulls in orjson, zmq,
transformers and more), so ``sglang_source`` downloads the wheel once (``pip download --no-deps
sglang==0.5.23`` into ~/.cache/asyncsync-test, or ``$ASYNCSYNC_TEST_CACHE``), unzips the files below,
and ``WheelScheduler`` compiles the pieces it needs from their source text:

    utils/common.py           init_custom_process_group (the group SGLang joins)
    utils/network.py          NetworkAddress (the tcp:// address it joins at)
    weight_sync/tensor_bucket.py                    FlattenedTensorBucket (the receive buffer), whole
    model_executor/model_runner_components/weight_updater.py
                              WeightUpdater: init/destroy of named groups, the receive, the load
    managers/tp_worker.py     BaseTpWorker: init/destroy as the scheduler calls them
    managers/scheduler_components/weight_updater.py
                              SchedulerWeightUpdaterManager: sessions, refusals and their messages

Stand-ins replace only what is not about weights: the model (``load_weights`` copies into a torch
model by name), the runtime context (no weight cache, no derived-weight caches), msgspec (a frozen
dataclass for the session record) and the reply structs. The HTTP side (what SGLang's tokenizer
manager adds) is ``asyncsync.receivers.reference.sglang_api.SglangApi``.
"""

from __future__ import annotations

import __future__
import ast
import asyncio
import dataclasses
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.multiprocessing as mp

from asyncsync.protocol.sglang import SGLANG_RELEASE
from asyncsync.protocol.specs import distinct_tensors
from asyncsync.testing import ServerProcess

CACHE = Path(os.environ.get("ASYNCSYNC_TEST_CACHE", Path.home() / ".cache" / "asyncsync-test"))
SRT = "sglang/srt/"
SOURCES = ("utils/common.py", "utils/network.py", "weight_sync/tensor_bucket.py",
           "model_executor/model_runner_components/weight_updater.py", "managers/tp_worker.py",
           "managers/scheduler_components/weight_updater.py", "managers/io_struct.py", "entrypoints/http_server.py")


class WheelUnavailable(RuntimeError):
    """The sglang wheel could not be had (no package registry here): tests using it skip."""


def sglang_source(release: str = SGLANG_RELEASE) -> Path:
    """A folder holding ``sglang/srt/...`` of the wheel's files in ``SOURCES``; downloads the wheel
    with pip the first time. Raises ``WheelUnavailable`` saying why when it cannot."""
    root = CACHE / f"sglang-{release}"
    if all((root / SRT / f).is_file() for f in SOURCES):
        return root
    wheels = CACHE / "wheels"
    found = sorted(wheels.glob(f"sglang-{release}-*.whl"))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", f"sglang=={release}", "-d", str(wheels),
               "--timeout", "20", "--retries", "1"]  # an unreachable registry fails in about a minute
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise WheelUnavailable(f"`{' '.join(cmd[2:8])}` did not finish: {e}") from e
        found = sorted(wheels.glob(f"sglang-{release}-*.whl"))
        if out.returncode != 0 or not found:
            tail = (out.stderr or out.stdout).strip().splitlines()[-3:]
            raise WheelUnavailable(f"`{' '.join(cmd[2:8])}` found no sglang {release} wheel: {' / '.join(tail)}")
    staging = Path(tempfile.mkdtemp(dir=CACHE, prefix=f".sglang-{release}-"))
    try:
        with zipfile.ZipFile(found[-1]) as wheel:
            for f in SOURCES:
                wheel.extract(SRT + f, staging)
        shutil.rmtree(root, ignore_errors=True)
        staging.rename(root)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return root


def compile_defs(path: Path, wanted: dict[str, tuple[str, ...] | None], namespace: dict[str, Any]) -> dict[str, Any]:
    """Compile the top-level functions and classes named in ``wanted`` from ``path`` into
    ``namespace`` (with ``from __future__ import annotations``, as SGLang's modules have it). A class
    mapped to method names becomes a plain class of just those methods (no bases, no decorators)."""
    tree = ast.parse(path.read_text(), str(path))
    body: list[ast.stmt] = []
    for node in tree.body:
        name = getattr(node, "name", None)
        if name not in wanted:
            continue
        methods = wanted[name]
        if isinstance(node, ast.ClassDef) and methods is not None:
            kept = [n for n in node.body if getattr(n, "name", None) in methods]
            missing = set(methods) - {n.name for n in kept}  # type: ignore[attr-defined]
            assert not missing, f"{path}: {name} has no {sorted(missing)} (a different SGLang release?)"
            node = ast.ClassDef(name, [], [], kept, [], **({"type_params": []} if sys.version_info >= (3, 12) else {}))
        body.append(node)
    assert {getattr(n, "name") for n in body} == set(wanted), f"{path}: not all of {sorted(wanted)} found"
    module = ast.fix_missing_locations(ast.Module(body, []))
    exec(compile(module, str(path), "exec", flags=__future__.annotations.compiler_flag, dont_inherit=True), namespace)
    return namespace


def load_tensor_bucket(root: Path) -> Any:
    """SGLang's ``tensor_bucket`` module, whole (it imports only dataclasses, typing and torch)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("sglang_wheel_tensor_bucket", root / SRT / "weight_sync/tensor_bucket.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # @dataclass looks its module up
    spec.loader.exec_module(module)
    return module


@dataclasses.dataclass(frozen=True)
class _WeightUpdateSession:
    """Stand-in for SGLang's msgspec ``_WeightUpdateSession`` (same fields)."""

    selector: str
    loaded_weights: bool = False


def _reply(**fields: Any) -> SimpleNamespace:
    """Stand-in for SGLang's ``*ReqOutput`` reply structs (``success`` and ``message``)."""
    return SimpleNamespace(**fields)


class _Model:
    """What SGLang's weight updater calls on a model: ``load_weights`` (by name, into ``weights``)."""

    def __init__(self, weights: dict[str, torch.Tensor]):
        self.weights = weights

    def load_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, tensor in named:
                self.weights[name].copy_(tensor)

    def modules(self) -> list[Any]:
        return []


class WheelScheduler:
    """The ``SglangScheduler`` of ``sglang_api`` run by SGLang's own code for one TP rank on CPU."""

    def __init__(self, root: Path, model: torch.nn.Module):
        if not torch.distributed.is_initialized():  # SGLang asserts a default group (its TP group)
            torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
        log = logging.getLogger("sglang")
        bucket = load_tensor_bucket(root)
        release = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:3] if x.isdigit())
        common = compile_defs(root / SRT / "utils/common.py", {"init_custom_process_group": None},
                              {"torch": torch, "torch_release": release})
        network = compile_defs(root / SRT / "utils/network.py", {"_is_ipv6": None, "_wrap": None, "NetworkAddress": None},
                               {"dataclass": dataclasses.dataclass, "socket": __import__("socket"),
                                "ipaddress": __import__("ipaddress")})
        runner = compile_defs(
            root / SRT / "model_executor/model_runner_components/weight_updater.py",
            {"WeightUpdater": ("init_weights_update_group", "destroy_weights_update_group", "receive_weights_from_distributed",
                               "_receive_bucketed_weights_from_distributed", "load_weights_from_distributed",
                               "_assert_weight_cache_inactive")},
            {"torch": torch, "logger": log, "init_custom_process_group": common["init_custom_process_group"],
             "NetworkAddress": network["NetworkAddress"], "FlattenedTensorBucket": bucket.FlattenedTensorBucket,
             "get_model": lambda: SimpleNamespace(weight_cache_mode="off"),
             "_unsupported_derived_weight_cache_error": lambda model=None: None},
        )
        worker = compile_defs(root / SRT / "managers/tp_worker.py",
                              {"BaseTpWorker": ("init_weights_update_group", "destroy_weights_update_group")}, {})
        scheduler = compile_defs(
            root / SRT / "managers/scheduler_components/weight_updater.py",
            {"_parse_runner_selector": None,
             "SchedulerWeightUpdaterManager": ("update_weights_from_distributed", "begin_weight_update", "end_weight_update",
                                               "init_weights_update_group", "destroy_weights_update_group",
                                               "flush_cache_after_weight_update", "record_weight_version_after_update",
                                               "_select_runners", "_observe_weight_load")},
            {"torch": torch, "time": __import__("time"), "contextmanager": contextmanager, "logger": log,
             "msgspec": SimpleNamespace(structs=SimpleNamespace(replace=dataclasses.replace)),
             "_WeightUpdateSession": _WeightUpdateSession, **{name: _reply for name in (
                 "UpdateWeightsFromDistributedReqOutput", "BeginWeightUpdateReqOutput", "EndWeightUpdateReqOutput",
                 "InitWeightsUpdateGroupReqOutput", "DestroyWeightsUpdateGroupReqOutput")}},
        )
        self.weights = distinct_tensors(model.state_dict(keep_vars=True))
        loaded = _Model(self.weights)
        self.updater = runner["WeightUpdater"]()
        self.updater.tp_rank, self.updater.device, self.updater._model_update_group = 0, "cpu", {}
        self.updater.get_model = lambda: loaded
        # The session's loader hooks (restoring and re-quantizing in-place-quantized weights): nothing to do here.
        self.updater.begin_weight_update = lambda: None
        self.updater.end_weight_update = lambda run_post_load: None
        tp_worker = worker["BaseTpWorker"]()
        tp_worker.model_runner = SimpleNamespace(weight_updater=self.updater)
        tp_worker.weight_update_runners = lambda: [("target", tp_worker.model_runner)]
        self.manager = scheduler["SchedulerWeightUpdaterManager"]()
        self.manager.tp_worker, self.manager.draft_worker, self.manager.metrics_collector = tp_worker, None, None
        self.manager.flush_cache = lambda empty_cache=False: True  # no radix cache here
        self.manager.scheduler = SimpleNamespace(record_weight_version_change=self._record_version)
        self.manager._session, self.manager.tp_cpu_group = None, torch.distributed.group.WORLD
        self.scheduler_version: str | None = None

    def _record_version(self, new_version: str | None) -> None:
        if new_version is not None:
            self.scheduler_version = new_version

    @property
    def session_open(self) -> bool:
        return self.manager._session is not None

    @property
    def groups(self) -> list[str]:
        return list(self.updater._model_update_group)

    def _answer(self, method: str, req: Any) -> tuple[bool, str]:
        reply = getattr(self.manager, method)(req)
        return reply.success, reply.message

    def init_weights_update_group(self, req: Any) -> tuple[bool, str]:
        return self._answer("init_weights_update_group", req)

    def destroy_weights_update_group(self, req: Any) -> tuple[bool, str]:
        return self._answer("destroy_weights_update_group", req)

    def begin_weight_update(self, req: Any) -> tuple[bool, str]:
        return self._answer("begin_weight_update", req)

    def end_weight_update(self, req: Any) -> tuple[bool, str]:
        return self._answer("end_weight_update", req)

    def update_weights_from_distributed(self, req: Any) -> tuple[bool, str]:
        return self._answer("update_weights_from_distributed", req)

    def close(self) -> None:
        for name in self.groups:
            self.updater.destroy_weights_update_group(name)


def serve(root: str, host: str, port: int) -> None:
    """Child-process entry: SGLang's code behind ``SglangApi`` on ``host:port``, for a test model.
    Test-only routes: ``/health``, ``/weights/digest`` (the served weights), ``GET /test/groups``
    (SGLang's group names) and ``POST /test/refuse_next_update`` (``fakes.RefuseBeforeReceive``)."""
    import hashlib

    from aiohttp import web

    from asyncsync.receivers.reference.receiver import tensor_bytes
    from asyncsync.receivers.reference.sglang_api import SglangApi, model_info, starlette_errors
    from asyncsync.testing import mixed_dtype_model
    from conftest import TINY
    from fakes import RefuseBeforeReceive

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    model = mixed_dtype_model(TINY)
    wheel = WheelScheduler(Path(root), model)
    refusing = RefuseBeforeReceive(wheel)
    pool = ThreadPoolExecutor(1, thread_name_prefix="sglang-scheduler")  # SGLang's one scheduler thread

    async def run_comm(fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    api = SglangApi(refusing, run_comm, model_info(model))

    async def health(_r: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def digest(_r: web.Request) -> web.Response:
        sums = await run_comm(lambda: {n: hashlib.sha256(tensor_bytes(t)).hexdigest() for n, t in wheel.weights.items()})
        return web.json_response({"digest": sums, "scheduler_version": wheel.scheduler_version})

    async def groups(_r: web.Request) -> web.Response:
        return web.json_response({"groups": await run_comm(lambda: wheel.groups)})

    async def refuse(_r: web.Request) -> web.Response:
        refusing.arm()
        return web.json_response({"armed": True})

    app = web.Application(middlewares=[starlette_errors])
    app.add_routes([*api.routes(), web.get("/health", health), web.get("/weights/digest", digest),
                    web.get("/test/groups", groups), web.post("/test/refuse_next_update", refuse)])
    web.run_app(app, host=host, port=port, print=None, access_log=None)


class WheelServer(ServerProcess):
    """``serve`` in a spawned child process, started, stopped and queried like a reference server."""

    def __init__(self, root: Path):
        super().__init__()
        self.process = mp.get_context("spawn").Process(target=serve, args=(str(root), self.host, self.port), daemon=True)
