"""A trainer that stops itself at one phase of a version, for tests that SIGKILL or SIGSTOP it there.

    python tests/phase_trainer.py CONFIG MODEL PHASE VERSION MARKER

It connects to the servers of CONFIG (a WeightSyncConfig mapping, as JSON), moves every weight of
MODEL (a saved directory, or a ``ModelConfig`` as JSON) by ``phase_weights(model, VERSION)`` and
publishes VERSION (blocking mode). When it reaches PHASE it writes MARKER and blocks forever, so
the test signals it exactly there (a test-only hook: the trainer's own code is not changed):

* ``before_begin``: connected, the version's first call not yet made;
* ``mid_transfer``: two buckets sent, the third never (vLLM keeps receiving in the background);
* ``after_pause``: vLLM paused for the load (the reference server, which never pauses: the version
  received, ``/end`` not yet sent);
* ``during_load``: the load's request sent half a second ago (vLLM's ``/finish_weight_update``, the
  reference server's ``/end``; the test's server delays its load so the signal lands in it);
* ``before_resume``: the version loaded, vLLM's ``/resume`` not yet sent (reference: ``/end`` answered).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

PHASES = ("before_begin", "mid_transfer", "after_pause", "during_load", "before_resume")


def phase_weights(model: torch.nn.Module, version: int, scale: float = 0.3) -> None:
    """The trainer's weights of ``version``: its start-up weights, every parameter moved (seeded)."""
    g = torch.Generator().manual_seed(version)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * scale)


def stop_here(marker: str) -> None:
    Path(marker).write_text(str(time.time()))
    while True:  # the test SIGKILLs or SIGSTOPs this process now
        time.sleep(3600)


def install(phase: str, kind: str, marker: str) -> None:
    """Make this process stop at ``phase`` of the next version on a ``kind`` server."""
    from asyncsync.control import HttpClient
    from asyncsync.engines.reference import ReferenceEngine
    from asyncsync.engines.vllm import VllmEngine
    from asyncsync.trainer.buffers import PackOnDemand, Prepacked

    vllm = kind == "vllm"
    engine: Any = VllmEngine if vllm else ReferenceEngine
    if phase == "before_begin":
        def begin(self: Any, version: int) -> Any:
            stop_here(marker)
        engine.begin = begin
    elif phase == "mid_transfer":
        for source in (PackOnDemand, Prepacked):  # packed as it is sent, or before (both modes, deltas or not)
            _stop_at_third_bucket(source, marker)
    elif phase == "after_pause" or (phase == "before_resume" and not vllm):
        _stop_around(engine, "_pause" if vllm else "end", marker, after=vllm or phase == "before_resume")
    elif phase == "before_resume":  # the resume after a version's load (connect's checks pause nothing)
        _stop_around(engine, "_resume", marker, after=False, when=lambda e: e._paused)
    elif phase == "during_load":
        post, path = HttpClient.post, "/finish_weight_update" if vllm else "/end"

        async def posted(self: Any, where: str, *args: Any, **kwargs: Any) -> Any:
            if where != path or (vllm and not args):  # connect's checks end a session without a version
                return await post(self, where, *args, **kwargs)
            asyncio.ensure_future(post(self, where, *args, **kwargs))
            await asyncio.sleep(0.5)
            stop_here(marker)
        HttpClient.post = posted
    else:
        raise SystemExit(f"unknown phase {phase!r}: one of {PHASES}")


def _stop_at_third_bucket(source: Any, marker: str) -> None:
    bucket = source.bucket

    def packed(self: Any, b: Any) -> Any:
        if b.index == 2:
            stop_here(marker)
        return bucket(self, b)

    source.bucket = packed


def _stop_around(engine: Any, method: str, marker: str, after: bool, when: Any = lambda e: True) -> None:
    original = getattr(engine, method)

    async def stopped(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not when(self):
            return await original(self, *args, **kwargs)
        if after:
            await original(self, *args, **kwargs)
        stop_here(marker)

    setattr(engine, method, stopped)


def main(config: str, model: str, phase: str, version: str, marker: str) -> None:
    from asyncsync import WeightSync

    settings = json.loads(config)
    server = settings["servers"][0]
    install(phase, server.get("kind", "reference") if isinstance(server, dict) else "reference", marker)
    if os.path.isdir(model):
        from transformers import AutoModelForCausalLM
        trainer = AutoModelForCausalLM.from_pretrained(model)
    else:
        from asyncsync.models import ModelConfig, build_model
        trainer = build_model(ModelConfig(**json.loads(model)))
    phase_weights(trainer, int(version))
    sync = WeightSync.from_config(settings)
    sync.connect(trainer)
    sync.publish(trainer, int(version))
    raise SystemExit(f"the version was published without reaching phase {phase!r}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(*sys.argv[1:])
