"""The data plane's keys and the trainer's store, piece by piece (``protocol.keys``, ``protocol.group``,
``protocol.frames``): what a peer without a group's key can and cannot do, on real stores and gloo
groups in this process, and a store that cannot listen as the sync's own error."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
from torch.distributed import TCPStore

from asyncsync.config import WeightSyncConfig
from asyncsync.models import build_model
from asyncsync.protocol.device import HostRuntime
from asyncsync.protocol.frames import FrameSeal, VersionFrames
from asyncsync.protocol.group import DataPlaneError, DataPlaneGroup, serve_store
from asyncsync.protocol.keys import Forged, SealedStore, new_key
from asyncsync.protocol.wire import BucketMeta, GroupSpec, UpdateRequest
from asyncsync.receivers.reference.app import ReferenceServer
from asyncsync.transport import epochs as epochs_module
from asyncsync.transport.fleet import SyncError
from asyncsync.transport.topology import RendezvousStore

from conftest import TINY
from helpers import ThreadedServer, Trainer, listening_addresses

KEY = bytes.fromhex(new_key())


def client(port: int) -> TCPStore:
    return TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=5), wait_for_workers=False)


def test_a_sealed_value_is_read_and_a_forged_one_never_is():
    store = serve_store("127.0.0.1", 0, 5.0)
    member, foreign = SealedStore(client(store.port), KEY, 1.0), client(store.port)
    foreign.set("addr", b"10.0.0.66:1")  # written ahead of the member's own: waited past
    threading.Timer(0.3, member.set, ("addr", b"10.0.0.1:29500")).start()
    start = time.monotonic()
    assert member.get("addr") == b"10.0.0.1:29500" and 0.25 < time.monotonic() - start < 1.0
    foreign.set("addr", b"10.0.0.66:1")  # written over it, and again: never read, and said so by the deadline
    with pytest.raises(Forged, match="held only forged values of 'addr' for 1s"):
        member.get("addr")
    other = SealedStore(client(store.port), bytes.fromhex(new_key()), 0.3)
    member.set("addr", b"10.0.0.1:29500")
    with pytest.raises(Forged):
        other.get("addr")  # another group's key: another group's value is no value of this one


def test_a_frame_header_opens_only_in_the_group_it_was_sealed_for():
    request = UpdateRequest(3, (BucketMeta(("w",), ("float32",), ((4,),), 16),), checksum=True)
    header = VersionFrames.of(request).header(0, torch.zeros(16, dtype=torch.uint8))
    seal = FrameSeal(KEY, b"asyncsync.1.abc")
    assert seal.open(seal.tensor(header)) == header and seal.open(seal.tensor(header)).authentic
    for other in (FrameSeal(KEY, b"asyncsync.1.abd"), FrameSeal(bytes.fromhex(new_key()), b"asyncsync.1.abc")):
        assert not other.open(seal.tensor(header)).authentic
    flipped = seal.tensor(header)
    flipped[-1] ^= 1
    assert not seal.open(flipped).authentic
    why = VersionFrames.of(request).mismatch(seal.open(header.tensor()), 0, 16)  # an unsealed header
    assert why is not None and "does not carry this group's MAC" in why


def test_a_member_that_got_past_the_rendezvous_without_the_key_is_found_before_any_version_byte(monkeypatch):
    """As if a peer had taken rank 1's place at gloo's pair listener (the store seals every address,
    so here the store is made to take any value): the proof of the key, right after the group
    forms, fails on every rank, naming rank 1; no broadcast is ever posted."""
    monkeypatch.setattr(SealedStore, "opened", lambda self, key, raw: raw[:-32])
    store = serve_store("127.0.0.1", 0, 10.0)
    spec = GroupSpec("127.0.0.1", store.port, 2, "impostor", "gloo", 10.0, key=new_key())
    impostor = GroupSpec("127.0.0.1", store.port, 2, "impostor", "gloo", 10.0, key=new_key())
    with ThreadPoolExecutor(2) as pool:
        trainer = pool.submit(DataPlaneGroup.join, spec, 0, HostRuntime(), True, None, None, store)
        peer = pool.submit(DataPlaneGroup.join, impostor, 1, HostRuntime())
        with pytest.raises(DataPlaneError, match="rank 1 of group 'impostor' did not prove the group's key"):
            trainer.result(30)
        with pytest.raises(DataPlaneError, match="did not prove the group's key"):
            peer.result(30)


def test_the_store_listens_on_its_address_only_and_a_taken_port_is_named():
    store = serve_store("127.0.0.1", 0, 5.0)
    assert listening_addresses(store.port) == {"0100007F"}, "torch's own store would listen on every interface"
    with pytest.raises(DataPlaneError, match=f"cannot listen on 127.0.0.1:{store.port}: .*EADDRINUSE"):
        serve_store("127.0.0.1", store.port, 5.0)
    fallback = RendezvousStore("127.0.0.1", store.port, 5.0)  # a configured port taken: a free one, logged
    assert fallback.port != store.port
    fallback.close()


def test_a_store_out_of_file_descriptors_is_a_data_plane_error():
    """EMFILE, which torch's store raises as a bare ``DistNetworkError``, in a child process whose
    open-file limit is what it already holds."""
    code = (
        "import os, resource\n"
        "from asyncsync.protocol.group import DataPlaneError, serve_store\n"
        "held = len(os.listdir('/proc/self/fd')) - 1\n"  # less the listing's own
        "resource.setrlimit(resource.RLIMIT_NOFILE, (held, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
        "try:\n"
        "    serve_store('127.0.0.1', 0, 5.0)\n"
        "except DataPlaneError as e:\n"
        "    print('refused:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "refused:" in out.stdout and "EMFILE" in out.stdout, (out.stdout, out.stderr)


def test_a_store_that_cannot_listen_fails_connect_with_the_reason(monkeypatch):
    def no_files(host: str, port: int, timeout_s: float) -> TCPStore:
        raise DataPlaneError(f"the rendezvous store cannot listen on {host}:{port}: Too many open files (EMFILE)")

    monkeypatch.setattr(epochs_module.RendezvousStore, "__init__", lambda self, *a: no_files(*a))
    with ThreadedServer(ReferenceServer(build_model(TINY))) as server:
        with pytest.raises(SyncError, match=r"no server could join the data plane: .*EMFILE"):
            Trainer(WeightSyncConfig.from_dict({"servers": [server.url]}))
