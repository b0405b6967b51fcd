"""Route fuzzing: thousands of generated bad requests against a live reference server, then checks.

One reference server (a child process with a bearer token) gets ``requests`` generated requests
(``testing/probes.py``: every route of its route table, each request of one kind of ``KINDS``), up
to ``concurrency`` in flight at a time. Then a rogue trainer on the data plane (``DATA_PLANE_LIES``):
a bucket longer than announced, frames of another plan, a version naming tensors the model lacks or
a petabyte, a trainer that goes silent or stops half-way, a wrong checksum, a stale version, and a
trainer of another data-plane protocol. Throughout, a prober checks that ``/health`` answers and
that the greedy tokens do not change.

The checks (``problems`` in the results, empty when every one holds): no 5xx except the documented
503s (a data-plane route, ``Route.data_plane``, whose group failed or missed a deadline, or that
could not start behind a stalled one; SGLang's ``/ready`` while paused), no request without an
answer, the server alive, its weights and greedy tokens unchanged, every error answer short, its
open files, threads and RSS back near the baseline, and a valid version applied bit-exact afterwards
(greedy tokens equal to the trainer's own decode). ``tests/faults/test_route_fuzz.py`` runs the
campaign in the default suite with fewer requests; ``python -m benchmarks.fuzz`` runs a longer one
and writes its figures.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import socket
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from asyncsync.config import WeightSyncConfig
from asyncsync.launch.http import http_call
from asyncsync.launch.reference import ServerProcess
from asyncsync.models import ModelConfig, generate
from asyncsync.protocol.checksum import crc32c_of
from asyncsync.protocol.frames import FrameHeader, VersionFrames, plan_hash
from asyncsync.protocol.group import free_port
from asyncsync.protocol.keys import new_key
from asyncsync.protocol.shm import SHM_DIR
from asyncsync.protocol.wire import MAX_ERROR_CHARS, BucketMeta, GroupSpec, InitGroupRequest, UpdateRequest
from asyncsync.receivers.reference.app import ReferenceServer
from asyncsync.receivers.reference.receiver import tensor_bytes
from asyncsync.testing import RogueTrainer, mixed_dtype_model
from asyncsync.testing.probes import (
    KINDS, OWNER, ROUTES, SERVED, TOKEN, Context, Outcome, Probe, dumps, exchange, generate_probe, oversized,
)
from asyncsync.trainer.sync import WeightSync

MODEL = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)
PROMPT = [5, 6, 7, 8]
GREEDY = {"prompt": PROMPT, "max_new_tokens": 6}
CONCURRENCY = 200
DATA_PLANE_ROUTES = frozenset(r.path for r in SERVED if r.data_plane)  # their 503 is documented


def campaign(requests: int = 3000, seed: int = 0, concurrency: int = CONCURRENCY) -> dict[str, Any]:
    """Run everything described in the module docstring; the results, with ``problems`` listing every
    check that failed (empty: all held)."""
    torch.manual_seed(seed)
    server = ServerProcess(mixed_dtype_model, (MODEL,), token=TOKEN)
    silent = SilentPeer()
    segment = os.path.join(SHM_DIR, f"asyncsync-{os.getpid()}-f0221-{seed}")
    started = time.monotonic()
    try:
        server.start()
        results = _run(server, silent.port, segment, seed, requests, concurrency)
        results["wall_s"] = round(time.monotonic() - started, 1)
    finally:
        server.stop()
        silent.close()
        if os.path.exists(segment):
            os.unlink(segment)
    results["problems"] = _judge(results)
    return results


def _run(server: ServerProcess, silent_port: int, segment: str, seed: int, requests: int,
         concurrency: int) -> dict[str, Any]:
    """The campaign against a started server: the flood, the data-plane lies, the server afterwards."""
    rng = random.Random(seed)
    url, port = server.url, server.port
    call = _caller(url)
    assert call("POST", "/claim", {"session": OWNER})[0] == 200
    names = set(call("GET", "/weights/names")[1]["names"])
    served_model = mixed_dtype_model(MODEL)  # the server's own start-up weights (same seed)
    named = {n: t for n, t in served_model.state_dict().items() if n in names}
    ctx = Context(named, MODEL.vocab_size, free_port(), silent_port, call("GET", "/host")[1]["host"],
                  os.path.basename(segment))
    with open(segment, "wb") as f:  # a real segment whose bytes match no checksum of the announcement
        f.write(os.urandom(ctx.segment_bytes))
    _warm_up(url, port)
    before = {"resources": resources(server.process.pid), "weights": call("GET", "/weights/digest")[1],
              "tokens": call("POST", "/generate", GREEDY)[1]["completions"]}
    kinds = list(KINDS)
    probes = [generate_probe(rng.choices(kinds, [KINDS[k] for k in kinds])[0], rng, ctx)
              for _ in range(requests)] + oversized(ctx)
    rng.shuffle(probes)
    outcomes, health = asyncio.run(_flood(port, probes, concurrency))
    lies = data_plane_lies(url, named, before["weights"]["version"] + 1)
    time.sleep(2.0)  # let the last abandoned or timed-out rendezvous end
    after = _afterwards(server, call, before["weights"]["version"] + 100)
    return {"requests": len(outcomes) + len(lies), "routes": len(ROUTES), "concurrency": concurrency,
            "seed": seed} | _summary(outcomes, health, lies, before, after)


def _caller(url: str) -> Callable[..., tuple[int, Any]]:
    """``call(method, path, body=None, session=OWNER)`` on the server, with the campaign's token."""
    def call(method: str, path: str, body: Any = None, session: str = OWNER) -> tuple[int, Any]:
        return http_call(url, method, path, body, TOKEN, session)
    return call


