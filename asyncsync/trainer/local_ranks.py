"""Trainer ranks on this host: N spawned processes that form one gloo world, for the GRPO demo's
sharded policy, the sharded benchmark and the tests (a real job's launcher, torchrun or SLURM, does
this on a cluster).

    outcomes = run_local_ranks(train, world=2, args=(cfg,))   # train(rank, world, cfg) on every rank
    outcomes[0].value                                          # what rank 0's train returned

Each process initialises torch.distributed's default group (gloo, a free loopback port), calls
``fn(rank, world, *args)`` and reports its return value or its traceback; every process is joined,
or killed once the others reported, whatever happens (a rank that exits without reporting is seen
by its exit code).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue as queue_module
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RankOutcome:
    rank: int
    value: Any = None           # what ``fn`` returned (picklable)
    error: str | None = None    # its traceback, when it raised
    exitcode: int | None = None


def run_local_ranks(fn: Callable[..., Any], world: int, args: Sequence[Any] = (), timeout_s: float = 1800.0,
                    group_timeout_s: float = 600.0) -> list[RankOutcome]:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned ranks of one gloo world; each rank's outcome,
    in rank order. Returns once every rank reported or exited, or ``timeout_s`` passed (the ranks
    still running are then killed and have no value)."""
    from asyncsync.protocol.group import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_entry, args=(fn, rank, world, port, tuple(args), group_timeout_s, results),
                         daemon=True) for rank in range(world)]
    reports: dict[int, tuple[Any, str | None]] = {}
    give_up = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.start()
        while len(reports) < world and time.monotonic() < give_up:
            try:
                rank, value, error = results.get(timeout=0.5)
                reports[rank] = (value, error)
            except queue_module.Empty:
                if all(p.exitcode is not None for r, p in enumerate(procs) if r not in reports) and results.empty():
                    break  # every rank that did not report has exited
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
    return [RankOutcome(rank, *reports.get(rank, (None, None)), exitcode=p.exitcode) for rank, p in enumerate(procs)]


def _rank_entry(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple[Any, ...], group_timeout_s: float,
                results: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=group_timeout_s))
    try:
        results.put((rank, fn(rank, world, *args), None))
    except BaseException:
        results.put((rank, None, traceback.format_exc()))
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # another rank's failure may have broken the group: the process ends anyway
            pass
