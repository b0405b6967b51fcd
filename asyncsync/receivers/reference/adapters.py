"""The reference server's LoRA adapters (``lora: adapter``): received like any version, served natively.

Routes (JSON in and out; the load routes take vLLM's request bodies, so a trainer drives every
engine's adapters the same way)::

    POST /check_adapter          AdapterCheck -> {"ok": true}, or 409 and why it cannot be served
    POST /check_base             BaseCheck -> {"ok": true}, or 409: this server serves another base
    POST /update_adapter         AdapterUpdate; answered once the adapter's buckets arrived and were
                                 verified (names, shapes and ranks against the base it serves)
    POST /end_adapter            {"version": v} -> {"path": p}: the verified adapter written as a PEFT
                                 directory in this host's tmpfs (``receivers/adapters.py``)
    POST /v1/load_lora_adapter   {"lora_name", "lora_path"}: PEFT loads the directory as that adapter;
                                 only a directory /end_adapter wrote (under ``LORA_ROOT``, holding
                                 the two PEFT files) is taken: any other path is refused (400)
                                 before PEFT sees it, so a request can neither read the host's
                                 files elsewhere nor make PEFT fetch a model hub id
    POST /v1/unload_lora_adapter {"lora_name"}; 404 for a name not loaded
    GET  /v1/models              {"data": [{"id": base}, {"id": adapter, "root": path, "parent": base}, ...]}

Serving: the first adapter wraps the model in a ``peft.PeftModel`` (PEFT's own loading, with PEFT's
LoRA layers injected into the model in place, its base parameters kept, so versions of the base
still swap in); each generation request runs under the serving lock with its adapter set active,
or with adapters disabled for the base. A version of the adapter is served exactly as the trainer's
PEFT model computes it.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Iterator
from typing import Any

import torch

from asyncsync.protocol.lora import (
    ADAPTER_REFUSED, CONFIG_FILE, WEIGHTS_FILE, AdapterCheck, AdapterUpdate, BaseCheck, adapter_problems, check_name,
)
from asyncsync.protocol.specs import TensorSpec
from asyncsync.protocol.admission import VersionRejected, reject_if
from asyncsync.protocol.staging import StagedVersion
from asyncsync.protocol.wire import WireError, sane_text, shown
from asyncsync.receivers.adapters import AdapterFiles
from asyncsync.receivers.reference.receiver import WeightReceiver

BASE_MODEL = "base"  # the base model's id in /v1/models
MAX_PATH_CHARS = 4096  # PATH_MAX


class AdapterNotFound(LookupError):
    """A request named an adapter this server has not loaded (answered 404)."""


class ServedAdapters:
    """Receives adapter versions into the receiver's stager, writes them, and serves them with PEFT.

    ``receive`` and ``write`` run on the server's data-plane thread; ``load``, ``unload`` and
    ``active`` under ``serve_lock``, so no request runs while the model's adapters change."""

    def __init__(self, model: torch.nn.Module, receiver: WeightReceiver, serve_lock: threading.Lock):
        self.model, self.receiver, self.serve_lock = model, receiver, serve_lock
        self.files = AdapterFiles()
        self.peft: Any = None             # the PeftModel around ``model``, once an adapter was loaded
        self.loaded: dict[str, str] = {}  # adapter name -> the directory it was loaded from
        self._staged: tuple[AdapterUpdate, StagedVersion] | None = None
        self._written: dict[str, int] = {}  # slot -> the newest version written there

    def check(self, check: AdapterCheck) -> None:
        problems = adapter_problems(self.receiver.stager.admission.expected, check.specs, check.config)
        if problems:
            raise VersionRejected(f"{ADAPTER_REFUSED}: the adapter does not fit the served model: " + "; ".join(problems[:3]))
        try:
            import peft  # noqa: F401
        except ImportError:
            raise VersionRejected(f"{ADAPTER_REFUSED}: this reference server has no peft: pip install peft") from None

    def check_base(self, check: BaseCheck) -> None:
        problem = check.mismatch(self.receiver.served())
        if problem is not None:
            raise VersionRejected(f"{ADAPTER_REFUSED}: this server serves another base: {problem}")

    def receive(self, update: AdapterUpdate) -> None:
        """Receive and verify one adapter version (every broadcast is taken part in first)."""
        self._staged = None
        specs = [s for b in update.update.buckets for s in b.to_bucket(0).specs]
        served = self._written.get(update.adapter.slot, 0)
        staged = self.receiver.stager.receive(update.update, served, {s.name: s for s in specs})
        problems = adapter_problems(self.receiver.stager.admission.expected, specs, update.adapter.config)
        if problems:  # judged once every broadcast was taken part in
            raise VersionRejected(f"adapter version {update.update.version} rejected: " + "; ".join(problems[:3]))
        self._staged = (update, staged)

    def write(self, version: int, digests: tuple[str, ...] = ()) -> str:
        """Write the verified version as a PEFT directory (and drop the slot's versions not kept); a
        version announced with digests only when its buckets hashed to the trainer's ``digests``."""
        staged = self._staged
        if staged is None or staged[1].version != version:
            raise VersionRejected(f"adapter version {version} is not staged; send /update_adapter for it first")
        update, received = staged
        unpublished = received.unpublished(digests)
        if unpublished:
            self._staged = None
            reject_if(unpublished, version)
        path = self.files.write(update.adapter, version, received.tensors())
        self.files.retain(update.adapter, version)
        self._written[update.adapter.slot] = version
        self._staged = None
        return path

    def load(self, name: str, path: str) -> None:
        """Load ``path`` (a PEFT directory written under this server's adapter root) as adapter
        ``name``; the model runs no request meanwhile. ``WireError`` for any other path,
        ``VersionRejected`` for a directory PEFT cannot load."""
        check_name(name, "lora_name")
        if name in self.loaded:
            raise WireError(f"the lora adapter '{name}' has already been loaded: load each version under a new name")
        path = self._directory(path)
        self._verify(path, name)
        with self.serve_lock, torch.no_grad():
            try:
                if self.peft is None:
                    from peft import PeftModel

                    self.peft = PeftModel.from_pretrained(self.model, path, adapter_name=name, is_trainable=False)
                else:
                    self.peft.load_adapter(path, adapter_name=name, is_trainable=False)
            except Exception as e:  # PEFT and safetensors raise many kinds for a damaged directory
                raise VersionRejected(f"PEFT could not load {path} as '{name}': {type(e).__name__}: {e}") from e
            self.peft.eval()
            self.loaded[name] = path

    def _directory(self, path: Any) -> str:
        """``path`` resolved, when it is an adapter directory under this server's root (``LORA_ROOT``)
        holding PEFT's two files; else ``WireError``. Links and ``..`` are resolved first, so
        neither leads out of the root."""
        root = os.path.realpath(self.files.root)
        if not sane_text(path, MAX_PATH_CHARS):
            raise WireError(f"lora_path: expected a printable path of at most {MAX_PATH_CHARS} characters, "
                            f"got {shown(path)}")
        real = os.path.realpath(path)
        if os.path.dirname(os.path.dirname(real)) != root:
            raise WireError(f"lora_path {shown(path)}: this server loads only the adapter directories it wrote, "
                            f"{root}/<slot>/<name>-v<N> (the path /end_adapter answers)")
        if not all(os.path.isfile(os.path.join(real, f)) for f in (CONFIG_FILE, WEIGHTS_FILE)):
            raise WireError(f"lora_path {shown(path)}: no adapter was written there ({CONFIG_FILE} and "
                            f"{WEIGHTS_FILE}): send it with /update_adapter and /end_adapter first")
        return real

    def _verify(self, path: str, name: str) -> None:
        """Check the directory's config and tensors as ``/check_adapter`` checks an adapter
        (``VersionRejected`` if they do not fit the served model), before PEFT injects its layers
        into the model: a load PEFT would fail half-way never leaves the model changed."""
        from safetensors.torch import load_file

        try:
            with open(os.path.join(path, CONFIG_FILE)) as f:
                config = json.load(f)
            specs = tuple(TensorSpec.of(n, t) for n, t in load_file(os.path.join(path, WEIGHTS_FILE)).items())
            self.check(AdapterCheck(name, config, specs))
        except VersionRejected:
            raise
        except Exception as e:  # unreadable JSON or safetensors (their libraries raise their own kinds), a bad config
            raise VersionRejected(f"{path} is no adapter this server can load: {type(e).__name__}: {e}") from None

    def unload(self, name: str) -> None:
        if name not in self.loaded:
            raise AdapterNotFound(f"The lora adapter '{name}' cannot be found.")
        with self.serve_lock:
            self.peft.delete_adapter(name)
            del self.loaded[name]

    @contextlib.contextmanager
    def active(self, name: str | None) -> Iterator[None]:
        """(Holding ``serve_lock``.) The model runs with adapter ``name``, or the base for None."""
        if name is not None and name not in self.loaded:
            raise AdapterNotFound(f"The model '{name}' does not exist.")
        if self.peft is None:
            yield
        elif name is None:
            with self.peft.disable_adapter():
                yield
        else:
            self.peft.set_adapter(name)
            yield

    def models(self) -> list[dict[str, Any]]:
        return [{"id": BASE_MODEL, "object": "model"}] + [
            {"id": name, "object": "model", "root": path, "parent": BASE_MODEL} for name, path in self.loaded.items()]

    def close(self) -> None:
        self.files.close()
