"""asyncsync's checkpoint engine under verl 0.9.1's own manager and workers, on a real local Ray cluster.

verl's ``CheckpointEngineManager`` (and asyncsync's ``AsyncsyncCheckpointManager``) drive two actor
ranks (``tests/verl_workers.ShardedActor``: the full tensors produced collectively, as FSDP's
``full_tensor()`` would) and verl's real ``CheckpointEngineWorker`` on each rollout worker, with a
recording server adapter in place of verl's CUDA-IPC vLLM one, all in ``RayWorkerGroup``s on
``RayResourcePool(use_gpu=False)``. Selected with ``-m verl`` (scripts/test_verl.sh).

Every test is bounded: each sync's waits have deadlines (``FAST``, ``deadline_s``, the actor group's
timeout), each job's actors and placement groups are removed when its test ends, and the Ray cluster,
started here on free ports in a directory of its own, is shut down with the module, pass or fail.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.verl, pytest.mark.timeout(300)]

TESTS = Path(__file__).resolve().parent
FAST = {"deadlines": {"rendezvous_s": 10, "collective_s": 10, "http_s": 10, "broadcast_floor_s": 1}}
# the data-plane broadcast, as to rollout workers on other hosts: on this host they would map each version
# from shared memory, where nothing crosses a wire to corrupt and no delta is sent
WIRE = {"transport": "collective"}
FLIPPABLE = {**WIRE, "delta": "off"}  # whole buckets, packed where tests/staging_faults.FlipNextBucket flips one
ROLLOUT_DEADLINE_S = 30  # engine_kwargs.asyncsync.deadline_s: how long a rollout worker waits for word of a sync


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real local Ray cluster of its own (not local mode, never one already running) and a tiny
    Qwen2 saved as verl reads a model."""
    pytest.importorskip("verl", reason="verl is not installed here: run scripts/test_verl.sh")
    import ray

    from asyncsync.models import ModelConfig, build_model

    model_dir = tmp_path_factory.mktemp("qwen2-verl")
    build_model(ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                            num_kv_heads=2, dtype="float32")).save_pretrained(model_dir)
    path = os.pathsep.join([str(TESTS), str(TESTS.parent)])
    ray_dir = tempfile.mkdtemp(prefix="asyncsync-ray-")  # short: Ray's socket paths live under it
    ray.init(address="local", num_cpus=8, include_dashboard=False, _temp_dir=ray_dir, _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}})
    try:
        yield str(model_dir)
    finally:
        ray.shutdown()  # every worker process of the cluster ends here, whatever happened
        shutil.rmtree(ray_dir, ignore_errors=True)


