"""Route fuzzing: thousands of generated bad requests against a live reference server, then checks.

    python -m benchmarks.fuzz [--requests 20000] [--seed 0]     -> results/fuzz.json, fuzz.png

One reference server (a child process with a bearer token) gets ``requests`` generated requests
across every route it serves (``ROUTES``; ``served_routes`` reads them from its app), up to 200 in flight at a time, each of one kind (``KINDS``): bad credentials
(non-UTF-8 bytes too), JSON that does not parse, nests 10,000 deep or names an unknown charset,
valid bodies with one field replaced by something hostile, absurd numbers (NaN, Infinity, 1e300,
2**64), ``/generate`` knobs past the model, lying announcements (shared-memory versions that do not
match their segment), calls from another trainer session, unknown routes and methods, malformed
HTTP, rendezvous peers that accept and never answer, slow, truncated and oversized bodies, LoRA
adapter paths outside the server's adapter root (``..``, links, a model hub id) and adapter configs
whose ``rank_pattern`` is a regular expression that does not compile or backtracks. Then a
rogue trainer on the data plane (``DATA_PLANE_LIES``): a bucket longer than announced, frames of
another plan, a version naming tensors the model lacks or a petabyte, a trainer that goes silent or
stops half-way, a wrong checksum, a stale version. Throughout, a prober checks that ``/health``
answers and that the greedy tokens do not change.

The checks (``problems`` in the JSON, empty when every one holds): no 5xx except the documented
503s (a data-plane call whose group failed or missed a deadline, or that could not start behind a
stalled one; SGLang's ``/ready`` while paused), no request without an answer, the server alive, its
weights and greedy tokens unchanged, every error answer short, its open files, threads and RSS back
near the baseline, and a valid version applied bit-exact afterwards (greedy tokens equal to the
trainer's own decode). ``tests/faults/test_route_fuzz.py`` runs the same campaign in the default
suite with fewer requests (``--fuzz-requests`` for more).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import os
import random
import socket
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from asyncsync import WeightSync, WeightSyncConfig
from asyncsync.models import ModelConfig, generate
from asyncsync.protocol.checksum import crc32c_of
from asyncsync.protocol.frames import FrameHeader, VersionFrames, plan_hash
from asyncsync.protocol.group import free_port
from asyncsync.protocol.lora import (
    LORA_ROOT, PEFT_PREFIX, AdapterCheck, AdapterUpdate, AdapterVersion, BaseCheck, tensor_crc,
)
from asyncsync.protocol.sglang import LoadLoraAdapter, UnloadLoraAdapter, UpdateWeightsFromDistributed
from asyncsync.protocol.shm import ALIGN, SHM_DIR, HostIdentity, aligned_offsets
from asyncsync.protocol.specs import BucketPlan
from asyncsync.protocol.wire import (
    MAX_ERROR_CHARS, SESSION_HEADER, BucketMeta, GroupSpec, InitGroupRequest, LayoutCheck, SharedVersion, UpdateRequest,
)
from asyncsync.receivers.reference.app import ReferenceServer
from asyncsync.receivers.reference.receiver import tensor_bytes
from asyncsync.testing import RogueTrainer, ServerProcess, http_call, mixed_dtype_model

MODEL = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)
TOKEN = "fuzz-token"
OWNER = "fuzz-host:1:0wner"       # the session that owns the server through the campaign
INTRUDER = "fuzz-host:2:1ntruder"  # another trainer session: its weight calls must get 423
PROMPT = [5, 6, 7, 8]
GREEDY = {"prompt": PROMPT, "max_new_tokens": 6}
CONCURRENCY = 200
ANSWER_TIMEOUT_S = 60.0
# Routes whose work runs on the server's data-plane thread: their 503 is documented (a group that
# failed or missed a deadline, or a call that could not start behind a stalled one).
DATA_PLANE_ROUTES = frozenset({"/init_group", "/update", "/end", "/init_weights_update_group",
                               "/destroy_weights_update_group", "/update_weights_from_distributed",
                               "/begin_weight_update", "/end_weight_update", "/update_adapter", "/end_adapter"})
GET_ROUTES = ("/health", "/version", "/world_size", "/host", "/weights/digest", "/weights/names", "/model_info",
              "/get_model_info", "/server_info", "/get_server_info", "/ready", "/v1/models")
POST_ROUTES = ("/generate", "/score", "/claim", "/release", "/check_layout", "/init_group", "/begin", "/update", "/end",
               "/init_weights_update_group", "/destroy_weights_update_group", "/update_weights_from_distributed",
               "/begin_weight_update", "/end_weight_update", "/pause_generation", "/continue_generation",
               "/check_adapter", "/check_base", "/update_adapter", "/end_adapter", "/v1/load_lora_adapter",
               "/v1/unload_lora_adapter", "/load_lora_adapter", "/unload_lora_adapter")
ROUTES = GET_ROUTES + POST_ROUTES  # every route of a reference server (tests/faults/test_route_fuzz.py holds it to served_routes)
# A kind's share of the generated requests (oversized bodies are a fixed few: each is 50-64 MB).
KINDS = {"auth": 2, "json_syntax": 3, "mutated_body": 8, "absurd_numbers": 3, "generate_knobs": 2,
         "lying_announcement": 2, "wrong_session": 1, "unknown_route": 1, "malformed_http": 1, "silent_peer": 0.5,
         "slow_body": 0.3, "read_only": 2, "adapter_lies": 1.5}
HOSTILE: list[Any] = [
    float("nan"), float("inf"), -float("inf"), 1e300, -1e300, 1e-300, 2**63, 2**64, -(2**63) - 1, 10**40, -1, 0, 1,
    0.5, "", " ", "\ud800", "a\x00b", "x" * 5000, "float33", [], {}, [[[[[[[[]]]]]]]], [-1], [2**62, 2**62], True,
    False, None, {"a": "x" * 5000}, ["x" * 5000], "1", "1e9", "../../../../etc", "/", "org/model", "a\n",
]
ABSURD = [float("nan"), float("inf"), -float("inf"), 1e300, -1e300, 1e-300, 2**64, 2**63, -(2**63) - 1, 10**40, -1]


@dataclass(frozen=True)
class Probe:
    """One generated request, as bytes on a fresh connection."""

    kind: str
    method: str
    path: str
    body: bytes = b""
    content_type: bytes = b"application/json"
    auth: bytes | None = None          # the Authorization header's value; None: the right token
    session: str | None = OWNER
    raw: bytes | None = None           # malformed HTTP: these bytes instead
    dribble_s: float = 0.0             # the body sent over this long
    truncate: bool = False             # announce more body than is sent, then stop writing
    answer_expected: bool = True

    def wire(self) -> bytes:
        if self.raw is not None:
            return self.raw
        lines = [f"{self.method} ".encode() + self.path.encode("utf-8", "surrogateescape") + b" HTTP/1.1",
                 b"Host: fuzz", b"Connection: close",
                 b"Authorization: " + (self.auth if self.auth is not None else f"Bearer {TOKEN}".encode())]
        if self.session:
            lines.append(f"{SESSION_HEADER}: {self.session}".encode())
        if self.method == "POST" or self.body:
            extra = 1000 if self.truncate else 0
            lines += [b"Content-Type: " + self.content_type, b"Content-Length: %d" % (len(self.body) + extra)]
        return b"\r\n".join(lines) + b"\r\n\r\n"


@dataclass
class Outcome:
    probe: Probe
    status: int          # 0: no answer
    body: bytes
    seconds: float


async def exchange(port: int, probe: Probe) -> Outcome:
    """Send ``probe`` on its own connection and read the answer until the server closes."""
    start = time.monotonic()
    status, body = 0, b""
    writer = None
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        head = probe.wire()
        try:
            if probe.dribble_s and probe.body:
                writer.write(head)
                step = max(1, len(probe.body) // 10)
                for i in range(0, len(probe.body), step):
                    writer.write(probe.body[i:i + step])
                    await writer.drain()
                    await asyncio.sleep(probe.dribble_s / 10)
            else:
                writer.write(head + (probe.body if probe.raw is None else b""))
                await writer.drain()
            if probe.truncate:
                writer.write_eof()
        except (ConnectionError, OSError):  # the server answered (413) and closed while we wrote
            pass
        data = await asyncio.wait_for(reader.read(), ANSWER_TIMEOUT_S)
        if data.startswith(b"HTTP/1."):
            status = int(data[9:12])
            body = data.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in data else b""
    except (ConnectionError, OSError, asyncio.TimeoutError):
        pass
    finally:
        if writer is not None:
            writer.close()
    return Outcome(probe, status, body, time.monotonic() - start)


# -- what the requests are made of -------------------------------------------------------------------

@dataclass
class Context:
    """What templates need: the model's tensors, ports to name, a shared-memory segment to lie about."""

    named: dict[str, torch.Tensor]
    refused_port: int
    silent_port: int
    host: dict[str, Any]
    segment: str
    update: UpdateRequest = field(init=False)
    segment_bytes: int = field(init=False)
    templates: dict[str, Any] = field(init=False)

    def __post_init__(self) -> None:
        plan = BucketPlan.from_tensors(self.named.items(), 16 * 1024)
        metas = tuple(BucketMeta.of(b) for b in plan.buckets)
        self.update = UpdateRequest(9, metas, True, (0.5,) * len(metas))
        offsets, self.segment_bytes = aligned_offsets([m.nbytes for m in metas])
        host = HostIdentity.from_json(self.host)
        assert host is not None, "a reference server on this host tells its identity"
        shm = SharedVersion(self.segment, offsets, tuple(range(len(metas))), host)
        port = self.silent_port
        self.templates = {
            "/generate": {"prompt": [1, 2, 3], "max_new_tokens": 3, "n": 2, "temperature": 0.8, "seed": 3},
            "/score": {"tokens": [1, 2, 3, 4]},
            "/claim": {"session": OWNER, "takeover": False},
            "/release": {},
            "/init_group": InitGroupRequest(GroupSpec("127.0.0.1", port, 2, "fuzz", "gloo", 0.3), 1).to_json(),
            "/begin": {"version": 9}, "/end": {"version": 9},
            "/check_layout": LayoutCheck(plan.specs).to_json(),
            "/update": replace(self.update, shm=shm).to_json(),
            "/init_weights_update_group": {"master_address": "127.0.0.1", "master_port": self.refused_port,
                                           "rank_offset": 1, "world_size": 2, "group_name": "fz", "backend": "gloo"},
            "/destroy_weights_update_group": {"group_name": "fz"},
            "/update_weights_from_distributed": UpdateWeightsFromDistributed.of(metas[0], "fz", True, "9").to_json(),
            "/begin_weight_update": {}, "/end_weight_update": {}, "/pause_generation": {"mode": "abort"},
            "/continue_generation": {},
        }
        self.templates |= self._adapter_templates()

    def _adapter_templates(self) -> dict[str, Any]:
        """The LoRA routes' bodies: a rank-2 adapter of one linear weight of the served model, sent as
        version 9 into slot ``fuzz-slot`` (no group: the receive is refused) and loaded from its path."""
        weight = next(n for n, t in self.named.items() if t.dim() == 2 and n.endswith("proj.weight"))
        module = weight.removesuffix(".weight")
        out, inp = self.named[weight].shape
        config = {"r": 2, "lora_alpha": 4, "peft_type": "LORA", "target_modules": [module.rsplit(".", 1)[-1]],
                  "rank_pattern": {module.rsplit(".", 1)[-1]: 2}, "alpha_pattern": {}}
        lora = {f"{PEFT_PREFIX}{module}.lora_A.weight": torch.zeros(2, inp),
                f"{PEFT_PREFIX}{module}.lora_B.weight": torch.zeros(out, 2)}
        plan = BucketPlan.from_tensors(lora.items(), 16 * 1024)
        metas = tuple(BucketMeta.of(b) for b in plan.buckets)
        adapter = AdapterVersion("fz", "fuzz-slot", config, (8,))
        path = adapter.path(9)
        return {
            "/check_adapter": AdapterCheck("fz", config, plan.specs, 2).to_json(),
            "/check_base": BaseCheck(tuple((n, tensor_crc(t)) for n, t in self.named.items())).to_json(),
            "/update_adapter": AdapterUpdate(UpdateRequest(9, metas, True, (0.5,) * len(metas)), adapter).to_json(),
            "/end_adapter": {"version": 9},
            "/v1/load_lora_adapter": {"lora_name": "fz-v9", "lora_path": path},
            "/v1/unload_lora_adapter": {"lora_name": "fz-v9"},
            "/load_lora_adapter": LoadLoraAdapter("fz-v9", path).to_json(),
            "/unload_lora_adapter": UnloadLoraAdapter("fz-v9").to_json(),
        }


