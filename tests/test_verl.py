"""asyncsync's checkpoint engine under verl 0.9.1's own manager and workers, on a real local Ray cluster.

verl's ``CheckpointEngineManager`` (and asyncsync's ``AsyncsyncCheckpointManager``) drive two actor
ranks (``tests/verl_workers.ShardedActor``: the full tensors produced collectively, as FSDP's
``full_tensor()`` would) and verl's real ``CheckpointEngineWorker`` on each rollout worker, with a
recording server adapter in place of verl's CUDA-IPC vLLM one, all in ``RayWorkerGroup``s on
``RayResourcePool(use_gpu=False)``. Selected with ``-m verl`` (scripts/test_verl.sh).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.verl, pytest.mark.timeout(600)]

TESTS = Path(__file__).resolve().parent
UNVERIFIED = pytest.mark.skip(reason="written, not yet seen passing on this machine (issue 40 follow-up: see docs/verl.md)")
FAST = {"deadlines": {"rendezvous_s": 10, "collective_s": 10, "http_s": 10, "broadcast_floor_s": 1}}
# the data-plane broadcast, as to rollout workers on other hosts: on this host they would map each version
# from shared memory, where nothing crosses a wire to corrupt
WIRE = {"transport": "collective"}
FLIPPABLE = {**WIRE, "delta": "off"}  # whole buckets, packed where tests/staging_faults.FlipNextBucket flips one


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real local Ray cluster (not local mode) and a tiny Qwen2 saved as verl reads a model."""
    pytest.importorskip("verl", reason="verl is not installed here: run scripts/test_verl.sh")
    import ray

    from asyncsync.models import ModelConfig, build_model

    model_dir = tmp_path_factory.mktemp("qwen2-verl")
    build_model(ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                            num_kv_heads=2, dtype="float32")).save_pretrained(model_dir)
    path = os.pathsep.join([str(TESTS), str(TESTS.parent)])
    ray.init(num_cpus=8, include_dashboard=False, _node_ip_address="127.0.0.1", runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}})
    try:
        yield str(model_dir)
    finally:
        ray.shutdown()  # every worker process of the cluster ends here, whatever happened


class Job:
    """Two actor ranks, ``rollouts`` single-worker replicas and a manager of verl's or asyncsync's."""

    def __init__(self, model_dir: str, rollouts: int = 2, manager: str = "verl", **weight_sync: Any):
        import ray
        from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
        from verl.workers.config import CheckpointEngineConfig, HFModelConfig, RolloutConfig

        import verl_workers

        kwargs = {"model": model_dir, "deadline_s": 60, "weight_sync": {**FAST, "bucket_bytes": "64KiB", **weight_sync}}
        self.engine = CheckpointEngineConfig(backend="asyncsync", custom_backend_module="asyncsync.integrations.verl",
                                             engine_kwargs={"asyncsync": kwargs})
        rollout_config = RolloutConfig(name="vllm", checkpoint_engine=self.engine)
        model_config = HFModelConfig(path=model_dir, load_tokenizer=False)
        self.groups: list[Any] = []
        self.actor = RayWorkerGroup(
            resource_pool=RayResourcePool(process_on_nodes=[2], use_gpu=False, max_colocate_count=1),
            ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(verl_workers.ShardedActor), model_dir=model_dir,
                                                   checkpoint_engine=self.engine), device_name="cpu")
        self.groups.append(self.actor)
        self.rollout = RayWorkerGroup(
            resource_pool=RayResourcePool(process_on_nodes=[rollouts], use_gpu=False, max_colocate_count=1),
            ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(verl_workers.RecordingRollout),
                                                   rollout_config=rollout_config, model_config=model_config),
            device_name="cpu")
        self.groups.append(self.rollout)
        self.replicas = [verl_workers.Replica(replica_rank=i, config=rollout_config, model_config=model_config)
                         for i in range(rollouts)]
        async def hybrid() -> None:
            await asyncio.gather(*[r.init_hybrid(self.rollout) for r in self.replicas])

        asyncio.run(hybrid())
        cls = self.manager_class(manager)
        self.manager = cls(config=self.engine, actor_wg=self.actor, replicas=list(self.replicas))

    @staticmethod
    def manager_class(which: str) -> type:
        if which == "verl":
            from verl.checkpoint_engine import CheckpointEngineManager

            return CheckpointEngineManager
        from asyncsync.integrations.verl import AsyncsyncCheckpointManager

        return AsyncsyncCheckpointManager

    def trained(self) -> dict[str, Any]:
        return self.actor.full_digest()[0]

    def received(self) -> list[dict[str, Any]]:
        import ray

        return [ray.get(w.received.remote()) for w in self.rollout.workers]

    def close(self) -> None:
        import ray

        for group in self.groups:
            for worker in group.workers:
                ray.kill(worker, no_restart=True)


@pytest.fixture
def job_factory(cluster: str) -> Iterator[Any]:
    jobs: list[Job] = []

    def make(**kwargs: Any) -> Job:
        jobs.append(Job(cluster, **kwargs))
        return jobs[-1]

    try:
        yield make
    finally:
        for job in jobs:
            job.close()


