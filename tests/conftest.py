"""Shared fixtures: reference servers in child processes, always stopped when the test ends."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
import torch

from asyncsync.models import ModelConfig
from asyncsync.testing import ServerProcess, mixed_dtype_model, running

# Small enough to start fast, large enough that several tensors exceed a 64 KiB bucket.
TINY = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fuzz-requests", type=int, default=2000,
                     help="bad requests the route fuzz test sends to a reference server (a longer run: 20000)")
    parser.addoption("--fuzz-seed", type=int, default=0, help="the route fuzz test's random seed")


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def two_servers() -> Iterator[list[ServerProcess]]:
    with running([ServerProcess(mixed_dtype_model, (TINY,)) for _ in range(2)]) as servers:
        yield servers


async def serve_every_path(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> TestServer:
    """An aiohttp server on loopback that hands every request, whatever its path, to ``handler``."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server


@dataclass
class Recorder:
    url: str
    calls: list[str]  # the paths asked for, in order


@pytest.fixture
async def recording_server() -> AsyncIterator[Recorder]:
    """A stand-in server that records every path it is asked for (answering as a reference server
    answers the first calls of a connect): tests that something fails before any server is contacted."""
    calls: list[str] = []

    async def record(request: web.Request) -> web.Response:
        calls.append(request.path)
        return web.json_response({"world_size": 1, "version": 0})

    server = await serve_every_path(record)
    try:
        yield Recorder(str(server.make_url("")).rstrip("/"), calls)
    finally:
        await server.close()