def _afterwards(server: ServerProcess, call: Callable[..., tuple[int, Any]], version: int) -> dict[str, Any]:
    """The server after the campaign: its resources, whether it lives, its weights and greedy tokens,
    and a valid version ``version`` synced to it (the campaign's claim released first)."""
    after: dict[str, Any] = {"resources": resources(server.process.pid), "alive": server.process.is_alive(),
                             "exitcode": server.process.exitcode}
    after["weights"] = call("GET", "/weights/digest")[1] if after["alive"] else None
    after["tokens"] = call("POST", "/generate", GREEDY)[1]["completions"] if after["alive"] else None
    assert call("POST", "/release")[0] == 200
    after["valid"] = _valid_version_after(server.url, version) if after["alive"] else {}
    return after


def _summary(outcomes: list[Outcome], health: list[Outcome], lies: dict[str, dict[str, Any]],
             before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What the campaign saw, in the keys of ``benchmarks/results/fuzz.json``."""
    all_outcomes = outcomes + health
    by_kind: dict[str, Counter[str]] = defaultdict(Counter)
    for o in outcomes:
        by_kind[o.probe.kind][str(o.status)] += 1
    documented = [o for o in all_outcomes if o.status == 503 and _documented_503(o)]
    undocumented = [o for o in all_outcomes if o.status >= 500 and o not in documented]
    unanswered = [o for o in all_outcomes if o.status == 0 and o.probe.answer_expected]
    tokens_during = [o for o in health if o.probe.path == "/generate" and o.status == 200]
    return {
        "kinds": {k: sum(by_kind[k].values()) for k in sorted(by_kind)} | {"data_plane_lies": len(lies)},
        "status": dict(sorted(Counter(str(o.status) for o in all_outcomes).items())),
        "status_by_kind": {k: dict(sorted(v.items())) for k, v in sorted(by_kind.items())},
        "server_errors": {"documented_503": len(documented), "undocumented_5xx": len(undocumented),
                          "examples": [f"{o.status} {o.probe.kind} {o.probe.path}: {o.body[:200]!r}"
                                       for o in undocumented[:5]]},
        "no_answer": len(unanswered),
        "no_answer_examples": [f"{o.probe.kind} {o.probe.method} {o.probe.path[:40]}" for o in unanswered[:5]],
        "crashed": not after["alive"], "exitcode": after["exitcode"],
        "longest_error_answer_bytes": max((len(o.body) for o in all_outcomes if 400 <= o.status < 600), default=0),
        "health": _health([o for o in health if o.probe.path == "/health"]),
        "tokens_unchanged": bool(tokens_during) and all(
            o.body and json.loads(o.body)["completions"] == before["tokens"] for o in tokens_during)
        and after["tokens"] == before["tokens"],
        "weights_unchanged": after["weights"] == before["weights"],
        "resources": {"before": before["resources"], "after": after["resources"]},
        "data_plane_lies": lies,
        "valid_version_after": after["valid"],
    }


def _health(probes: list[Outcome]) -> dict[str, Any]:
    """How ``/health`` answered the prober during the flood."""
    return {"probes": len(probes), "answered": sum(o.status == 200 for o in probes),
            "max_s": round(max((o.seconds for o in probes), default=0.0), 3),
            "p50_s": round(sorted(o.seconds for o in probes)[len(probes) // 2], 4) if probes else None}


def served_routes() -> set[tuple[str, str]]:
    """Every (method, path) a reference server serves, as its aiohttp app routes them (the HEAD that
    aiohttp adds beside each GET aside): what the campaign must cover."""
    server = ReferenceServer(mixed_dtype_model(MODEL), token=TOKEN)
    try:
        return {(r.method, r.resource.canonical) for r in server.app().router.routes()
                if r.method != "HEAD" and r.resource is not None}
    finally:
        server.close()


def _warm_up(url: str, port: int) -> None:
    """Have the server serve each kind of call (and start its worker threads, its event loop's pool
    included, which grows to its size only under concurrent calls) before its baseline is taken."""
    for _ in range(50):
        for path in ("/health", "/weights/digest", "/version"):
            http_call(url, "GET", path, token=TOKEN, session=OWNER)
        http_call(url, "POST", "/generate", GREEDY, TOKEN, OWNER)
    claims = [Probe("warm-up", "POST", "/claim", dumps({"session": OWNER})) for _ in range(50)]
    ends = [Probe("warm-up", "POST", "/end", dumps({"version": 1})) for _ in range(5)]

    async def concurrently() -> None:
        await asyncio.gather(*(exchange(port, p) for p in claims + ends))

    asyncio.run(concurrently())


def _documented_503(o: Outcome) -> bool:
    path = o.probe.path.split("?", 1)[0]
    return path in DATA_PLANE_ROUTES or (path == "/ready" and o.body == b"")


def _judge(r: dict[str, Any]) -> list[str]:
    """Every check of the module docstring that failed."""
    problems = []
    if r["server_errors"]["undocumented_5xx"]:
        problems.append(f"{r['server_errors']['undocumented_5xx']} undocumented 5xx: {r['server_errors']['examples']}")
    if r["no_answer"]:
        problems.append(f"{r['no_answer']} well-formed request(s) got no answer: {r['no_answer_examples']}")
    if r["crashed"]:
        problems.append(f"the server exited (code {r['exitcode']})")
    if not r["tokens_unchanged"]:
        problems.append("the greedy tokens changed (or could not be read) during the campaign")
    if not r["weights_unchanged"]:
        problems.append("the weights' digest changed")
    if r["longest_error_answer_bytes"] > 6 * MAX_ERROR_CHARS + 200:  # JSON escapes a character in at most 6 bytes
        problems.append(f"an error answer of {r['longest_error_answer_bytes']} bytes")
    if r["health"]["answered"] != r["health"]["probes"]:
        problems.append("/health did not answer every probe")
    before, after = r["resources"]["before"], r["resources"]["after"]
    if after["fds"] > before["fds"] + 4 or after["threads"] > before["threads"] + 2:
        problems.append(f"open files or threads grew: {before} -> {after}")
    if after["rss_mb"] > before["rss_mb"] * 1.25 + 32:
        problems.append(f"RSS grew: {before['rss_mb']:.0f} -> {after['rss_mb']:.0f} MB")
    for name, lie in r["data_plane_lies"].items():
        if not (400 <= lie["status"] < 500 or lie["status"] == 503):
            problems.append(f"data-plane lie {name}: answered {lie['status']} ({lie['answer']})")
    valid = r["valid_version_after"]
    if not (valid.get("applied") and valid.get("bit_exact") and valid.get("tokens_match_trainer")):
        problems.append(f"the valid version after the campaign: {valid}")
    return problems


async def _flood(port: int, probes: list[Probe], concurrency: int) -> tuple[list[Outcome], list[Outcome]]:
    """Every probe, ``concurrency`` in flight at a time, while a prober asks for /health every 0.2 s
    and the greedy tokens every second."""
    gate = asyncio.Semaphore(concurrency)
    done = asyncio.Event()
    health: list[Outcome] = []

    async def one(probe: Probe) -> Outcome:
        async with gate:
            return await exchange(port, probe)

    async def prober() -> None:
        tick = 0
        while not done.is_set():
            health.append(await exchange(port, Probe("probe", "GET", "/health")))
            if tick % 5 == 0:
                health.append(await exchange(port, Probe("probe", "POST", "/generate", dumps(GREEDY))))
            tick += 1
            await asyncio.sleep(0.2)

    async def janitor() -> None:
        """While requests are pending, the owner asks for a new group every second, as a trainer does:
        that abandons a join stalled on a silent or absent peer (SGLang's joins carry no deadline of
        their own: the server gives them 120 s), so the last answers come within seconds."""
        while not done.is_set():
            await asyncio.sleep(1.0)
            health.append(await exchange(port, Probe("janitor", "POST", "/init_group", dumps(abandoning))))

    abandoning = InitGroupRequest(GroupSpec("127.0.0.1", free_port(), 2, "janitor", "gloo", 0.2, key=new_key()), 1).to_json()
    watching = [asyncio.create_task(prober()), asyncio.create_task(janitor())]
    outcomes = await asyncio.gather(*(one(p) for p in probes))
    done.set()
    await asyncio.gather(*watching)
    return list(outcomes), health


def _valid_version_after(url: str, version: int) -> dict[str, Any]:
    """A trainer's blocking sync of new weights: applied, bit-exact, and served as the trainer decodes."""
    model = redrawn(version)
    cfg = WeightSyncConfig.from_dict({"servers": [{"url": url, "token": TOKEN}], "bucket_bytes": "16KiB",
                                      "async_weight_update": False, "transport": "collective"})
    with WeightSync(cfg) as sync:
        sync.connect(model)
        result = sync.publish(model, version)
    digest = http_call(url, "GET", "/weights/digest", token=TOKEN)[1]
    names = set(digest["digest"])
    tokens = http_call(url, "POST", "/generate", GREEDY, TOKEN)[1]["completions"]
    return {"applied": result.server_versions == {url: version}, "failures": result.failures,
            "bit_exact": digest["digest"] == {n: d for n, d in digest_of(model.state_dict()).items() if n in names},
            "tokens_match_trainer": tokens == generate(model, PROMPT, GREEDY["max_new_tokens"])}


# -- the server's side ---------------------------------------------------------------------------------

def resources(pid: int) -> dict[str, Any]:
    """Open files, threads (and how many of each name) and resident memory of process ``pid``."""
    status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status").read().splitlines() if ":" in line)
    names: Counter[str] = Counter()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            names[open(f"/proc/{pid}/task/{tid}/comm").read().strip()] += 1
        except OSError:  # ended meanwhile
            continue
    return {"fds": len(os.listdir(f"/proc/{pid}/fd")), "threads": int(status["Threads"]),
            "rss_mb": round(int(status["VmRSS"].split()[0]) / 1024, 1), "thread_names": dict(sorted(names.items()))}


def digest_of(named: dict[str, torch.Tensor]) -> dict[str, str]:
    return {n: hashlib.sha256(tensor_bytes(t)).hexdigest() for n, t in named.items()}


def redrawn(seed: int) -> torch.nn.Module:
    model = mixed_dtype_model(MODEL)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g).to(p.dtype))
    return model


