"""Host staging on a vLLM engine: one verified copy of a version per node, read by every worker.

With ``staging: host`` (the backend names in ``receivers/vllm/__init__.py``) only the engine's first
worker, the *stager*, joins the trainer's data plane. It receives and verifies each version into a
``HostArena`` (``protocol/arena.py``); its peers (the engine's other tensor- and pipeline-parallel
workers, on the same node) receive nothing. Each weight-update RPC runs on every worker (vLLM's
``collective_rpc``), so every step that can fail on the stager ends in ``share``: a broadcast of the
``StagerReport`` over vLLM's own group of the engine's workers (its CPU group), which every worker
meets at the same point. Every worker then raises the same refusal, or goes on: a peer maps the arena
read-only (``HostArena.attach``, once) and loads what its ``load_weights`` keeps from views of it,
exactly as vLLM loads a checkpoint from host memory at start-up.

So a version is held once per node in host memory, each worker's device gets nothing but the
engine's own load (and, on CUDA, the stager's two bucket-sized receive buffers), and a refused
version reaches no worker's weights. The engine's workers must share a node
(``nnodes_within_dp == 1``: vLLM's multiprocessing executor on one host, tensor parallelism within
a node); an engine spread over nodes is refused at start-up with the fix (``asyncsync-device``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from asyncsync.protocol.arena import Arena, HostArena
from asyncsync.protocol.group import DataPlaneError
from asyncsync.protocol.admission import VersionRejected
from asyncsync.protocol.intake import buckets_of
from asyncsync.protocol.staging import StagedVersion
from asyncsync.protocol.wire import UpdateRequest


@dataclass(frozen=True)
class StagerReport:
    """What the stager made of a step, as its peers learn it: ``error`` (the message of the stager's
    exception, ``data_plane`` when it was a ``DataPlaneError``) or success, with ``arena`` (the
    path its peers map the staged version from)."""

    error: str | None = None
    data_plane: bool = False
    arena: str | None = None

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise (DataPlaneError if self.data_plane else VersionRejected)(self.error)


class NodeStaging:
    """One worker's part in its engine's host staging: whether it is the stager, and the collective
    every worker meets after each step the stager takes (``share``)."""

    def __init__(self, parallel_config: Any):
        if parallel_config.nnodes_within_dp > 1:
            raise RuntimeError(
                f"asyncsync: staging 'host' keeps one copy of a version per node, but this engine's workers span "
                f"{parallel_config.nnodes_within_dp} nodes: use --weight-transfer-config "
                "'{\"backend\": \"asyncsync-device\"}' (a copy on every worker's device)")
        self.group = engine_group(parallel_config)
        if self.group is None:
            raise RuntimeError("asyncsync: staging 'host' needs vLLM's group of each engine's workers, which this "
                               "vLLM did not make: use --weight-transfer-config '{\"backend\": \"asyncsync-device\"}'")
        self.stager = self.group.rank_in_group == 0
        self._arena: tuple[str, Arena] | None = None  # a peer's mapping of the stager's arena

    def share(self, report: StagerReport | None) -> StagerReport:
        """The stager's ``report`` (it passes it; its peers pass None), on every worker of the engine."""
        if self.group.world_size == 1:
            assert report is not None
            return report
        box = [report]
        torch.distributed.broadcast_object_list(box, src=self.group.ranks[0], group=self.group.cpu_group)
        assert box[0] is not None
        return box[0]

    def led(self, step: Any, arena: HostArena | None) -> Any:
        """On the stager: run ``step()`` and share its report (re-raising its error). On a peer: wait
        for the stager's and raise its error, or return None. Every worker calls this at the same point,
        and the stager shares whatever ``step`` raised (a ``KeyboardInterrupt`` too), so no peer ever
        waits out vLLM's CPU-group timeout."""
        if not self.stager:
            self.share(None).raise_if_failed()
            return None
        try:
            result = step()
        except (VersionRejected, DataPlaneError) as e:
            self.share(StagerReport(str(e), isinstance(e, DataPlaneError)))
            raise
        except BaseException as e:
            self.share(StagerReport(f"the stager failed: {type(e).__name__}: {e}"))
            raise
        self.share(StagerReport(arena=arena.path if arena is not None else None))
        return result

    def staged(self, request: UpdateRequest) -> StagedVersion:
        """On a peer, after the stager shared a verified ``request``: the version, as views of the
        stager's arena (the same consecutive layout its stager received it in)."""
        report = self.share(None)
        report.raise_if_failed()
        assert report.arena is not None, "a verified version names the arena it is in"
        buckets = buckets_of(request)
        arena = self._attach(report.arena, sum(b.nbytes for b in buckets))
        return StagedVersion.of(request.version, arena.views([b.nbytes for b in buckets]), buckets)

    def _attach(self, path: str, nbytes: int) -> Arena:
        if self._arena is None or self._arena[0] != path or self._arena[1].nbytes < nbytes:
            try:
                self._arena = (path, HostArena.attach(path, nbytes))
            except OSError as e:
                raise VersionRejected(f"this worker cannot map its stager's arena {path} ({e}): the engine's "
                                      "workers must share a host and a user") from None
        return self._arena[1]


def engine_group(parallel_config: Any) -> Any:
    """vLLM's group of this engine's workers (its tensor- and pipeline-parallel ranks, not the other
    data-parallel engines'): the inner data-parallel world where vLLM made one, else the world of
    an engine that is the only one; None where neither is (several engines, and a platform whose
    worker made no inner group: vLLM's CPU worker)."""
    from vllm.distributed.parallel_state import get_inner_dp_world_group, get_world_group

    try:
        return get_inner_dp_world_group()
    except AssertionError:  # not made by every platform's worker (vLLM's CPU worker)
        return None if parallel_config.data_parallel_size > 1 else get_world_group()