def dumps(value: Any) -> bytes:
    return json.dumps(value).encode("utf-8", "surrogatepass")


def random_json(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.random()
    if depth > 2 or roll < 0.5:
        return rng.choice([rng.randint(-10**6, 10**6), rng.random() * 10**rng.randint(-5, 5), rng.choice(HOSTILE),
                           "".join(rng.choice("ab.\\\"/ \u00e9\u4e2d\ud83d") for _ in range(rng.randint(0, 8))), None, True])
    if roll < 0.75:
        return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(["version", "names", "a", "", "shm", "group"]): random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def places(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield path
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        yield from places(v, (*path, k))


def with_replaced(doc: Any, path: tuple[Any, ...], new: Any, delete: bool = False) -> Any:
    if not path:
        return new
    copy = json.loads(json.dumps(doc))
    node = copy
    for key in path[:-1]:
        node = node[key]
    if delete and isinstance(node, dict):
        del node[path[-1]]
    else:
        node[path[-1]] = new
    return copy


def numeric_places(value: Any) -> list[tuple[Any, ...]]:
    def numeric(path: tuple[Any, ...]) -> bool:
        node = value
        for k in path:
            node = node[k]
        return isinstance(node, (int, float)) and not isinstance(node, bool)
    return [p for p in places(value) if p and numeric(p)]


def generate_probe(kind: str, rng: random.Random, ctx: Context) -> Probe:
    """One request of ``kind`` (``KINDS``)."""
    post = rng.choice(POST_ROUTES)
    template = ctx.templates[post]
    session = INTRUDER if post == "/release" else OWNER  # the owner's own /release would end the campaign's claim
    if kind == "auth":
        auth = rng.choice([b"", b"Bearer wrong", b"Bearer \xff\xfe\xfd", f"Bearer {TOKEN}\x80".encode("latin-1"),
                           b"Basic Zm9vOmJhcg==", b"Bearer " + b"x" * 6000, f"bearer {TOKEN}".encode(), b"Bearer"])
        route = rng.choice(ROUTES)
        return Probe(kind, "GET" if route in GET_ROUTES else "POST", route, dumps(ctx.templates.get(route, {})),
                     auth=auth, session=session)
    if kind == "json_syntax":
        body = rng.choice([b"{", b'{"version":', b"\xff\xfe{}", b"[" * 10000 + b"]" * 10000, b'{"a":' * 3000 + b"1" +
                           b"}" * 3000, b"NaN", b"null", b"[]", b'"text"', b"1e999", b'{"version": 1e999}', b"",
                           b"\xef\xbb\xbf{}", b'{"prompt": [1, 2,]}', b"\x00" * 100])
        ctype = rng.choice([b"application/json", b"application/json; charset=klingon", b"text/plain",
                            b"application/json; charset=utf-16", b"multipart/form-data; boundary=x"])
        return Probe(kind, "POST", post, body, content_type=ctype, session=session)
    if kind == "mutated_body":
        path = rng.choice(list(places(template)))
        new = rng.choice(HOSTILE) if rng.random() < 0.5 else random_json(rng)
        return Probe(kind, "POST", post, dumps(with_replaced(template, path, new, delete=rng.random() < 0.15)),
                     session=session)
    if kind == "absurd_numbers":
        spots = numeric_places(template) or [("version",)]
        return Probe(kind, "POST", post, dumps(with_replaced(template, rng.choice(spots), rng.choice(ABSURD))),
                     session=session)
    if kind == "generate_knobs":
        base = ctx.templates["/generate"]
        knob = rng.choice([
            {"prompt": [1] * 300_000}, {"prompt": [True, 2]}, {"prompt": [-1]}, {"prompt": [MODEL.vocab_size]},
            {"prompt": [1.5]}, {"prompt": [1] * 500, "max_new_tokens": 100}, {"temperature": 1e-300},
            {"temperature": float("nan")}, {"temperature": float("inf")}, {"temperature": -1}, {"temperature": 1e-9},
            {"seed": 2**64}, {"seed": -1}, {"seed": 1.5}, {"n": 10**9}, {"max_new_tokens": 10**6},
            {"max_new_tokens": 600}, {"prompt": "1 2 3"}, {"prompt": []},
        ])
        return Probe(kind, "POST", "/generate", dumps({**base, **knob}))
    if kind == "lying_announcement":
        update = ctx.templates["/update"]
        shm = update["shm"]
        n = len(shm["offsets"])
        lie = rng.choice([
            {"shm": {**shm, "offsets": [o + 4 for o in shm["offsets"]]}},                    # off the alignment
            {"shm": {**shm, "offsets": [2**62 - ALIGN * (n - i) for i in range(n)]}},        # past the segment
            {"shm": {**shm, "segment": f"asyncsync-{os.getpid()}-dead-7"}},                   # no such segment
            {"shm": {**shm, "host": {"boot_id": "another-host", "shm_dev": 1}}},              # another host
            {"shm": {**shm, "crcs": []}},                                                     # checksum without crcs
            {},                                                                               # crcs of other bytes
            {"buckets": [{"names": [next(iter(ctx.named))], "dtypes": ["float32"], "shapes": [[2**48]],
                          "nbytes": 2**50}], "deadlines_s": [0.5], "shm": {**shm, "offsets": [0], "crcs": [0]}},
            {"buckets": [{**update["buckets"][0], "names": ["no.such.tensor", *update["buckets"][0]["names"][1:]]},
                         *update["buckets"][1:]]},                                            # a name the model lacks
        ])
        return Probe(kind, "POST", "/update", dumps({**update, **lie}))
    if kind == "wrong_session":
        route = rng.choice(["/init_group", "/update", "/end", "/begin", "/claim", "/update_weights_from_distributed",
                            "/pause_generation", "/release", "/update_adapter", "/v1/load_lora_adapter",
                            "/unload_lora_adapter"])
        body = {"session": INTRUDER} if route == "/claim" else ctx.templates[route]
        return Probe(kind, "POST", route, dumps(body), session=INTRUDER)
    if kind == "unknown_route":
        method, path = rng.choice([("GET", "/admin"), ("GET", "/../../etc/passwd"), ("GET", "/" + "a" * 9000),
                                   ("POST", "/health"), ("GET", "/generate"), ("PUT", "/update"), ("DELETE", "/claim"),
                                   ("GET", "/weights/%00"), ("GET", "/\u00e9t\u00e9"), ("PATCH", "/end")])
        return Probe(kind, method, path, b"")
    if kind == "malformed_http":
        raw = rng.choice([b"GARBAGE\r\n\r\n", b"GET /health HTTP/1.1\r\nNoColonHere\r\n\r\n",
                          b"GET /health HTTP/1.1\r\nX: " + b"y" * 20000 + b"\r\n\r\n",
                          b"POST /generate HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
                          b"POST /generate HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
                          b"POST /generate HTTP/1.1\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n{}",
                          b"GET /health HTTP/9.9\r\n\r\n", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03"])
        return Probe(kind, "GET", "/", raw=raw)
    if kind == "silent_peer":
        route = rng.choice(["/init_group", "/init_weights_update_group"])
        body = ctx.templates["/init_group"] if route == "/init_group" else {
            **ctx.templates["/init_weights_update_group"], "master_port": ctx.silent_port}
        return Probe(kind, "POST", route, dumps(body))
    if kind == "slow_body":
        truncate = rng.random() < 0.5
        return Probe(kind, "POST", "/generate", dumps(ctx.templates["/generate"]), dribble_s=0 if truncate else 1.5,
                     truncate=truncate, answer_expected=not truncate)
    if kind == "read_only":
        route = rng.choice(GET_ROUTES)
        query = rng.choice(["", "?x=" + "y" * 100, "?version=NaN", "?%ff"])
        return Probe(kind, "GET", route + query, dumps(random_json(rng)) if rng.random() < 0.3 else b"")
    if kind == "adapter_lies":
        return adapter_lie(rng, ctx)
    raise ValueError(f"unknown kind {kind!r}")


def adapter_lie(rng: random.Random, ctx: Context) -> Probe:
    """A LoRA route given a path out of the adapter root or an adapter config no engine should act on."""
    if rng.random() < 0.5:
        good = ctx.templates["/v1/load_lora_adapter"]["lora_path"]
        path = rng.choice([
            "/etc", "/", ".", LORA_ROOT, os.path.dirname(good), good + "/../../../..", good + "/../fz-v8",
            os.path.join(LORA_ROOT, "..", "..", "etc"), "gpt2", "some-org/some-model", "hf://org/model",
            "\\\\host\\share", good + "\x00", good + "\n", "x" * 5000, os.path.join(LORA_ROOT, "fuzz-slot", "fz-v9"),
        ])
        route = rng.choice(["/v1/load_lora_adapter", "/load_lora_adapter"])
        return Probe("adapter_lies", "POST", route, dumps({**ctx.templates[route], "lora_path": path}))
    route = rng.choice(["/check_adapter", "/update_adapter"])
    template = json.loads(json.dumps(ctx.templates[route]))
    config = template["adapter_check" if route == "/check_adapter" else "adapter"]["config"]
    config |= rng.choice([
        {"rank_pattern": {"(": 2}}, {"rank_pattern": {"(a|a)*(a|a)*(a|a)*(a|a)*$x": 2}}, {"rank_pattern": {".*.*.*.*.*=": 2}},
        {"rank_pattern": {"q_proj": "8"}}, {"rank_pattern": {"q_proj": 2**70}}, {"rank_pattern": [1, 2]},
        {"rank_pattern": {"q_proj\n": 2}}, {"alpha_pattern": {"q_proj": float("nan")}}, {"r": 2**70}, {"r": 0},
        {"peft_type": "IA3"}, {"nested": json.loads("[" * 900 + "]" * 900)}, {"pad": "x" * 70_000},
    ])
    return Probe("adapter_lies", "POST", route, dumps(template))


def oversized(ctx: Context) -> list[Probe]:
    """A 50 MB field (the issue's 50 MB error answer) and a body past the server's 64 MiB limit."""
    return [Probe("oversized", "POST", "/claim", dumps({"session": "s" * 50_000_000})),
            Probe("oversized", "POST", "/update", b"{" + b" " * (65 * 1024 * 1024) + b"}")]


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
    old = {k: v for k, v in InitGroupRequest(GroupSpec("127.0.0.1", free_port(), 2, "old", "gloo", 30.0), 1)
           .to_json().items() if k != "protocol"}
    start = time.monotonic()
    status, body = http_call(url, "POST", "/init_group", old, TOKEN, OWNER)
    out["trainer_of_another_protocol"] = {"status": status, "seconds": round(time.monotonic() - start, 3),
                                          "answer": str((body or {}).get("error", ""))[:160]}
    return out


# -- the campaign --------------------------------------------------------------------------------------

def campaign(requests: int = 3000, seed: int = 0, concurrency: int = CONCURRENCY) -> dict[str, Any]:
    """Run everything described in the module docstring; the results, with ``problems`` listing every
    check that failed (empty: all held)."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    server = ServerProcess(mixed_dtype_model, (MODEL,), token=TOKEN)
    silent = SilentPeer()
    segment = os.path.join(SHM_DIR, f"asyncsync-{os.getpid()}-f0221-{seed}")
    started = time.monotonic()
    problems: list[str] = []
    try:
        server.start()
        url, port, pid = server.url, server.port, server.process.pid
        call = lambda method, path, body=None, session=OWNER: http_call(url, method, path, body, TOKEN, session)  # noqa: E731
        assert call("POST", "/claim", {"session": OWNER})[0] == 200
        names = set(call("GET", "/weights/names")[1]["names"])
        served_model = mixed_dtype_model(MODEL)  # the server's own start-up weights (same seed)
        named = {n: t for n, t in served_model.state_dict().items() if n in names}
        ctx = Context(named, free_port(), silent.port, call("GET", "/host")[1]["host"], os.path.basename(segment))
        with open(segment, "wb") as f:  # a real segment whose bytes match no checksum of the announcement
            f.write(os.urandom(ctx.segment_bytes))
        _warm_up(url, port)
        baseline = resources(pid)
        weights_before = call("GET", "/weights/digest")[1]
        tokens_before = call("POST", "/generate", GREEDY)[1]["completions"]

        kinds = list(KINDS)
        probes = [generate_probe(rng.choices(kinds, [KINDS[k] for k in kinds])[0], rng, ctx)
                  for _ in range(requests)] + oversized(ctx)
        rng.shuffle(probes)
        outcomes, health = asyncio.run(_flood(port, probes, concurrency))
        tokens_during = [o for o in health if o.probe.path == "/generate" and o.status == 200]
        lies = data_plane_lies(url, named, weights_before["version"] + 1)

        time.sleep(2.0)  # let the last abandoned or timed-out rendezvous end
        after = resources(pid)
        alive = server.process.is_alive()
        weights_after = call("GET", "/weights/digest")[1] if alive else None
        tokens_after = call("POST", "/generate", GREEDY)[1]["completions"] if alive else None
        assert call("POST", "/release")[0] == 200
        valid = _valid_version_after(url, weights_before["version"] + 100) if alive else {}

        all_outcomes = outcomes + health
        status = Counter(str(o.status) for o in all_outcomes)
        by_kind: dict[str, Counter[str]] = defaultdict(Counter)
        for o in outcomes:
            by_kind[o.probe.kind][str(o.status)] += 1
        documented = [o for o in all_outcomes if o.status == 503 and _documented_503(o)]
        undocumented = [o for o in all_outcomes if o.status >= 500 and o not in documented]
        unanswered = [o for o in all_outcomes if o.status == 0 and o.probe.answer_expected]
        longest = max((len(o.body) for o in all_outcomes if 400 <= o.status < 600), default=0)
        probes_health = [o for o in health if o.probe.path == "/health"]
        results = {
            "requests": len(outcomes) + len(lies), "routes": len(ROUTES), "concurrency": concurrency, "seed": seed,
            "kinds": {k: sum(by_kind[k].values()) for k in sorted(by_kind)} | {"data_plane_lies": len(lies)},
            "status": dict(sorted(status.items())),
            "status_by_kind": {k: dict(sorted(v.items())) for k, v in sorted(by_kind.items())},
            "server_errors": {"documented_503": len(documented), "undocumented_5xx": len(undocumented),
                              "examples": [f"{o.status} {o.probe.kind} {o.probe.path}: {o.body[:200]!r}"
                                           for o in undocumented[:5]]},
            "no_answer": len(unanswered),
            "no_answer_examples": [f"{o.probe.kind} {o.probe.method} {o.probe.path[:40]}" for o in unanswered[:5]],
            "crashed": not alive, "exitcode": server.process.exitcode,
            "longest_error_answer_bytes": longest,
            "health": {"probes": len(probes_health), "answered": sum(o.status == 200 for o in probes_health),
                       "max_s": round(max((o.seconds for o in probes_health), default=0.0), 3),
                       "p50_s": round(sorted(o.seconds for o in probes_health)[len(probes_health) // 2], 4)
                       if probes_health else None},
            "tokens_unchanged": bool(tokens_during) and all(o.body and json.loads(o.body)["completions"] == tokens_before
                                                            for o in tokens_during) and tokens_after == tokens_before,
            "weights_unchanged": weights_after == weights_before,
            "resources": {"before": baseline, "after": after},
            "data_plane_lies": lies,
            "valid_version_after": valid,
            "wall_s": round(time.monotonic() - started, 1),
        }
    finally:
        server.stop()
        silent.close()
        if os.path.exists(segment):
            os.unlink(segment)
    problems += _judge(results)
    results["problems"] = problems
    return results


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

    abandoning = InitGroupRequest(GroupSpec("127.0.0.1", free_port(), 2, "janitor", "gloo", 0.2), 1).to_json()
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


def plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    classes = {"2xx": lambda s: 200 <= s < 300, "4xx": lambda s: 400 <= s < 500, "503 (documented)": lambda s: s == 503,
               "other 5xx": lambda s: s >= 500 and s != 503, "no answer (a body the client cut short)": lambda s: s == 0}
    kinds = list(results["status_by_kind"])
    fig, ax = plt.subplots(figsize=(9, 0.4 * len(kinds) + 1.5))
    left = [0] * len(kinds)
    for name, test in classes.items():
        counts = [sum(n for s, n in results["status_by_kind"][k].items() if test(int(s))) for k in kinds]
        ax.barh(kinds, counts, left=left, label=name)
        left = [a + b for a, b in zip(left, counts)]
    ax.set_xlabel("requests")
    ax.set_title(f"{results['requests']} bad requests to a reference server: answers by kind")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    from benchmarks.common import save

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=CONCURRENCY)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)
    results = campaign(args.requests, args.seed, args.concurrency)
    save("fuzz", results, plot)
    print(json.dumps({k: results[k] for k in ("requests", "status", "server_errors", "no_answer", "crashed",
                                              "resources", "valid_version_after", "wall_s", "problems")}, indent=2))


if __name__ == "__main__":
    main()
