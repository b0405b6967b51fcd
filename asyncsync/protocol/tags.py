"""The one table of what a trainer carries where an ``UpdateRequest`` goes: vLLM's ``update_info``.

vLLM's weight-transfer routes have one slot for whatever a backend needs (``POST /update_weights
{"update_info": ...}``); asyncsync's vLLM client puts every message its worker must judge there
(``engines/vllm.py``), and the worker tells them apart by tag, a key only that message's JSON holds
(``receivers/vllm/transfer_engine.py``, one handler per message). Both ends read this table: the
client encodes through it (a message the worker could not tell apart is refused before it is sent)
and the worker decodes through it. Every such payload also carries the trainer's credential
(``protocol.keys.PayloadGuard``), which the worker checks before it decodes anything.
"""

from __future__ import annotations

from asyncsync.protocol.lora import AdapterCheck, AdapterUpdate, BaseCheck
from asyncsync.protocol.schema import Tags
from asyncsync.protocol.wire import CommitRequest, DiscardRequest, LayoutCheck, UpdateRequest

UPDATE_INFO = Tags(UpdateRequest, {
    "discard": DiscardRequest,      # drop a version received in the background
    "commit": CommitRequest,        # apply the version received in the background (with its digests)
    "check": LayoutCheck,           # at connect: does the engine load exactly these tensors?
    "adapter": AdapterUpdate,       # lora: adapter, one adapter version
    "adapter_check": AdapterCheck,  # lora: adapter, at connect: would the engine serve it?
    "base_check": BaseCheck,        # lora: adapter, at connect: does it serve this base?
})