class SilentPeer:
    """A port that accepts connections and never answers on them."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.port = self.listener.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                self.accepted.append(self.listener.accept()[0])
            except (TimeoutError, OSError):
                continue

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for s in [*self.accepted, self.listener]:
            s.close()


# -- the rogue trainer on the data plane --------------------------------------------------------------

Sent = tuple[UpdateRequest, list[tuple[FrameHeader, torch.Tensor]]]


def framed(request: UpdateRequest, payloads: list[torch.Tensor]) -> list[tuple[FrameHeader, torch.Tensor]]:
    """``payloads`` each after its true frame header, as asyncsync's trainer sends them."""
    frames = VersionFrames.of(request)
    return [(frames.header(i, p), p) for i, p in enumerate(payloads)]


def renamed(meta: BucketMeta) -> BucketMeta:
    return BucketMeta(("no.such.tensor", *meta.names[1:]), meta.dtypes, meta.shapes, meta.nbytes)


# Each lie of a rogue trainer: how its valid version is made (``RogueTrainer.version`` options), and
# what it announces and broadcasts instead, given the valid request and buckets.
DATA_PLANE_LIES: dict[str, tuple[dict[str, Any], Callable[[UpdateRequest, list[torch.Tensor]], Sent]]] = {
    "wrong_checksum": ({"checksum": True}, lambda r, flat: (
        r, framed(r, [*flat, torch.tensor([crc32c_of(b) ^ 1 for b in flat])]))),
    "stale_version": ({"version": 0}, lambda r, flat: (r, framed(r, flat))),
    "bucket_longer_than_announced": ({}, lambda r, flat: (
        r, [(FrameHeader(plan_hash(r), r.version, 0, flat[0].numel() + 4096),
             torch.cat([flat[0], torch.zeros(4096, dtype=torch.uint8)]))])),
    "frames_of_another_plan": ({}, lambda r, flat: (
        r, [(FrameHeader(plan_hash(r) ^ 1, r.version, 0, flat[0].numel()), flat[0])])),
    "a_tensor_the_model_lacks": ({}, lambda r, flat: (replace(r, buckets=(renamed(r.buckets[0]), *r.buckets[1:])), [])),
    "a_petabyte": ({}, lambda r, flat: (replace(r, buckets=(BucketMeta((r.buckets[0].names[0],), ("float32",),
                                                                        ((2**48,),), 2**50),), deadlines_s=(0.5,)), [])),
    "silent_trainer": ({}, lambda r, flat: (r, [])),
    "stops_half_way": ({}, lambda r, flat: (r, framed(r, flat[:1]))),
}


