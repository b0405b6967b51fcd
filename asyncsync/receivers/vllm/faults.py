"""Test-only faults of asyncsync's vLLM worker, switched on by the server's environment, never by a request.

A test that must see a load fail after verification, or a trainer die while a load runs, starts vLLM
with ``ASYNCSYNC_TEST_FAULTS`` set to a JSON object (no network input reaches it)::

    {"fail_load": [1, 3]}      # the worker of rank 1 in its engine raises half-way through loading version 3
    {"load_delay_s": 3}        # every load waits 3 s before it begins (a load a trainer can die during)

Unset (every real deployment), ``WorkerFaults.none()`` changes nothing.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

FAULTS_ENV = "ASYNCSYNC_TEST_FAULTS"


@dataclass(frozen=True)
class WorkerFaults:
    """``fail_load``: (rank in the engine, version) whose load raises after half of its tensors;
    ``load_delay_s``: a sleep before each load."""

    rank: int = 0
    fail_load: tuple[int, int] | None = None
    load_delay_s: float = 0.0

    @classmethod
    def none(cls) -> WorkerFaults:
        return cls()

    @classmethod
    def from_env(cls, rank: int) -> WorkerFaults:
        text = os.environ.get(FAULTS_ENV)
        if not text:
            return cls.none()
        spec = json.loads(text)
        fail = spec.get("fail_load")
        faults = cls(rank, (int(fail[0]), int(fail[1])) if fail else None, float(spec.get("load_delay_s", 0.0)))
        log.warning("asyncsync: test faults on (%s=%s): not for production", FAULTS_ENV, text)
        return faults

    def loading(self, version: int, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """``tensors`` as this worker's load of ``version`` reads them, with the faults it is set up for."""
        if self.load_delay_s:
            time.sleep(self.load_delay_s)
        if self.fail_load != (self.rank, version):
            yield from tensors
            return
        items = list(tensors)
        for i, item in enumerate(items):
            if i == len(items) // 2:
                raise RuntimeError(f"asyncsync test fault: worker {self.rank} fails half-way through loading "
                                   f"version {version} ({FAULTS_ENV})")
            yield item
