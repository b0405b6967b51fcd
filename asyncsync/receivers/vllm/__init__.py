"""asyncsync's weight-transfer backend for vLLM, registered through vLLM's plugin entry point.

``pip install asyncsync[vllm]`` puts ``register`` under the ``vllm.general_plugins`` entry point;
vLLM calls it in each of its processes (API server, engine core, workers), and a stock server then
accepts ``--weight-transfer-config '{"backend": "asyncsync"}'``. The engine module itself is imported
lazily, only in the workers that create the engine.

vLLM's ``--weight-transfer-config`` takes only ``backend`` (its config forbids other keys), so the
receiver's staging (``protocol/arena.py``) is in the backend's name, where the trainer's client
also reads it (``/server_info``): ``asyncsync`` and ``asyncsync-host`` stage a version once per node
in host memory (the default: what large tensor-parallel models fit), ``asyncsync-device`` on every
worker's device.
"""

from __future__ import annotations

from asyncsync.protocol.arena import VLLM_BACKENDS as BACKENDS


def register() -> None:
    """Register asyncsync's backends once per process (vLLM refuses a second registration), keep a
    refused version to one log line (``quiet``), have vLLM read every worker's reply to a failed
    RPC (``replies``: with tensor parallelism vLLM 0.32 would read them as the next RPC's), and have
    an engine whose workers hold different weights answer every request with an error (``hold``)."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    from asyncsync.receivers.vllm import hold, quiet, replies

    quiet.install()
    replies.install()
    hold.install()
    for name in BACKENDS:  # each name selects a staging (``protocol.arena.vllm_staging``)
        if name not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(
                name, "asyncsync.receivers.vllm.transfer_engine", "AsyncsyncWeightTransferEngine"
            )
