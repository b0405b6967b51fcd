"""The trainer ranks of tests/test_sharded.py: each a spawned process running one rank of a gloo world.

``run_scenarios`` runs the scenarios it is given, in order, on one process group, and returns what
each measured (``run_local_ranks`` reports it, or the traceback that ended the rank). Every check
that needs the servers runs on rank 0 (the ranks' views are compared with the servers' digests there).
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any

import torch

MOE = dict(family="qwen2_moe", vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
           num_kv_heads=1, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, seed=3)


def moe_config() -> Any:
    from asyncsync.models import ModelConfig

    return ModelConfig(**MOE)


def sha(t: torch.Tensor) -> str:
    from asyncsync.receivers.reference.receiver import tensor_bytes

    return hashlib.sha256(tensor_bytes(t.detach().contiguous())).hexdigest()


def full_view(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every tensor whole (a DTensor's ``full_tensor()``: a collective on the default group, so every
    rank calls this at the same point): the same model, unsharded."""
    from torch.distributed.tensor import DTensor

    return {n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone() for n, t in named.items()}


def check_served(urls: list[str], version: int, full: dict[str, torch.Tensor]) -> None:
    """Every server serves ``version``, and every tensor it serves is byte for byte the unsharded model's."""
    from helpers import call

    for url in urls:
        status, answer = call(url, "GET", "/weights/digest")
        assert status == 200, (url, status, answer)
        assert answer["version"] == version, f"{url} serves version {answer['version']}, expected {version}"
        served = answer["digest"]
        wrong = sorted(n for n, d in served.items() if n not in full or sha(full[n]) != d)
        assert not wrong, f"{url} serves other bytes than the unsharded model for {wrong[:5]}"


def local_bytes(named: dict[str, torch.Tensor], sent: set[str]) -> int:
    """Bytes of this rank's own data of the tensors sent: its local shards, and plain tensors whole."""
    from asyncsync.trainer.source import local_part

    return sum(local_part(t).numel() * t.element_size() for n, t in named.items() if n in sent)


