"""The receiving half's parts, each on its own (``protocol.staging``, ``protocol.joined``,
``protocol.shm.MappedSegments``, ``protocol.intake``): the buffers a version lands in and what the
live weights still alias, the data-plane groups joined and left, the mapping cache, and the three
intakes over a real gloo group with the trainer as rank 0. The receivers' own tests run them all
together, end to end."""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from asyncsync.protocol.admission import Admission, BucketRefused, VersionRejected
from asyncsync.protocol.arena import Arena, DeviceRing, HostArena
from asyncsync.protocol.checksum import crc32c_of
from asyncsync.protocol.delta import delta_word
from asyncsync.protocol.device import HostRuntime
from asyncsync.protocol.group import DataPlaneGroup, free_port
from asyncsync.protocol.intake import BucketAssembly, SharedMemoryIntake, WireIntake, buckets_of
from asyncsync.protocol.joined import JoinedGroups
from asyncsync.protocol.shm import ALIGN, SHM_DIR, HostIdentity, MappedSegments, ShmUnavailable
from asyncsync.protocol.specs import BucketPlan, TensorSpec
from asyncsync.protocol.staging import StagedVersion, StagingBuffers
from asyncsync.protocol.wire import BucketMeta, DeltaVersion, GroupSpec, SharedVersion, UpdateRequest, WireError

from helpers import send_frames
from test_delta_format import reference_delta

ROUTE = "/init"


def tensors(version: int) -> dict[str, torch.Tensor]:
    """Two tensors of a version (of different dtypes: two offsets in one bucket)."""
    return {"a": torch.full((64, 16), float(version)), "b": torch.arange(32, dtype=torch.int32) + version}


PLAN = BucketPlan.from_tensors(list(tensors(0).items()))  # one bucket
LAYOUT = tuple(BucketMeta.of(b) for b in PLAN.buckets)
EXPECTED = {name: TensorSpec.of(name, t) for name, t in tensors(0).items()}
NBYTES = sum(m.nbytes for m in LAYOUT)


def packed(version: int) -> list[torch.Tensor]:
    """Each bucket of ``version``'s tensors, as the trainer packs it."""
    values = tensors(version)
    out = []
    for bucket in PLAN.buckets:
        flat = torch.empty(bucket.nbytes, dtype=torch.uint8)
        for spec, offset in zip(bucket.specs, bucket.offsets):
            flat[offset : offset + spec.nbytes] = values[spec.name].reshape(-1).view(torch.uint8)
        out.append(flat)
    return out


def staged_in(buffers: tuple[torch.Tensor, ...], version: int = 1) -> StagedVersion:
    return StagedVersion.of(version, buffers, tuple(m.to_bucket(i) for i, m in enumerate(LAYOUT)))


def assert_serves(staged: StagedVersion, version: int) -> None:
    want = tensors(version)
    assert {n: torch.equal(t, want[n]) for n, t in staged.tensors()} == {n: True for n in want}


# -- StagingBuffers --------------------------------------------------------------------------------

def test_two_arenas_are_received_into_in_turn_never_the_one_the_live_weights_alias():
    first, second = Arena.on_device(NBYTES, torch.device("cpu")), Arena.on_device(NBYTES, torch.device("cpu"))
    buffers = StagingBuffers(HostRuntime(), (first, second))
    buffers.stage_in((first, second), live=first)
    target = buffers.for_layout(LAYOUT)
    assert target.buffers[0].data_ptr() == second.tensor.data_ptr(), "the arena the live weights alias is kept"
    buffers.mark_live(staged_in(target.buffers))
    assert buffers.for_layout(LAYOUT).buffers[0].data_ptr() == first.tensor.data_ptr()
    assert buffers.holds == () and buffers.ring is None


def test_one_arena_forgets_the_committed_baseline_once_it_is_received_into_again():
    arena = Arena.on_device(NBYTES, torch.device("cpu"))
    buffers = StagingBuffers(HostRuntime(), (arena,))
    staged = staged_in(buffers.for_layout(LAYOUT).buffers)
    buffers.mark_committed(staged)
    assert buffers.committed is staged, "a copied-out version is the next delta's baseline"
    buffers.for_layout(LAYOUT)
    assert buffers.committed is None, "its bytes are about to be overwritten"