def data_plane_lies(url: str, named: dict[str, torch.Tensor], version: int) -> dict[str, dict[str, Any]]:
    """Each of ``DATA_PLANE_LIES`` from a rogue trainer in the server's group (a new group each: the
    server leaves a group whose sender lied), then a trainer of another data-plane protocol: each
    answer's status, delay and the start of its message."""
    out = {}
    for name, (options, lie) in DATA_PLANE_LIES.items():
        rogue = RogueTrainer(url, TOKEN, OWNER, timeout_s=10.0)
        try:
            request, flat = rogue.version(named, options.get("version", version), deadline_s=0.5,
                                          checksum=options.get("checksum", False))
            status, body, _, took = rogue.send(*lie(request, flat))
        finally:
            rogue.close()
        out[name] = {"status": status, "seconds": round(took, 3), "answer": str((body or {}).get("error", ""))[:160]}
    spec = GroupSpec("127.0.0.1", free_port(), 2, "old", "gloo", 30.0, key=new_key())
    old = {k: v for k, v in InitGroupRequest(spec, 1).to_json().items() if k != "protocol"}
    start = time.monotonic()
    status, body = http_call(url, "POST", "/init_group", old, TOKEN, OWNER)
    out["trainer_of_another_protocol"] = {"status": status, "seconds": round(time.monotonic() - start, 3),
                                          "answer": str((body or {}).get("error", ""))[:160]}
    return out