class Trainer:
    """A tiny Qwen2-MoE, ``fully_shard``-ed over the world (every layer, then the root), trained with SGD."""

    def __init__(self, world: int):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from asyncsync.models import build_model

        self.model = build_model(moe_config()).train()
        mesh = init_device_mesh("cpu", (world,))
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.5)
        self.ids = torch.randint(2, MOE["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(0))

    def step(self) -> None:
        loss = self.model(input_ids=self.ids).logits.float().pow(2).mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()

    def full(self) -> dict[str, torch.Tensor]:
        """The model unsharded, in the checkpoint layout servers load (transformers' own reverse of
        its fused experts, what ``save_pretrained`` writes)."""
        from transformers.core_model_loading import revert_weight_conversion

        from asyncsync.trainer.source import module_tensors

        return revert_weight_conversion(self.model, full_view(module_tensors(self.model)))


def sync_config(urls: list[str], **overrides: Any) -> Any:
    from asyncsync.config import WeightSyncConfig

    base = dict(servers=urls, bucket_bytes=24 * 1024, deadlines={"rendezvous_s": 60, "collective_s": 30, "http_s": 30})
    return WeightSyncConfig.from_dict({**base, **overrides})


def train_and_sync(rank: int, urls: list[str], trainer: Trainer, first: int, versions: int, **overrides: Any) -> dict[str, Any]:
    """``versions`` optimizer steps, each published; blocking: every version checked on the servers as
    it is published; async: the last one, after ``close`` drained it. Returns the memory measured."""
    from asyncsync.trainer.sync import WeightSync

    sync = WeightSync(sync_config(urls, **overrides))
    sync.connect(trainer.model)
    try:
        held = sync.connection.reader.read(trainer.model).tensors().sources  # the fused experts, as the ranks hold them
        report = dict(buffer_bytes=sync.footprint.device, host_buffer_bytes=sync.footprint.host, baseline_bytes=sync.footprint.baseline,
                      local_bytes=local_bytes(held, set(sync.layout.source_specs)), bucket_bytes=sync.plan.max_bucket_bytes,
                      model_bytes=sync.plan.total_bytes, metrics_bytes=sync.metrics.footprint.device,
                      converted=not sync.layout.identity)
        full: dict[str, torch.Tensor] = {}
        for v in range(first, first + versions):
            sync.wait_snapshot()
            trainer.step()
            full = trainer.full()
            result = sync.publish(trainer.model, v)
            assert all(m.training for m in trainer.model.modules()), "the probe's eval mode is undone (verify)"
            if result is not None:
                assert result.failures == {}, result.failures
                assert set(result.server_versions.values()) == {v}, result.server_versions
                if rank == 0:
                    check_served(urls, v, full)
    finally:
        sync.close()
    report["checks"] = {u: d for u, (d, _) in sync.metrics.checks.items()}  # verify: logprobs (rank 0's)
    assert sync.errors == [], sync.errors
    if rank == 0:
        check_served(urls, first + versions - 1, full)
    return report


def nudge(model: torch.nn.Module, version: int) -> None:
    """A sparse update, as bf16 weights at an RL learning rate see one: every 211th element of each
    rank's shard of every parameter moves, the rest stay bit for bit."""
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().view(-1)[version % 7 :: 211].add_(1 / 64)


def sparse_deltas(rank: int, urls: list[str], trainer: Trainer, first: int, versions: int,
                  async_weight_update: bool) -> dict[str, Any]:
    """Sparse updates published with ``delta: auto``: the servers serve every version (blocking) or the
    last (async) bit for bit as the model unsharded; returns rank 0's results as (version, delta base,
    bytes on the wire, bytes of the version)."""
    from asyncsync.trainer.sync import WeightSync

    sync = WeightSync(sync_config(urls, async_weight_update=async_weight_update, delta="auto"))
    sync.connect(trainer.model)
    results = []
    try:
        for v in range(first, first + versions):
            sync.wait_snapshot()
            nudge(trainer.model, v)
            full = trainer.full()
            result = sync.publish(trainer.model, v)
            assert all(m.training for m in trainer.model.modules()), "the probe's eval mode is undone (verify)"
            if result is not None:
                assert result.failures == {} and set(result.server_versions.values()) == {v}, result
                if rank == 0:
                    check_served(urls, v, full)
            time.sleep(0.2 if async_weight_update else 0)  # a step: each version is sent before the next
    finally:
        sync.close()
    assert sync.errors == [], sync.errors
    if rank == 0:
        check_served(urls, first + versions - 1, full)
        results = [(r.version, r.delta_base, r.wire_bytes, r.nbytes) for r in sync.metrics.history]
    return dict(results=results, baseline_bytes=sync.metrics.footprint.baseline, model_bytes=sync.plan.total_bytes)


def encode_fails(rank: int, urls: list[str], trainer: Trainer, first: int) -> dict[str, Any]:
    """Blocking, ``delta: auto``: rank 1's encode of the second version fails (a device out of memory,
    injected) after the exchange; the version is abandoned on every rank, the servers keep the first
    (checked), and the third is served bit for bit. Returns what each publish raised, and rank 0's
    (version, delta base) of the versions sent."""
    from asyncsync.packing.native import CppPackBackend
    from asyncsync.trainer.sync import WeightSync

    sync = WeightSync(sync_config(urls, async_weight_update=False, delta="auto"))
    sync.connect(trainer.model)
    raised, sent = [], []
    pack_delta = CppPackBackend.pack_delta
    try:
        for v in range(first, first + 3):
            sync.wait_snapshot()
            nudge(trainer.model, v)
            before, full = (full if v > first else None), trainer.full()
            if v == first + 1 and rank == 1:
                def out_of_memory(self: CppPackBackend, *args: Any, **kwargs: Any) -> Any:
                    CppPackBackend.pack_delta = pack_delta  # type: ignore[method-assign]
                    raise RuntimeError("CUDA out of memory (injected)")

                CppPackBackend.pack_delta = out_of_memory  # type: ignore[method-assign]
            try:
                result = sync.publish(trainer.model, v)
            except Exception as e:
                raised.append((v, f"{type(e).__name__}: {e}"))
                if rank == 0:
                    check_served(urls, v - 1, before)  # nothing of the abandoned version was applied
                continue
            assert result is not None and result.failures == {}, result
            if rank == 0:
                sent.append((v, result.delta_base))
                check_served(urls, v, full)
    finally:
        CppPackBackend.pack_delta = pack_delta  # type: ignore[method-assign]
        sync.close()
    assert sync.errors == [], sync.errors
    return dict(raised=raised, sent=sent)


def mesh_2d(rank: int, world: int, urls: list[str], version: int) -> dict[str, Any]:
    """A mapping of DTensors on a 2-D mesh: matrices ``Shard(0)`` on one dim and ``Replicate`` on the
    other, every second one ``Shard(1)``, vectors replicated: the servers get the whole tensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from asyncsync.models import build_model
    from asyncsync.trainer.sync import WeightSync

    from transformers.core_model_loading import revert_weight_conversion

    mesh = init_device_mesh("cpu", (world, 1))
    model = build_model(moe_config())  # a mapping is sent as it is: in the checkpoint layout servers load
    full = {n: t.detach() + 0.25 * version for n, t in revert_weight_conversion(model, model.state_dict()).items()}
    named = {}
    for i, (n, t) in enumerate(full.items()):
        if t.dim() == 2:
            placements = [Shard(i % 2), Replicate()]
        else:
            placements = [Replicate(), Replicate()]
        named[n] = distribute_tensor(t, mesh, placements)
    with WeightSync(sync_config(urls, async_weight_update=False)) as sync:
        sync.connect(named)
        result = sync.publish(named, version)
        assert result is not None and set(result.server_versions.values()) == {version}, result
    if rank == 0:
        check_served(urls, version, full)
    return {}


def rank_exits(rank: int, urls: list[str], trainer: Trainer, version: int, async_mode: bool) -> dict[str, Any]:
    """Rank 1 exits half-way through the second version; rank 0 must raise ``TrainerRankLost`` within
    its deadline, and the servers keep (and serve) the first version."""
    from asyncsync.ranks import TrainerRankLost
    from asyncsync.trainer.shards import ShardedSource
    from asyncsync.trainer.sync import WeightSync

    sync = WeightSync(sync_config(urls, async_weight_update=async_mode))
    sync.connect(trainer.model)
    sync.wait_snapshot()
    trainer.step()
    full = trainer.full()
    sync.publish(trainer.model, version)
    sync.wait_snapshot()
    if async_mode:
        deadline = time.monotonic() + 60
        while not all(v == version for v in sync.server_versions.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
    trainer.step()
    if rank == 1:
        sent = 0
        contribute = ShardedSource.contribute

        def exit_half_way(self: ShardedSource, bucket: Any) -> None:
            nonlocal sent
            sent += 1
            if sent > len(sync.plan.buckets) // 3:
                os._exit(3)  # the process dies: no clean-up, sockets closed by the kernel
            contribute(self, bucket)

        ShardedSource.contribute = exit_half_way  # type: ignore[method-assign]
        sync.publish(trainer.model, version + 1)
        sync.wait_snapshot()
        time.sleep(60)
        os._exit(4)  # never reached: rank 1 exits above
    start = time.monotonic()
    error = ""
    try:
        sync.publish(trainer.model, version + 1)
        for _ in range(600):  # async: the worker stops on the lost rank; the boundary then raises it
            time.sleep(0.1)
            sync.wait_snapshot()
    except TrainerRankLost as e:
        error = str(e)
    took = time.monotonic() - start
    sync.close()
    check_served(urls, version, full)
    return dict(error=error, took_s=took, errors=sync.errors)


def run_scenarios(rank: int, world: int, urls: list[str], scenarios: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """One rank (``asyncsync.trainer.local_ranks`` made the world): the scenarios, in order; what each measured."""
    import logging

    logging.basicConfig(level=logging.WARNING)
    out: dict[str, Any] = {}
    trainer = Trainer(world)
    for name, kw in scenarios:
        if name == "train":
            out[kw["label"]] = train_and_sync(rank, urls, trainer, **{k: v for k, v in kw.items() if k != "label"})
        elif name == "sparse":
            out[kw["label"]] = sparse_deltas(rank, urls, trainer, **{k: v for k, v in kw.items() if k != "label"})
        elif name == "encode_fails":
            out[name] = encode_fails(rank, urls, trainer, kw["first"])
        elif name == "mesh_2d":
            out[name] = mesh_2d(rank, world, urls, kw["version"])
        elif name == "rank_exits":
            out[name] = rank_exits(rank, urls, trainer, kw["version"], kw["async_mode"])
    return out