def test_without_an_arena_a_set_per_layout_is_reused_but_never_the_live_one():
    buffers = StagingBuffers(HostRuntime())
    first = buffers.for_layout(LAYOUT)
    assert buffers.for_layout(LAYOUT) is first
    staged = StagedVersion.of(1, first.buffers, buckets_of(UpdateRequest(1, LAYOUT, False)), segment="seg")
    buffers.mark_live(staged)
    assert buffers.holds == ("seg",) and buffers.committed is staged
    second = buffers.for_layout(LAYOUT)
    assert second is not first and buffers.for_layout(LAYOUT) is second
    other = (BucketMeta.of(BucketPlan.from_tensors([("c", torch.zeros(3))]).buckets[0]),)
    assert all(buffers.for_layout(other) is not s for s in (first, second))
    third = buffers.for_layout(LAYOUT)  # the set of a stale layout was dropped, the live one is never used
    assert all(third is not s for s in (first, second))
    buffers.mark_committed(staged)
    assert buffers.holds == ()


def test_spare_buffers_come_from_a_set_of_the_same_layout_and_keep_drops_the_others():
    buffers = StagingBuffers(HostRuntime())
    old = buffers.for_layout(LAYOUT)
    spare = buffers.spare(0, LAYOUT[0])
    assert spare is old.buffers[0]
    other = BucketMeta.of(BucketPlan.from_tensors([("c", torch.zeros(3))]).buckets[0])
    assert buffers.spare(0, other) is not old.buffers[0], "another layout gets a buffer of its own"
    assembled = buffers.for_layout((other,))
    buffers.keep(assembled)
    assert buffers.for_layout((other,)) is assembled and buffers.spare(0, LAYOUT[0]) is not old.buffers[0]


def test_a_host_arena_on_a_device_runtime_lands_through_a_ring():
    device_like = SimpleNamespace(kind="cuda", device=torch.device("cpu"))
    arena = HostArena(NBYTES)
    assert isinstance(StagingBuffers(device_like, (arena,)).ring, DeviceRing)  # type: ignore[arg-type]
    assert StagingBuffers(HostRuntime(), (arena,)).ring is None
    assert StagingBuffers(device_like, (Arena.on_device(NBYTES, torch.device("cpu")),)).ring is None  # type: ignore[arg-type]


# -- MappedSegments --------------------------------------------------------------------------------

@contextlib.contextmanager
def segment(data: bytes) -> Iterator[str]:
    name = f"asyncsync-{os.getpid()}-{secrets.token_hex(4)}-0"
    path = os.path.join(SHM_DIR, name)
    with open(path, "wb") as f:
        f.write(data)
    try:
        yield name
    finally:
        os.unlink(path)


def test_each_segment_is_mapped_once_and_only_the_live_one_and_the_last_are_kept():
    mappings = MappedSegments()
    with segment(b"a" * 128) as a, segment(b"b" * 128) as b, segment(b"c" * 128) as c:
        first = mappings.map(a, 128)
        assert mappings.map(a, 64) is first, "mapped again only to grow"
        mappings.map(b, 128, keep=(a,))
        assert mappings.map(a, 128, keep=(a,)) is first, "the live weights' segment stays mapped"
        mappings.map(c, 128)
        assert mappings.map(a, 128) is not first, "a segment neither live nor last was let go"
        assert bytes(mappings.map(b, 128).numpy()) == b"b" * 128
    with pytest.raises(ShmUnavailable, match="cannot be opened here"):
        mappings.map(f"asyncsync-{os.getpid()}-00-9", 8)


# -- JoinedGroups ----------------------------------------------------------------------------------

def spec(world: int = 2) -> GroupSpec:
    return GroupSpec("127.0.0.1", free_port(), world, f"parts{free_port()}", "gloo", 20.0)


@dataclass
class Joined:
    trainer: DataPlaneGroup
    joined: JoinedGroups