class Job:
    """Two actor ranks, ``rollouts`` single-worker replicas and a manager of verl's or asyncsync's;
    ``close`` kills its actors and removes its placement groups (the next job needs their CPUs)."""

    def __init__(self, model_dir: str, rollouts: int = 2, manager: str = "verl", backend: str = "asyncsync",
                 group_timeout_s: float = 60.0, **weight_sync: Any):
        from verl.workers.config import CheckpointEngineConfig, HFModelConfig, RolloutConfig

        kwargs = {"model": model_dir, "deadline_s": ROLLOUT_DEADLINE_S,
                  "weight_sync": {**FAST, "bucket_bytes": "64KiB", **weight_sync}}
        module = "verl_workers" if backend != "asyncsync" else "asyncsync.integrations.verl"
        self.engine = CheckpointEngineConfig(backend=backend, custom_backend_module=module,
                                             engine_kwargs={backend: kwargs})
        self.rollout_config = RolloutConfig(name="vllm", tensor_model_parallel_size=1, checkpoint_engine=self.engine)
        self.model_config = HFModelConfig(path=model_dir, load_tokenizer=False)
        self.pools: list[Any] = []
        self.groups: list[Any] = []
        try:
            self._start(model_dir, rollouts, group_timeout_s)
            self.manager = self.manager_class(manager)(config=self.engine, actor_wg=self.actor,
                                                       replicas=list(self.replicas))
        except BaseException:
            self.close()
            raise

    def _start(self, model_dir: str, rollouts: int, group_timeout_s: float) -> None:
        import ray
        from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

        import verl_workers

        def group(size: int, cls: type, **init: Any) -> Any:
            self.pools.append(RayResourcePool(process_on_nodes=[size], use_gpu=False, max_colocate_count=1))
            self.groups.append(RayWorkerGroup(resource_pool=self.pools[-1], device_name="cpu",
                                              ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(cls), **init)))
            return self.groups[-1]

        self.actor = group(2, verl_workers.ShardedActor, model_dir=model_dir, checkpoint_engine=self.engine,
                           group_timeout_s=group_timeout_s)
        self.rollout = group(rollouts, verl_workers.RecordingRollout, rollout_config=self.rollout_config,
                             model_config=self.model_config)
        self.replicas = [verl_workers.Replica(replica_rank=i, config=self.rollout_config, model_config=self.model_config)
                         for i in range(rollouts)]

        async def hybrid() -> None:
            await asyncio.gather(*[r.init_hybrid(self.rollout) for r in self.replicas])

        asyncio.run(hybrid())
        assert [len(r.workers) for r in self.replicas] == [1] * rollouts, "one rollout worker per replica"

    @staticmethod
    def manager_class(which: str) -> type:
        if which == "verl":
            from verl.checkpoint_engine import CheckpointEngineManager

            return CheckpointEngineManager
        from asyncsync.integrations.verl import AsyncsyncCheckpointManager

        return AsyncsyncCheckpointManager

    def trained(self) -> dict[str, Any]:
        return self.actor.full_digest()[0]

    def received(self, workers: list[Any] | None = None) -> list[dict[str, Any]]:
        import ray

        return ray.get([w.received.remote() for w in workers or self.rollout.workers])

    def sent_at(self) -> tuple[float, float]:
        """Wall-clock start and end of actor rank 0's last send_weights."""
        return self.actor.send_times()[0]

    def close(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for group in self.groups:
            for worker in group.workers:
                ray.kill(worker, no_restart=True)
        for pool in self.pools:
            for pg in pool.pgs or []:
                remove_placement_group(pg)


def wait_until(done: Any, timeout_s: float, what: str) -> None:
    give_up = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < give_up, f"waited {timeout_s:g}s for {what}"
        time.sleep(0.2)


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
        job.actor.step(seed=k, every=1 if k == 0 else 50)  # dense, then sparse: deltas pay
        metrics = job.manager.update_weights(global_steps=label)
        trained = job.trained()
        for worker in job.received():
            assert worker["digest"] == trained, f"sync {k}: a rollout worker holds other bytes than the trainer"
        versions.append(metrics["asyncsync/version"])
        assert metrics["asyncsync/groups_formed"] == 1, "the sync's groups are formed once and kept"
        assert metrics["asyncsync/failed_workers"] == 0 and metrics["asyncsync/bytes"] > 0
        if k > 0:
            assert metrics["asyncsync/delta_buckets"] > 0, f"sync {k}: a sparse version goes as deltas: {metrics}"
            assert metrics["asyncsync/wire_bytes"] < metrics["asyncsync/bytes"] / 4, metrics
    assert versions == sorted(set(versions)), f"global_steps is a label; versions only increase: {versions}"
    assert all(w["labels"] == labels for w in job.received())


def test_a_corrupted_bucket_yields_nothing_and_the_old_weights_stay(job_factory):
    job = job_factory(**FLIPPABLE)
    job.actor.step(seed=1)
    job.manager.update_weights(global_steps=1)
    before = job.received()
    job.actor.flip_next_bucket()
    job.actor.step(seed=2)
    with pytest.raises(Exception, match=r"checksum mismatch"):
        job.manager.update_weights(global_steps=2)
    after = job.received()
    assert [w["digest"] for w in after] == [w["digest"] for w in before], "a refused version changed nothing"
    assert [w["labels"] for w in after] == [[1], [1]], "the adapter got nothing of the refused version"
    job.actor.step(seed=3)
    job.manager.update_weights(global_steps=3)
    assert all(w["digest"] == job.trained() for w in job.received()), "the next sync applies"


def test_a_rollout_killed_mid_version_raises_without_hanging_and_the_next_sync_succeeds_after_remove_replicas(
        job_factory):
    import ray

    job = job_factory(**WIRE)
    job.actor.step(seed=1)
    job.manager.update_weights(global_steps=1)
    victim, survivor = job.replicas[1], job.replicas[0]
    before = job.received(survivor.workers)[0]
    ray.get(victim.workers[0].die_in_next_version.remote())
    job.actor.step(seed=2)
    start, wall = time.monotonic(), time.time()
    # verl's manager raises the first error: the dead worker's, or the version's loss it caused
    with pytest.raises(Exception, match=r"(?i)actor died|reached no rollout worker|was not applied here"):
        job.manager.update_weights(global_steps=2)
    assert time.monotonic() - start < 60, "the sync with a dead worker took too long to fail"
    wait_until(lambda: job.sent_at()[1] > wall, 60, "actor rank 0's send of the version to end")
    survived = job.received(survivor.workers)[0]
    trained = job.trained()
    # the survivor shared the dead worker's broadcast group: it holds a whole version (the old, or
    # the new if it got it all), and its adapter loaded exactly what it holds
    assert (survived["digest"], survived["labels"]) in [(before["digest"], [1]), (trained, [1, 2])]
    job.manager.remove_replicas([victim])
    job.actor.step(seed=3)
    metrics = job.manager.update_weights(global_steps=3)
    assert metrics["asyncsync/groups_formed"] == 2, "the groups are formed again for the new set of workers"
    assert metrics["asyncsync/failed_workers"] == 0
    assert job.received(survivor.workers)[0]["digest"] == job.trained()


def test_a_backend_that_does_not_drain_the_generator_on_every_rank_fails(job_factory):
    from verl_workers import LAZY

    job = job_factory(backend=LAZY, group_timeout_s=10)  # rank 1 returns at once: rank 0's all-gathers lack a peer
    job.actor.step(seed=1)
    start = time.monotonic()
    with pytest.raises(Exception, match=r"Timed out waiting \d+ms"):  # actor rank 0's, or a rollout worker's naming it
        job.manager.update_weights(global_steps=1)
    wait_until(lambda: all(w["errors"] for w in job.received()), ROLLOUT_DEADLINE_S, "every rollout worker's error")
    assert time.monotonic() - start < ROLLOUT_DEADLINE_S, "rollout workers heard of the failure, not at their deadline"
    for worker in job.received():
        assert worker["labels"] == [], "no rollout worker loaded anything"
        assert re.search(r"no version was sent in this sync: actor rank 0's weights generator failed: RuntimeError: "
                         r".*Timed out", worker["errors"][0]), worker["errors"]


def test_asyncsyncs_manager_generates_during_the_transfer_keeps_a_refusing_workers_old_version_and_forms_once(
        job_factory):
    import ray

    from asyncsync import SyncError

    job = job_factory(manager="asyncsync", **FLIPPABLE)
    for k in range(2):
        job.actor.step(seed=10 + k)
        metrics = job.manager.update_weights(global_steps=k)
        assert all(w["digest"] == job.trained() for w in job.received())
        assert metrics["asyncsync/groups_formed"] == 1 and metrics["asyncsync/workers_not_loaded"] == 0
        sent_end = job.sent_at()[1]
        for replica in job.replicas:
            (abort, aborted_at), (resume, _) = replica.events[-2:]
            assert (abort, resume) == ("abort", "resume"), replica.events
            assert aborted_at >= sent_end, "generation went on while the version travelled; aborted only to load"
    assert not any(e == "release_kv_cache" for r in job.replicas for e, _ in r.events), "the KV cache is kept"

    before = job.received()
    ray.get(job.rollout.workers[1].refuse_next_version.remote())
    job.actor.step(seed=12)
    metrics = job.manager.update_weights(global_steps=2)  # does not raise: worker 0 loaded it
    assert metrics["asyncsync/workers_not_loaded"] == 1
    assert list(job.manager.last_failures) == [1]
    assert "VersionNotReceived" in job.manager.last_failures[1] and "checksum mismatch" in job.manager.last_failures[1]
    now = job.received()
    assert now[0]["digest"] == job.trained() and now[1]["digest"] == before[1]["digest"], \
        "the refusing worker's replica keeps serving its old version, the other loads the new one"
    assert all(r.events[-1][0] == "resume" for r in job.replicas)

    job.actor.step(seed=13)
    job.manager.update_weights(global_steps=3)
    assert all(w["digest"] == job.trained() for w in job.received()), "the refusing worker takes the next version"

    kept = [(w["digest"], w["labels"]) for w in job.received()]
    job.actor.flip_next_bucket()  # every worker refuses
    job.actor.step(seed=14)
    with pytest.raises(SyncError, match="no rollout worker loaded"):
        job.manager.update_weights(global_steps=4)
    assert [(w["digest"], w["labels"]) for w in job.received()] == kept, "refused by all: every worker keeps its weights"
    assert sorted(job.manager.last_failures) == [0, 1]
    assert all("checksum mismatch" in why for why in job.manager.last_failures.values()), job.manager.last_failures
    job.actor.step(seed=15)
    metrics = job.manager.update_weights(global_steps=5)
    assert metrics["asyncsync/groups_formed"] == 1 and metrics["asyncsync/workers_not_loaded"] == 0
    assert all(w["digest"] == job.trained() and w["labels"][-1] == 5 for w in job.received()), "each sync pairs with its own"


def test_asyncsyncs_manager_in_async_mode_returns_before_the_workers_load(job_factory):
    import ray

    job = job_factory(manager="asyncsync", async_weight_update=True, **WIRE)
    for k in range(3):
        job.rollout.hold_loads()
        job.actor.step(seed=20 + k, every=1 if k == 0 else 50)
        metrics = job.manager.update_weights(global_steps=k)
        assert "asyncsync/sync_s" not in metrics, "an async sync returns once the version is copied"
        assert all(k not in w["labels"] for w in job.received()), "it returned before the workers loaded"
        job.rollout.release_loads()
        assert job.manager.drain() == {}
        assert all(w["digest"] == job.trained() and w["labels"][-1] == k for w in job.received())
        assert metrics["asyncsync/groups_formed"] == 1
    assert not any(r.events for r in job.replicas), "generation is never aborted in async mode"

    before = job.received()
    ray.get(job.rollout.workers[1].refuse_next_version.remote())
    job.actor.step(seed=30, every=50)
    job.manager.update_weights(global_steps=3)
    failures = job.manager.drain()
    assert list(failures) == [1] and "checksum mismatch" in failures[1], failures
    now = job.received()
    assert now[0]["digest"] == job.trained() and now[1]["digest"] == before[1]["digest"]
