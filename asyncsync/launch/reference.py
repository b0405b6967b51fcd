"""Reference servers in child processes: the embedded servers of the GRPO demo, benchmarks and tests."""

from __future__ import annotations

import contextlib
import urllib.error
from email.message import Message
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.multiprocessing as mp

from asyncsync.protocol.arena import Staging
from asyncsync.launch.http import http_call, wait_healthy
from asyncsync.protocol.group import free_port
from asyncsync.models import ModelConfig, build_model
from asyncsync.receivers.reference.app import Faults

ModelFactory = Callable[..., torch.nn.Module]


def _serve(factory: ModelFactory, factory_args: tuple[Any, ...], host: str, port: int, token: str | None,
           faults: Faults, layout: str, staging: Staging) -> None:
    import logging

    from asyncsync.receivers.reference.app import run_server

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    run_server(factory(*factory_args), host, port, token, faults, layout=layout, staging=staging)


class ServerProcess:
    """A reference server in a spawned child process; always terminated (then killed) on exit.

    with ServerProcess(mixed_dtype_model, (cfg,)) as server:
        server.url  # http://127.0.0.1:PORT, healthy
    """

    def __init__(self, factory: ModelFactory = build_model, factory_args: tuple[Any, ...] = (ModelConfig(),),
                 token: str | None = None, host: str = "127.0.0.1", start_timeout_s: float = 120.0,
                 faults: Faults = Faults(), port: int | None = None, layout: str = "checkpoint",
                 staging: Staging = "device"):
        self.host, self.port, self.token = host, port or free_port(host), token
        self.url = f"http://{host}:{self.port}"
        self._start_timeout_s = start_timeout_s
        self.process = mp.get_context("spawn").Process(
            target=_serve, args=(factory, factory_args, host, self.port, token, faults, layout, staging), daemon=True
        )

    def start(self) -> ServerProcess:
        self.process.start()
        try:
            wait_healthy(self.url, self._start_timeout_s, f"reference server on port {self.port}", self._exited,
                         poll_s=0.2, token=self.token)
        except TimeoutError:
            self.stop()
            raise
        return self

    def _exited(self) -> str | None:
        return None if self.process.is_alive() else f"exited with code {self.process.exitcode}"

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def get(self, path: str, timeout: float = 60.0) -> Any:
        return self.call("GET", path, None, timeout)

    def post(self, path: str, body: Mapping[str, Any] | None, timeout: float = 60.0) -> Any:
        return self.call("POST", path, body, timeout)

    def call(self, method: str, path: str, body: Any, timeout: float = 60.0, raw: bytes | None = None) -> Any:
        """Blocking HTTP for tests: the decoded answer; ``urllib.error.HTTPError`` on 4xx/5xx."""
        status, answer = http_call(self.url, method, path, body, self.token, timeout_s=timeout, raw=raw)
        if status >= 400:
            raise urllib.error.HTTPError(self.url + path, status, str(answer), Message(), None)
        return answer


@contextlib.contextmanager
def running(servers: list[ServerProcess]) -> Iterator[list[ServerProcess]]:
    """Start every server; stop every one on exit, also when a start fails or on Ctrl-C."""
    try:
        for s in servers:
            s.start()
        yield servers
    finally:
        for s in servers:
            s.stop()