@contextlib.contextmanager
def joined_to_a_trainer() -> Iterator[Joined]:
    """A receiver's ``JoinedGroups`` as rank 1 of a gloo group whose rank 0 plays the trainer."""
    group_spec, trainer = spec(), []
    rank0 = threading.Thread(target=lambda: trainer.append(DataPlaneGroup.join(group_spec, 0, HostRuntime())))
    rank0.start()
    joined = JoinedGroups(HostRuntime(), ROUTE)
    joined.join(group_spec, 1)
    rank0.join(30)
    try:
        yield Joined(trainer[0], joined)
    finally:
        joined.leave()
        trainer[0].close()


def test_a_group_of_another_backend_is_refused_before_any_rendezvous_and_none_is_required_unjoined():
    joined = JoinedGroups(HostRuntime(), ROUTE)
    nccl = GroupSpec("127.0.0.1", free_port(), 2, "g", "nccl", 1.0)  # nobody listens: a rendezvous would hang
    with pytest.raises(WireError, match="uses nccl, but this server's weights are on cpu, which take gloo"):
        joined.join(nccl, 1)
    assert joined.group is None
    with pytest.raises(VersionRejected, match="no data-plane group: call /init before sending updates"):
        joined.require()


def test_groups_are_joined_and_left_together():
    with joined_to_a_trainer() as link:
        assert link.joined.require() is link.joined.group and len(link.joined.groups) == 1
        link.joined.leave(broken=True)
        assert link.joined.group is None and link.joined.groups == []


# -- WireIntake ------------------------------------------------------------------------------------

def sending(link: Joined, request: UpdateRequest, payloads: list[torch.Tensor],
            crcs: list[int] | None) -> threading.Thread:
    thread = threading.Thread(target=send_frames, args=(link.trainer, request, payloads, crcs))
    thread.start()
    return thread


def crcs_of(version: int) -> list[int]:
    return [crc32c_of(p) for p in packed(version)]


def test_a_whole_version_lands_in_the_arena_itself_and_is_verified():
    arena = Arena.on_device(NBYTES, torch.device("cpu"))
    buffers = StagingBuffers(HostRuntime(), (arena,))
    with joined_to_a_trainer() as link:
        intake = WireIntake(Admission(EXPECTED), buffers, link.joined)
        request = UpdateRequest(1, LAYOUT, checksum=True)
        sender = sending(link, request, packed(1), crcs_of(1))
        staged = intake.receive(request, served_version=0)
        sender.join(30)
        assert_serves(staged, 1)
        assert staged.buffers[0].data_ptr() == arena.tensor.data_ptr(), "no copy: the bytes landed in the arena"
        corrupt = UpdateRequest(2, LAYOUT, checksum=True)
        sender = sending(link, corrupt, packed(2), [c ^ 1 for c in crcs_of(2)])
        with pytest.raises(VersionRejected, match=r"version 2 rejected: checksum mismatch in bucket\(s\) \[0\]"):
            intake.receive(corrupt, served_version=1)
        sender.join(30)
        assert link.joined.group is not None, "a version received to its end leaves the group as it was"


def test_a_version_that_cannot_be_received_is_refused_before_any_allocation_and_the_groups_are_left(monkeypatch):
    buffers = StagingBuffers(HostRuntime())
    monkeypatch.setattr(buffers, "for_layout", lambda layout: pytest.fail("buffers were asked for"))
    with joined_to_a_trainer() as link:
        intake = WireIntake(Admission(EXPECTED, max_version_bytes=NBYTES - 1), buffers, link.joined)
        with pytest.raises(VersionRejected, match=rf"more than this receiver's budget of {NBYTES - 1}.*call /init again"):
            intake.receive(UpdateRequest(1, LAYOUT, checksum=True), served_version=0)
        assert link.joined.group is None, "left: the trainer's broadcasts fail at once"


