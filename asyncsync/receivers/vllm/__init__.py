"""asyncsync's weight-transfer backend for vLLM, registered through vLLM's plugin entry point.

``pip install asyncsync[vllm]`` puts ``register`` under the ``vllm.general_plugins`` entry point;
vLLM calls it in each of its processes (API server, engine core, workers), and a stock server then
accepts ``--weight-transfer-config '{"backend": "asyncsync"}'``. The engine module itself is imported
lazily, only in the workers that create the engine.
"""

from __future__ import annotations

BACKEND = "asyncsync"


def register() -> None:
    """Register the ``asyncsync`` backend once per process (vLLM refuses a second registration), and
    keep a refused version to one log line (``quiet``)."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    from asyncsync.receivers.vllm.quiet import install

    install()
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "asyncsync.receivers.vllm.transfer_engine", "AsyncsyncWeightTransferEngine"
        )
