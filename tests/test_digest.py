"""The trainer's digests: what a relay forwards is committed only where it is what the trainer published.

A relaying server that changes a bucket and recomputes every checksum it can (the bucket's CRC32C in
the manifest it forwards) makes no server below it commit: each hashes what it received and compares
with the digests the trainer sent it over its own control channel. The forger is named (a ``forged``
event) and evicted, the servers below it get the version again, whole, from a tree without it, and
the versions after go on.
"""

from __future__ import annotations

import blake3
import pytest
import torch

from asyncsync import WeightSync, WeightSyncConfig
from asyncsync.protocol.checksum import bucket_crc
from asyncsync.protocol.digest import NOT_PUBLISHED, bucket_digest, digest_problems
from asyncsync.protocol.relay import Forward
from asyncsync.protocol.staging import StagedVersion
from asyncsync.receivers.reference.app import ReferenceServer
from asyncsync.testing import mixed_dtype_model

from conftest import TINY
from helpers import ThreadedServer, digest


def test_a_bucket_digest_is_blake3_of_its_bytes_and_any_difference_is_named():
    buf = torch.arange(64, dtype=torch.uint8)
    assert bucket_digest(buf) == blake3.blake3(bytes(range(64))).hexdigest()
    assert bucket_digest(buf.view(torch.int32)) == bucket_digest(buf), "the bytes are hashed, whatever their dtype"
    other = buf.clone()
    other[7] ^= 1
    ours, theirs = (bucket_digest(buf), bucket_digest(buf)), (bucket_digest(buf), bucket_digest(other))
    assert digest_problems(ours, ours, 4) == []
    (problem,) = digest_problems(theirs, ours, 4)
    assert "bucket(s) [1] of version 4" in problem and NOT_PUBLISHED in problem
    assert "carried none" in digest_problems(ours, (), 4)[0]
    assert "2 digest(s) for the 1 bucket(s)" in digest_problems(ours[:1], ours, 4)[0]


def test_a_version_no_way_in_hashed_is_hashed_when_end_carries_digests():
    """A staged version that was not hashed as it landed (a shared-memory one) is checked when ``end``
    carries the trainer's digests: it fails closed, never passes for lack of its own digests."""
    buffers = (torch.arange(64, dtype=torch.uint8), torch.arange(32, dtype=torch.uint8))
    staged = StagedVersion(5, buffers, (), ())
    published = tuple(bucket_digest(b) for b in buffers)
    assert staged.unpublished(()) == [], "announced and ended without digests: nothing to compare"
    assert staged.unpublished(published) == []
    other = (published[0], bucket_digest(torch.zeros(32, dtype=torch.uint8)))
    (problem,) = staged.unpublished(other)
    assert "bucket(s) [1] of version 5" in problem and NOT_PUBLISHED in problem


class Forging(Forward):
    """A relaying server's forward that changes bucket 0's first tensor and rewrites that bucket's
    CRC32C in the manifest it forwards: every check a server below could make of its own, passes."""

    def send(self, index: int, payload: torch.Tensor, deadline_s: float | None) -> None:
        if index == 0:
            forged = payload.clone()
            forged[:4] ^= 0x5A
            self.crc = bucket_crc(forged)
            payload = forged
        elif payload.dtype == torch.int64 and hasattr(self, "crc"):  # the manifest, last
            payload = payload.clone()
            payload[0] = self.crc
        super().send(index, payload, deadline_s)


def forging(server: ReferenceServer) -> None:
    """Make ``server`` forge every version it forwards (its receiving is untouched)."""
    edges = server.receiver.stager.joined.relay
    made = edges.forward

    def forward(*args: object, **kwargs: object) -> Forward:
        honest = made(*args, **kwargs)
        rogue = Forging(honest.edges, honest.frames, honest.runtime, honest.in_flight)
        return rogue

    edges.forward = forward  # type: ignore[method-assign]


@pytest.mark.parametrize("async_weight_update", [False, True], ids=["blocking", "async"])
def test_a_forging_relay_is_refused_below_named_evicted_and_the_versions_go_on(async_weight_update):
    model = mixed_dtype_model(TINY)
    servers = [ReferenceServer(mixed_dtype_model(TINY)) for _ in range(3)]
    forging(servers[1])  # the chain trainer -> s0 -> s1 -> s2: s1 forges what it forwards to s2
    with ThreadedServer(servers[0]) as s0, ThreadedServer(servers[1]) as s1, ThreadedServer(servers[2]) as s2:
        cfg = WeightSyncConfig.from_dict({"servers": [s0.url, s1.url, s2.url], "fanout": 1,
                                          "transport": "collective", "readmit_interval_s": 3600, "max_staleness": 0,
                                          "async_weight_update": async_weight_update})
        assert cfg.digests, "digest: auto is on with a relay"
        with WeightSync(cfg) as sync:
            sync.connect(model)
            for version in (1, 2, 3):
                sync.wait_snapshot()
                with torch.no_grad():  # a sparse step: versions 2 and 3 go as deltas, rebuilt and hashed below
                    next(model.parameters()).view(-1)[:4] += 0.01 * version
                sync.publish(model, version)
                assert sync.wait_for_fresh_servers(version, timeout=60), sync.events
                assert digest(servers[0].model) == digest(model), f"s0 serves version {version}"
                assert digest(servers[2].model) == digest(model), f"s2 serves version {version}, not the forgery"
            sync.close()
        forged = [e for e in sync.events if e.kind == "forged"]
        assert [e.server for e in forged] == [s1.url], sync.events
        assert f"{s2.url}, below it" in forged[0].detail and NOT_PUBLISHED in forged[0].detail
        assert any(e.kind == "evicted" and e.server == s1.url for e in sync.events)
        refused = [e for e in sync.events if e.kind == "refused" and e.server == s2.url]
        assert len(refused) == 1 and NOT_PUBLISHED in refused[0].detail, "s2 refused the forgery of version 1, once"
        assert list(servers[2].receiver.applied) == [1, 2, 3], "s2 committed every version, whole, and no forgery"
        deltas = {r.version: r.delta_buckets for r in sync.metrics.history}
        assert deltas[1] == 0 and deltas[3] > 0, "version 3 went down the chain as deltas, each rebuilt bucket hashed"
        assert sync.server_versions[s0.url] == sync.server_versions[s2.url] == 3


def test_without_digests_the_same_forgery_is_committed_below_it():
    """The control: with ``digest: off`` the forged bucket passes every check a server below can make
    of its own (its CRC32C was rewritten in the manifest), and s2 serves bytes the trainer never
    published. This is what the digests close."""
    model = mixed_dtype_model(TINY)
    servers = [ReferenceServer(mixed_dtype_model(TINY)) for _ in range(2)]
    forging(servers[0])
    with ThreadedServer(servers[0]) as s0, ThreadedServer(servers[1]) as s1:
        cfg = WeightSyncConfig.from_dict({"servers": [s0.url, s1.url], "fanout": 1, "delta": "off", "digest": "off",
                                          "transport": "collective"})
        with WeightSync(cfg) as sync:
            sync.connect(model)
            result = sync.publish(model, 1)
        assert result.server_versions == {s0.url: 1, s1.url: 1} and not result.failures
        assert digest(servers[0].model) == digest(model)
        assert digest(servers[1].model) != digest(model), "s1 serves the forgery: nothing below a relay saw it"