def test_a_delta_is_rebuilt_from_the_committed_version_and_refused_without_one():
    buffers = StagingBuffers(HostRuntime(), (Arena.on_device(NBYTES, torch.device("cpu")),))
    old = packed(1)[0]
    new = old.clone()
    new[:16] = 7  # a few words changed
    encoded = reference_delta(old.numpy(), new.numpy(), delta_word(PLAN.buckets[0]))
    payload = torch.from_numpy(np.frombuffer(encoded, np.uint8).copy())
    request = UpdateRequest(2, LAYOUT, checksum=True, delta=DeltaVersion(1, (payload.numel(),)))
    with joined_to_a_trainer() as link:
        intake = WireIntake(Admission(EXPECTED), buffers, link.joined)
        sender = sending(link, request, [payload], [crc32c_of(new)])
        with pytest.raises(VersionRejected, match="holds no committed version intact"):
            intake.receive(request, served_version=1)
        sender.join(30)
        whole = UpdateRequest(1, LAYOUT, checksum=True)
        sender = sending(link, whole, [old], [crc32c_of(old)])
        buffers.mark_committed(intake.receive(whole, served_version=0))
        sender.join(30)
        sender = sending(link, request, [payload], [crc32c_of(new)])
        rebuilt = intake.receive(request, served_version=1)
        sender.join(30)
        assert torch.equal(rebuilt.buffers[0], new)


# -- SharedMemoryIntake ----------------------------------------------------------------------------

def shared_request(name: str, version: int, crcs: list[int]) -> UpdateRequest:
    shm = SharedVersion(name, (0,), tuple(crcs), HostIdentity.here())  # type: ignore[arg-type]
    return UpdateRequest(version, LAYOUT, checksum=True, shm=shm)


@pytest.mark.parametrize("with_arena", [False, True], ids=["zero-copy", "copied"])
def test_a_shared_version_is_served_from_the_mapping_or_copied_once_into_the_arena(with_arena):
    data = packed(1)[0].numpy().tobytes()
    arenas = (Arena.on_device(NBYTES, torch.device("cpu")),) if with_arena else ()
    buffers = StagingBuffers(HostRuntime(), arenas)
    intake = SharedMemoryIntake(Admission(EXPECTED), buffers)
    with segment(data + bytes(-len(data) % ALIGN)) as name:
        staged = intake.adopt(shared_request(name, 1, crcs_of(1)), served_version=0)
        assert_serves(staged, 1)
        assert staged.segment == (None if with_arena else name)
        buffers.mark_live(staged)
        assert buffers.holds == (() if with_arena else (name,)), "only a mapping served from is held"
        with pytest.raises(VersionRejected, match=r"version 2 rejected: checksum mismatch in bucket\(s\) \[0\]"):
            intake.adopt(shared_request(name, 2, [c ^ 1 for c in crcs_of(1)]), served_version=1)
        with pytest.raises(VersionRejected, match="version 1 is not newer than the served version 1"):
            intake.adopt(shared_request(name, 1, crcs_of(1)), served_version=1)


# -- BucketAssembly --------------------------------------------------------------------------------

def test_a_version_is_assembled_bucket_by_bucket_and_sealed_whole():
    two = BucketPlan.from_tensors(list(tensors(0).items()), bucket_bytes=1)  # one tensor per bucket
    metas = [BucketMeta.of(b) for b in two.buckets]

    def payloads(version: int) -> list[torch.Tensor]:
        return [tensors(version)[b.specs[0].name].reshape(-1).view(torch.uint8) for b in two.buckets]

    buffers = StagingBuffers(HostRuntime())
    with joined_to_a_trainer() as link:
        assembly = BucketAssembly(Admission(EXPECTED), buffers, link.joined)

        def send(meta: BucketMeta, payload: torch.Tensor) -> None:
            sender = threading.Thread(target=link.trainer.broadcast, args=(payload,))
            sender.start()
            assembly.receive_bucket(meta)
            sender.join(30)

        send(metas[0], payloads(1)[0])
        send(metas[0], payloads(2)[0])  # a name again: the unfinished version was abandoned
        with pytest.raises(VersionRejected, match=r"version 2 rejected: .*1 tensor\(s\) it loads are not sent"):
            assembly.seal(2, served_version=0)
        for meta, payload in zip(metas, payloads(3)):
            send(meta, payload)
        assert_serves(assembly.seal(3, served_version=0), 3)
        unknown = BucketMeta.of(BucketPlan.from_tensors([("c", torch.zeros(3))]).buckets[0])
        with pytest.raises(BucketRefused, match="bucket refused before its broadcast"):
            assembly.receive_bucket(unknown)  # nothing sent: it took no part in a broadcast
