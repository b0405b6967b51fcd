"""A receiver's side of ``lora: adapter``: a verified adapter version written as a PEFT directory.

Every receiver that takes adapter versions (the reference server, asyncsync's vLLM backend, the
receiver beside an SGLang server) writes them here, and the engine loads them from there through
its own API (``protocol/lora.py`` has the messages and the directory names)::

    files = AdapterFiles()
    path = files.write(adapter, version, staged.tensors())   # adapter_config.json + adapter_model.safetensors
    files.retain(adapter, version)                            # the slot's other versions, unless kept, removed
    files.close()                                             # at shutdown: every directory written here

A directory is written under a temporary name and renamed into place, so an engine never reads a
half-written adapter. Each slot records the pid of the receiver that writes it (``WRITER``); a new
``AdapterFiles`` removes the slots of receivers that no longer run (a server killed before its
clean-up), so a crash leaves nothing in tmpfs for long. The tensors are written with the ``safetensors`` library, the format PEFT's
``save_pretrained`` writes and every engine's loader reads.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
from collections.abc import Iterable

import torch

from asyncsync.protocol.lora import CONFIG_FILE, LORA_ROOT, WEIGHTS_FILE, AdapterVersion, parse_version_name
from asyncsync.protocol.shm import alive

log = logging.getLogger(__name__)

WRITER = ".writer"  # in each slot: the pid of the receiver process that writes it


class AdapterFiles:
    """PEFT directories of adapter versions under ``root`` (the host's tmpfs), one folder per slot."""

    def __init__(self, root: str = LORA_ROOT):
        self.root = root
        self._slots: set[str] = set()
        for slot in self.sweep():
            log.warning("removed adapter directories %s: their receiver no longer runs", os.path.join(root, slot))

    def write(self, adapter: AdapterVersion, version: int, tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
        """Write ``version`` (its verified tensors, PEFT's saved names) as a PEFT directory; its path."""
        from safetensors.torch import save_file

        path = adapter.path(version, self.root)
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        if adapter.slot not in self._slots:
            with open(os.path.join(folder, WRITER), "w") as f:
                f.write(str(os.getpid()))
            self._slots.add(adapter.slot)
        staging = f"{path}.writing-{os.getpid()}-{secrets.token_hex(3)}"
        os.makedirs(staging)
        try:
            save_file({n: t.contiguous() for n, t in tensors}, os.path.join(staging, WEIGHTS_FILE), metadata={"format": "pt"})
            with open(os.path.join(staging, CONFIG_FILE), "w") as f:
                json.dump(adapter.config, f, indent=2, sort_keys=True)
            if os.path.isdir(path):  # the same version again (a trainer that resent it): the new bytes win
                shutil.rmtree(path)
            os.rename(staging, path)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return path

    def retain(self, adapter: AdapterVersion, version: int) -> list[int]:
        """Remove the slot's versions of ``adapter.name`` that are neither ``version`` nor in
        ``adapter.keep`` (the engine has unloaded them); the versions removed."""
        folder = os.path.join(self.root, adapter.slot)
        keep = {version, *adapter.keep}
        removed = []
        for entry in os.listdir(folder) if os.path.isdir(folder) else ():
            v = parse_version_name(entry, adapter.name)
            if v is not None and v not in keep:
                shutil.rmtree(os.path.join(folder, entry), ignore_errors=True)
                removed.append(v)
        return sorted(removed)

    def sweep(self) -> list[str]:
        """Remove the slots whose writer process is gone (on this host: the pid no longer exists)."""
        removed = []
        for slot in os.listdir(self.root) if os.path.isdir(self.root) else ():
            try:
                with open(os.path.join(self.root, slot, WRITER)) as f:
                    writer = int(f.read().strip())
            except (OSError, ValueError):  # being written: left alone
                continue
            if not alive(writer):
                shutil.rmtree(os.path.join(self.root, slot), ignore_errors=True)
                removed.append(slot)
        return removed

    def close(self) -> None:
        """Remove every slot this receiver wrote into (best effort: at shutdown)."""
        for slot in self._slots:
            shutil.rmtree(os.path.join(self.root, slot), ignore_errors=True)
        self._slots.clear()
