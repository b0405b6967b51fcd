"""An SGLang server joins the trainer's data-plane group: same store keys, same start-up handshake."""

from __future__ import annotations

import multiprocessing as mp
from datetime import timedelta

import torch

from asyncsync.protocol.device import HostRuntime
from asyncsync.protocol.group import DataPlaneGroup, free_port
from asyncsync.protocol.wire import GroupSpec

SIZE = 64


def join_like_sglang(host: str, port: int, world_size: int, rank: int, group_name: str, typed: bool, out: mp.Queue) -> None:
    """The group construction of SGLang's ``init_custom_process_group`` (sglang/srt/utils), then one
    receive as its flattened-bucket path does: a uint8 buffer (SGLang since November 2025) or a
    buffer of the bucket's one dtype (before)."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    timeout = timedelta(seconds=30)
    store, rank, world_size = next(rendezvous(f"tcp://{host}:{port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend("gloo"), store, group_name=group_name,
                                      backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    buf = torch.empty(SIZE // 4, dtype=torch.float32) if typed else torch.empty(SIZE, dtype=torch.uint8)
    pg.broadcast([buf]).wait()
    out.put(buf.view(torch.uint8).tolist())


def test_a_group_built_like_sglang_joins_and_receives_a_bucket():
    ctx = mp.get_context("spawn")
    for typed in (False, True):
        spec = GroupSpec("127.0.0.1", free_port(), 2, "asyncsync", "gloo", 30.0)
        out = ctx.Queue()
        child = ctx.Process(target=join_like_sglang, args=(spec.host, spec.port, 2, 1, spec.group_name, typed, out), daemon=True)
        child.start()
        group = None
        try:
            group = DataPlaneGroup.join(spec, 0, HostRuntime(), warmup=False)
            bucket = torch.arange(SIZE, dtype=torch.uint8)
            group.broadcast(bucket)
            assert out.get(timeout=30) == bucket.tolist()
        finally:
            if group is not None:
                group.close()
            child.join(10)
            if child.is_alive():
                child.kill()
                child.join(10)