def test_every_sync_reaches_every_rollout_worker_byte_for_byte_under_verls_manager(job_factory):
    job = job_factory(**WIRE)
    versions, labels = [], [0, 1, 1, None, 3]
    for k, label in enumerate(labels):
        job.actor.step(seed=k, every=1 if k < 2 else 50)  # dense, then sparse: deltas pay
        metrics = job.manager.update_weights(global_steps=label)
        trained = job.trained()
        for worker in job.received():
            assert worker["digest"] == trained, f"sync {k}: a rollout worker holds other bytes than the trainer"
        versions.append(metrics["asyncsync/version"])
        assert metrics["asyncsync/groups_formed"] == 1, "the sync's groups are formed once and kept"
        assert metrics["asyncsync/failed_workers"] == 0 and metrics["asyncsync/bytes"] > 0
    assert versions == sorted(set(versions)), f"global_steps is a label; versions only increase: {versions}"
    assert all(w["labels"] == labels for w in job.received())


@UNVERIFIED
def test_a_corrupted_bucket_yields_nothing_and_the_old_weights_stay(job_factory):
    job = job_factory(**FLIPPABLE)
    job.actor.step(seed=1)
    job.manager.update_weights(global_steps=1)
    before = job.received()
    job.actor.configure(flip_next_bucket=True)
    job.actor.step(seed=2)
    with pytest.raises(Exception, match=r"checksum mismatch"):
        job.manager.update_weights(global_steps=2)
    after = job.received()
    assert [w["digest"] for w in after] == [w["digest"] for w in before], "a refused version changed nothing"
    assert [w["labels"] for w in after] == [[1], [1]], "the adapter got nothing of the refused version"
    job.actor.step(seed=3)
    job.manager.update_weights(global_steps=3)
    assert all(w["digest"] == job.trained() for w in job.received()), "the next sync applies"


@UNVERIFIED
def test_a_rollout_killed_mid_sync_raises_without_hanging_and_the_next_sync_succeeds_after_remove_replicas(job_factory):
    import ray

    job = job_factory()
    job.actor.step(seed=1)
    job.manager.update_weights(global_steps=1)
    job.actor.configure(delay_s=0.02)  # the version takes a second or so to produce
    job.actor.step(seed=2)
    outcome: dict[str, Any] = {}

    def sync() -> None:
        try:
            outcome["metrics"] = job.manager.update_weights(global_steps=2)
        except Exception as e:
            outcome["error"] = e

    thread = threading.Thread(target=sync, daemon=True)
    start = time.monotonic()
    thread.start()
    time.sleep(0.5)
    victim = job.replicas[1]
    ray.kill(victim.workers[0], no_restart=True)
    thread.join(150)
    assert not thread.is_alive(), "the sync hung after a rollout worker was killed"
    assert "error" in outcome, f"verl's manager must raise for a dead worker, got {outcome}"
    assert "actor died" in str(outcome["error"]).lower() or "ActorDiedError" in type(outcome["error"]).__name__, outcome
    job.rollout.workers.remove(victim.workers[0])
    job.groups.append(type("Dead", (), {"workers": []})())
    job.manager.remove_replicas([victim])
    job.actor.configure(delay_s=0.0)
    job.actor.step(seed=3)
    metrics = job.manager.update_weights(global_steps=3)
    assert metrics["asyncsync/groups_formed"] == 2, "the groups are formed again for the new set of workers"
    assert job.received()[0]["digest"] == job.trained()
    assert time.monotonic() - start < 180


@UNVERIFIED
def test_a_backend_that_does_not_drain_the_generator_on_every_rank_fails(job_factory):
    job = job_factory()
    job.actor.configure(drain=False)  # rank 1 skips the generator: rank 0's all-gathers have no peer
    job.actor.step(seed=1)
    start = time.monotonic()
    with pytest.raises(Exception, match=r"(?i)timed out|connection|gloo"):
        job.manager.update_weights(global_steps=1)
    assert time.monotonic() - start < 150


@UNVERIFIED
@pytest.mark.parametrize("async_mode", [False, True], ids=["blocking", "async"])
def test_asyncsyncs_manager_forms_the_group_once_loads_every_version_and_survives_a_refusal(job_factory, async_mode):
    job = job_factory(manager="asyncsync", async_weight_update=async_mode, **FLIPPABLE)
    for k in range(3):
        job.actor.step(seed=10 + k)
        metrics = job.manager.update_weights(global_steps=k)
        if async_mode:
            assert "asyncsync/sync_s" not in metrics, "an async sync returns once the version is copied"
            assert job.manager.drain() == {}
        assert all(w["digest"] == job.trained() for w in job.received())
        assert metrics["asyncsync/groups_formed"] == 1
    if async_mode:
        return
    before = job.received()
    job.actor.configure(flip_next_bucket=True)
    job.actor.step(seed=20)
    with pytest.raises(Exception, match="no rollout worker loaded"):
        job.manager.update_weights(global_steps=3)
    assert job.received() == before, "the refused version: every worker keeps its weights"
    assert set(job.manager.last_failures) == {0, 1} and all("checksum mismatch" in w for w in job.manager.last_failures.values())
