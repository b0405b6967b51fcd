"""Shared fixtures: reference servers in child processes, always stopped when the test ends."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
import torch

from asyncsync.models import ModelConfig
from asyncsync.testing import ServerProcess, mixed_dtype_model, running

# Small enough to start fast, large enough that several tensors exceed a 64 KiB bucket.
TINY = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)


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
