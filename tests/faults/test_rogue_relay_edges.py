"""A server above others that lies: the upper end of a relay edge (the test, as rank 0 of the edge's
stream) sends two reference servers in a chain below it (child processes, so a crash would show as
an exit) what no honest relay sends. gloo aborts a process that is sent more than it posted, and a
gloo edge was therefore never safe against its upper end; a stream edge is read with bounded,
checked reads (``protocol.stream``). Whatever arrives, no server dies: each refuses the version (409
naming the frame, or 503 for a stream that ended or stalled), keeps serving the same weights and
tokens, and takes a valid version afterwards, bit-exact, through a real trainer's relay. A rogue
that forges a tensor and recomputes every checksum it can is refused at /end by the trainer's
digests."""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from asyncsync.config import WeightSyncConfig
from asyncsync.launch.http import http_call
from asyncsync.protocol.checksum import bucket_crc
from asyncsync.protocol.digest import NOT_PUBLISHED, bucket_digest
from asyncsync.protocol.frames import FrameHeader, VersionFrames
from asyncsync.protocol.wire import EndRequest
from asyncsync.testing import RogueRelay, ServerProcess, mixed_dtype_model, version_of

from conftest import TINY
from helpers import Trainer, digest, weights

PROMPT = {"prompt": [5, 6, 7], "max_new_tokens": 6}
DEADLINE_S = 2.0  # each frame's, as the rogue announces them: a stalled stream is refused by then


@pytest.fixture(scope="module")
def chain() -> Iterator[list[ServerProcess]]:
    with ServerProcess(mixed_dtype_model, (TINY,)) as upper, ServerProcess(mixed_dtype_model, (TINY,)) as lower:
        yield [upper, lower]


def served(servers: list[ServerProcess]) -> list[tuple[Any, Any]]:
    return [(s.get("/weights/digest"), s.post("/generate", PROMPT)) for s in servers]


def lies(rogue: RogueRelay, request: Any, flat: list[torch.Tensor]) -> dict[str, tuple[list[torch.Tensor], bool]]:
    """Each lie: what the rogue sends down the edge, and whether it ends the stream after it."""
    frames = VersionFrames.of(request)
    sealed = [rogue.edge.seal.tensor(frames.header(i, b)) for i, b in enumerate(flat)]
    first, n = flat[0], flat[0].numel()
    garbage = torch.frombuffer(bytearray(secrets.token_bytes(64)), dtype=torch.uint8)
    return {
        "an over-long payload": ([sealed[0], torch.cat([first, torch.zeros(4096, dtype=torch.uint8)]), sealed[1]], False),
        "garbage for a header": ([garbage, first], False),
        "a header where a payload belongs": ([sealed[0], sealed[1], first, flat[1]], False),
        "a short payload, then the next frame": ([sealed[0], first[: n - 100], sealed[1], flat[1]], False),
        "a short payload, then the end": ([sealed[0], first[: n - 100]], True),
        "a short payload, then silence": ([sealed[0], first[: n - 100]], False),
        "a header without the edge's MAC": ([frames.header(0, first).tensor(), first], False),
        "an old version's frames": ([rogue.edge.seal.tensor(FrameHeader(frames.plan, request.version - 1, 0, n)),
                                     first], False),
    }


@pytest.mark.parametrize("lie", ["an over-long payload", "garbage for a header", "a header where a payload belongs",
                                 "a short payload, then the next frame", "a short payload, then the end",
                                 "a short payload, then silence", "a header without the edge's MAC",
                                 "an old version's frames"])
def test_no_lie_of_the_server_above_kills_a_server_below_and_each_refuses_the_version(chain, lie):
    before = served(chain)
    version = before[0][0]["version"] + 1
    named = weights(mixed_dtype_model(TINY), version)
    names = set(chain[0].get("/weights/names")["names"])
    request, flat = version_of(named, names, version, deadline_s=DEADLINE_S)
    assert len(flat) > 1
    rogue = RogueRelay([s.url for s in chain])
    start = time.monotonic()
    try:
        sends, then_close = lies(rogue, request, flat)[lie]
        answers = rogue.send(request, sends, then_close)
    finally:
        rogue.close()
    took = time.monotonic() - start
    for server in chain:
        assert server.process.is_alive(), f"{server.url} died (exit code {server.process.exitcode}) of {lie}"
        assert answers[server.url][0] in (409, 503), (lie, server.url, answers[server.url])
    status, body = answers[chain[0].url]
    if lie.endswith(("the end", "silence")):  # no frame to judge: the stream ended, or stalled past the deadline
        assert status == 503 and "bytes" in body["error"], body
    else:
        assert status == 409 and f"version {version} rejected before its payload" in body["error"], body
    print(f"{lie}: refused in {took:.2f} s; above: {body['error'][:140]}; below: {answers[chain[1].url][1]['error'][:90]}")
    assert took < 3 * DEADLINE_S + 5, "a lie is refused by the frame's deadline at the latest"
    assert served(chain) == before, "a server's weights or greedy tokens changed"
    takes_a_valid_version_down_a_real_relay(chain, version + 1)


def test_a_forged_tensor_whose_every_checksum_the_rogue_recomputed_is_committed_by_no_server_below(chain):
    """The rogue changes one tensor of bucket 0 and sends, framed and sealed for the edge, the CRC32C
    manifest of what it sent: every check a server below can make of its own passes (each answers its
    /update 200, and each relays what it got). The trainer's digests, which each server gets with /end
    over its own control channel, are the published bytes': both servers refuse the version naming it,
    and serve on unchanged."""
    before = served(chain)
    version = before[0][0]["version"] + 1
    named = weights(mixed_dtype_model(TINY), version)
    names = set(chain[0].get("/weights/names")["names"])
    request, flat = version_of(named, names, version, deadline_s=DEADLINE_S, checksum=True)
    request = dataclasses.replace(request, digest=True)
    published = tuple(bucket_digest(b) for b in flat)
    forged = [flat[0].clone(), *flat[1:]]
    forged[0][:4] ^= 0x5A
    manifest = torch.tensor([bucket_crc(b) for b in forged], dtype=torch.int64)
    rogue = RogueRelay([s.url for s in chain])
    try:
        frames = VersionFrames.of(request)
        payloads = [*forged, manifest]
        sends = [t for i, p in enumerate(payloads) for t in (rogue.edge.seal.tensor(frames.header(i, p)), p)]
        answers = rogue.send(request, sends)
        assert all(status == 200 for status, _ in answers.values()), answers
        ends = {s.url: http_call(s.url, "POST", "/end", EndRequest(version, published).to_json()) for s in chain}
    finally:
        rogue.close()
    for url, (status, body) in ends.items():
        assert status == 409 and NOT_PUBLISHED in body["error"] and "bucket(s) [0]" in body["error"], (url, body)
    assert served(chain) == before, "a server's weights or greedy tokens changed"
    takes_a_valid_version_down_a_real_relay(chain, version + 1)


def takes_a_valid_version_down_a_real_relay(chain: list[ServerProcess], version: int) -> None:
    trainer = Trainer(WeightSyncConfig.from_dict({"servers": [s.url for s in chain], "fanout": 1,
                                                  "bucket_bytes": "16KiB"}))
    try:
        good = weights(mixed_dtype_model(TINY), version)
        assert trainer.publish(good, version) == {s.url: version for s in chain}
        for server in chain:
            names = set(server.get("/weights/names")["names"])
            assert server.get("/weights/digest")["digest"] == {n: d for n, d in digest(good).items() if n in names}
    finally:
        trainer.close()
