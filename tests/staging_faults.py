"""The faults a receiver's staging must survive, run the same way against any server kind.

``run_fault_sequence`` drives one server through: a corrupted bucket, a corrupted delta, then a delta
against a version the server does not hold, a trainer killed half-way through a version, versions
superseded in async mode. After each, ``serves(what, version)`` must find the server serving exactly
the trainer's weights of ``version`` (the old version after a refused one, the new one after a good
one): a reference server compares digests, vLLM its greedy tokens with the trainer's own decode.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncsync import WeightSync
from asyncsync.packing.delta import Delta
from asyncsync.protocol.specs import Bucket
from asyncsync.trainer.buffers import PackOnDemand, Prepacked

REPO = Path(__file__).resolve().parents[1]


class FlipNextBucket:
    """Once armed, one byte of the next packed bucket is flipped in the ring after its CRC32C was taken
    (fused into the pack), as a bit flip on the wire would leave it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.armed = False
        original = PackOnDemand.bucket

        def bucket(source: PackOnDemand, b: Bucket) -> torch.Tensor:
            buf = original(source, b)
            if self.armed and not source.buffers.direct(b):
                self.armed = False
                buf[buf.numel() // 2] ^= 0xFF
            return buf

        monkeypatch.setattr(PackOnDemand, "bucket", bucket)


class HoldFirstSend:
    """Once armed, the first bucket a sender reads of a snapshot (async mode; whole or as a delta) waits
    until ``release``: the trainer reaches its next boundaries while that version is on the wire, so
    the versions it publishes meanwhile are superseded, however fast the wire."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.armed = False
        self.release = threading.Event()
        for name in ("bucket", "delta"):
            original = getattr(Prepacked, name)
            monkeypatch.setattr(Prepacked, name, self._held(original))

    def _held(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def read(source: Prepacked, bucket: Bucket) -> Any:
            if self.armed:
                self.armed = False
                self.release.wait(60)  # bounded: the sequence releases it
            return original(source, bucket)
        return read


class CorruptNextDelta:
    """Once armed, one byte of the next version's first delta payload of more than 512 bytes is flipped
    on its way to the wire (in a copy; the trainer's checksum is the original bucket's, as a bit flip
    would leave it)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.armed = False
        # Keyed by the source's id, so the source is held too: a later version's source could
        # otherwise reuse a collected one's id and be sent the corrupted delta again.
        self._corrupted: dict[tuple[int, int], tuple[Prepacked, Delta]] = {}
        original = Prepacked.delta

        def delta(source: Prepacked, bucket: Bucket) -> Delta | None:
            found = original(source, bucket)
            key = (id(source), bucket.index)
            if key in self._corrupted:
                return self._corrupted[key][1]
            payload = found.payload() if found is not None else None
            if self.armed and found is not None and payload is not None and payload.numel() > 512:
                self.armed = False
                bad = payload.clone()
                bad[bad.numel() // 2] ^= 0x5A
                found = Delta(bad, found.changed)
                self._corrupted[key] = (source, found)
            return found

        monkeypatch.setattr(Prepacked, "delta", delta)


def sparse_step(model: torch.nn.Module, seed: int, every: int = 31, scale: float = 0.3) -> None:
    """One element in ``every`` of every parameter changes: deltas pay."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            flat = p.view(-1)
            at = flat[seed % every :: every]
            at += (torch.randn(at.shape, generator=g) * scale).to(p.dtype)


def dense_step(model: torch.nn.Module, seed: int, scale: float = 0.3) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_((torch.randn(p.shape, generator=g) * scale).to(p.dtype))


# A trainer that dies half-way through a version: it connects, then exits (no clean-up: the kernel
# closes its sockets) as its third bucket is packed. argv: config (JSON), model (a saved directory,
# or a ModelConfig as JSON), version.
DYING_TRAINER = """
import json, os, sys
from asyncsync import WeightSync
from asyncsync.trainer.buffers import PackOnDemand
original = PackOnDemand.bucket
def bucket(source, b):
    if b.index == 2:
        print("dying", flush=True)
        os._exit(9)
    return original(source, b)
PackOnDemand.bucket = bucket
if os.path.isdir(sys.argv[2]):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(sys.argv[2])
else:
    from asyncsync.models import ModelConfig, build_model
    model = build_model(ModelConfig(**json.loads(sys.argv[2])))
with __import__("torch").no_grad():
    for p in model.parameters():
        p.mul_(-1)
sync = WeightSync.from_config(json.loads(sys.argv[1]))
sync.connect(model)
sync.publish(model, int(sys.argv[3]))
"""


def die_mid_version(config: dict[str, Any], model: str, version: int) -> None:
    """Run a trainer that dies half-way through sending ``version`` (``model``: see DYING_TRAINER)."""
    dying = subprocess.run([sys.executable, "-c", DYING_TRAINER, json.dumps(config), model, str(version)],
                           capture_output=True, text=True, timeout=300, cwd=REPO,
                           env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert dying.returncode == 9 and "dying" in dying.stdout, dying.stderr[-2000:]


def run_fault_sequence(config: dict[str, Any], trainer: torch.nn.Module, version: int, model: str,
                       serves: Callable[[str, int], None], monkeypatch: pytest.MonkeyPatch) -> int:
    """The faults above, starting from the served ``version``; returns the version served at the end.
    ``config``: a WeightSyncConfig mapping for the one server; ``model``: how the dying trainer builds
    the trainer's model (``die_mid_version``)."""
    # A corrupted bucket: refused whole, the old version serves on.
    with WeightSync.from_config({**config, "delta": "off"}) as sync:
        sync.connect(trainer)
        version += 1
        dense_step(trainer, version)
        result = sync.publish(trainer, version)
        assert list(result.server_versions.values()) == [version], result.failures
        serves("a good version", version)
        good = {n: t.clone() for n, t in trainer.state_dict().items()}
        FlipNextBucket(monkeypatch).armed = True
        dense_step(trainer, version + 1)
        refused = sync.publish(trainer, version + 1)
        assert refused.server_versions == {} and "checksum mismatch" in "".join(refused.failures.values()), refused
        trainer.load_state_dict(good)
        serves("after a corrupted bucket", version)
    monkeypatch.undo()

    # A corrupted delta, then a delta against a version the server does not hold (the trainer is made
    # to believe it committed the refused one): each refused whole; the next version goes whole.
    corrupt = CorruptNextDelta(monkeypatch)
    with WeightSync.from_config(config) as sync:
        sync.connect(trainer)
        for k in range(2):
            version += 2
            sparse_step(trainer, version)
            result = sync.publish(trainer, version)
            assert list(result.server_versions.values()) == [version], result.failures
            assert k == 0 or result.delta_base is not None, "sparse versions go as deltas"
        serves("a delta version", version)
        good = {n: t.clone() for n, t in trainer.state_dict().items()}
        corrupt.armed = True
        sparse_step(trainer, version + 1)
        bad = sync.publish(trainer, version + 1)
        assert bad.delta_base == version and bad.server_versions == {}, bad
        url = next(iter(bad.failures))
        sync.connection.role.fleets[0].book.took(url, version + 1)  # the lie: the server still holds `version`
        sparse_step(trainer, version + 2)
        wrong = sync.publish(trainer, version + 2)
        assert wrong.delta_base == version + 1 and wrong.server_versions == {}, wrong
        # A one-arena staging (vLLM's, the reference server's host) received the refused version over its
        # baseline: it holds none intact; a two-arena one still holds `version`. Refused either way.
        assert f"delta against version {version + 1}, but this receiver" in wrong.failures[url], wrong.failures
        trainer.load_state_dict(good)
        serves("after a delta against the wrong base", version)
        version += 3
        sparse_step(trainer, version)
        whole = sync.publish(trainer, version)
        assert whole.delta_base is None and whole.server_versions == {url: version}, whole
        serves("the next version, whole", version)
    monkeypatch.undo()

    # A trainer killed half-way through a version: the old version serves on (the next trainer's
    # connect ends whatever the dead one left open).
    die_mid_version({**config, "delta": "off"}, model, version + 1)
    serves("after a trainer died half-way through a version", version)

    # Versions published back to back in async mode while the first is on the wire: superseded ones
    # are never sent, the newest is live.
    hold = HoldFirstSend(monkeypatch)
    with WeightSync.from_config({**config, "async_weight_update": True}) as sync:
        sync.connect(trainer)
        hold.armed = True
        try:
            for _ in range(4):
                version += 1
                sync.wait_snapshot()
                dense_step(trainer, version)
                sync.publish(trainer, version)
        finally:
            hold.release.set()
        sync.close()
    monkeypatch.undo()
    assert sync.errors == [] and sync.metrics.superseded > 0, (sync.errors, sync.metrics.superseded)
    sent = [r.version for r in sync.metrics.history if r.server_versions]
    assert sent == sorted(sent) and sent[-1] == version, sent
    serves("the newest version after superseded ones", version)
    return version
