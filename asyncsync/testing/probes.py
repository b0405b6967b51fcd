"""The route fuzzer's requests (``testing/fuzz.py``): each a ``Probe``, bytes on a fresh connection.

What there is to probe comes from the reference server's route table (``receivers/reference/routes``):
its routes, a valid body of each (``Context.templates``: the example of the message type the route
takes, made for the server under test, or for the few routes that read their own body, one written
here) and, for a declared message, the values each field's declaration refuses
(``mutations.field_mutations``). ``generate_probe`` makes one request of a kind of ``KINDS``: bad
credentials (non-UTF-8 bytes too), JSON that does not parse, nests 10,000 deep or names an unknown
charset, valid bodies with one field replaced by something hostile, absurd numbers, ``/generate``
knobs past the model, lying announcements (shared-memory versions that do not match their segment),
calls from another trainer session, unknown routes and methods, malformed HTTP, rendezvous peers
that accept and never answer, slow and truncated bodies, and LoRA adapter paths outside the server's
adapter root or configs whose ``rank_pattern`` does not compile or backtracks; ``oversized``: bodies
of 50 and 65 MB.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncsync.protocol import sglang
from asyncsync.protocol.digest import DIGEST_CHARS
from asyncsync.protocol.keys import new_key
from asyncsync.protocol.lora import (
    LORA_ROOT, PEFT_PREFIX, AdapterCheck, AdapterUpdate, AdapterVersion, BaseCheck, tensor_crc,
)
from asyncsync.protocol.schema import Message
from asyncsync.protocol.shm import ALIGN, HostIdentity, aligned_offsets
from asyncsync.protocol.specs import BucketPlan
from asyncsync.protocol.wire import (
    SESSION_HEADER, BucketMeta, ClaimRequest, EndRequest, GroupSpec, InitGroupRequest, LayoutCheck, SharedVersion,
    UpdateRequest, VersionRequest,
)
from asyncsync.receivers.reference.routes import served
from asyncsync.testing.mutations import ABSURD, HOSTILE, field_mutations, numeric_places, places, random_json, with_replaced

TOKEN = "fuzz-token"
OWNER = "fuzz-host:1:0wner"       # the session that owns the server through the campaign
INTRUDER = "fuzz-host:2:1ntruder"  # another trainer session: its weight calls must get 423
ANSWER_TIMEOUT_S = 60.0
SERVED = served("asyncsync") + served("sglang")  # what a reference server serves (SGLang 0.5.21+ sessions)
GET_ROUTES = tuple(r.path for r in SERVED if r.method == "GET")
POST_ROUTES = tuple(r.path for r in SERVED if r.method == "POST")
ROUTES = GET_ROUTES + POST_ROUTES  # every route of a reference server (tests/faults/test_route_fuzz.py holds it to served_routes)
TAKES = {r.path: r.takes for r in SERVED}  # the message each route takes (None: it reads its own body)
# A kind's share of the generated requests (oversized bodies are a fixed few: each is 50-64 MB).
KINDS = {"auth": 2, "json_syntax": 3, "mutated_body": 8, "absurd_numbers": 3, "generate_knobs": 2,
         "lying_announcement": 2, "wrong_session": 1, "unknown_route": 1, "malformed_http": 1, "silent_peer": 0.5,
         "slow_body": 0.3, "read_only": 2, "adapter_lies": 1.5}


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


def dumps(value: Any) -> bytes:
    return json.dumps(value).encode("utf-8", "surrogatepass")


# -- what the requests are made of -------------------------------------------------------------------

@dataclass
class Context:
    """What templates need: the model's tensors and vocabulary, ports to name, a shared-memory segment
    to lie about. ``templates``: a valid body of every POST route, by path."""

    named: dict[str, torch.Tensor]
    vocab_size: int
    refused_port: int
    silent_port: int
    host: dict[str, Any]
    segment: str
    segment_bytes: int = field(init=False)
    templates: dict[str, Any] = field(init=False)

    def __post_init__(self) -> None:
        examples = self._examples() | self._adapter_examples()
        self.templates = {path: examples[TAKES[path]].to_json() if TAKES[path] else examples[path]
                          for path in POST_ROUTES}

    def _examples(self) -> dict[Any, Any]:
        """A valid message of each type a route takes, for this server (a version of its own tensors,
        announced in a shared-memory segment whose bytes match no checksum: ``segment_bytes`` long),
        by type; by path, the bodies of the routes that read their own."""
        plan = BucketPlan.from_tensors(self.named.items(), 16 * 1024)
        metas = tuple(BucketMeta.of(b) for b in plan.buckets)
        offsets, self.segment_bytes = aligned_offsets([m.nbytes for m in metas])
        host = HostIdentity.from_json(self.host)
        assert host is not None, "a reference server on this host tells its identity"
        shm = SharedVersion(self.segment, offsets, tuple(range(len(metas))), host)
        return {
            UpdateRequest: UpdateRequest(9, metas, True, (0.5,) * len(metas), shm=shm),
            InitGroupRequest: InitGroupRequest(GroupSpec("127.0.0.1", self.silent_port, 2, "fuzz", "gloo", 0.3,
                                                         key=new_key()), 1),
            VersionRequest: VersionRequest(9), EndRequest: EndRequest(9, ("0" * DIGEST_CHARS,) * len(metas)),
            ClaimRequest: ClaimRequest(OWNER), LayoutCheck: LayoutCheck(plan.specs),
            sglang.InitWeightsUpdateGroup: sglang.InitWeightsUpdateGroup("127.0.0.1", self.refused_port, 1, 2, "fz", "gloo"),
            sglang.DestroyWeightsUpdateGroup: sglang.DestroyWeightsUpdateGroup("fz"),
            sglang.UpdateWeightsFromDistributed: sglang.UpdateWeightsFromDistributed.of(metas[0], "fz", True, "9"),
            sglang.BeginWeightUpdate: sglang.BeginWeightUpdate(), sglang.EndWeightUpdate: sglang.EndWeightUpdate(),
            sglang.PauseGeneration: sglang.PauseGeneration("abort"), sglang.ContinueGeneration: sglang.ContinueGeneration(),
            "/generate": {"prompt": [1, 2, 3], "max_new_tokens": 3, "n": 2, "temperature": 0.8, "seed": 3},
            "/score": {"tokens": [1, 2, 3, 4]}, "/release": {},
        }

    def _adapter_examples(self) -> dict[Any, Any]:
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
            AdapterCheck: AdapterCheck("fz", config, plan.specs, 2),
            BaseCheck: BaseCheck(tuple((n, tensor_crc(t)) for n, t in self.named.items())),
            AdapterUpdate: AdapterUpdate(UpdateRequest(9, metas, True, (0.5,) * len(metas)), adapter),
            sglang.LoadLoraAdapter: sglang.LoadLoraAdapter("fz-v9", path),
            sglang.UnloadLoraAdapter: sglang.UnloadLoraAdapter("fz-v9"),
            "/v1/load_lora_adapter": {"lora_name": "fz-v9", "lora_path": path},
            "/v1/unload_lora_adapter": {"lora_name": "fz-v9"},
        }


def generate_probe(kind: str, rng: random.Random, ctx: Context) -> Probe:
    """One request of ``kind`` (``KINDS``)."""
    return _PROBES[kind](rng, ctx)


def _post(rng: random.Random) -> tuple[str, str]:
    """A POST route and the session that calls it (the owner's own /release would end the campaign's claim)."""
    route = rng.choice(POST_ROUTES)
    return route, INTRUDER if route == "/release" else OWNER


def _auth(rng: random.Random, ctx: Context) -> Probe:
    auth = rng.choice([b"", b"Bearer wrong", b"Bearer \xff\xfe\xfd", f"Bearer {TOKEN}\x80".encode("latin-1"),
                       b"Basic Zm9vOmJhcg==", b"Bearer " + b"x" * 6000, f"bearer {TOKEN}".encode(), b"Bearer"])
    _, session = _post(rng)
    route = rng.choice(ROUTES)
    return Probe("auth", "GET" if route in GET_ROUTES else "POST", route, dumps(ctx.templates.get(route, {})),
                 auth=auth, session=session)


def _json_syntax(rng: random.Random, ctx: Context) -> Probe:
    route, session = _post(rng)
    body = rng.choice([b"{", b'{"version":', b"\xff\xfe{}", b"[" * 10000 + b"]" * 10000, b'{"a":' * 3000 + b"1" +
                       b"}" * 3000, b"NaN", b"null", b"[]", b'"text"', b"1e999", b'{"version": 1e999}', b"",
                       b"\xef\xbb\xbf{}", b'{"prompt": [1, 2,]}', b"\x00" * 100])
    ctype = rng.choice([b"application/json", b"application/json; charset=klingon", b"text/plain",
                        b"application/json; charset=utf-16", b"multipart/form-data; boundary=x"])
    return Probe("json_syntax", "POST", route, body, content_type=ctype, session=session)


def _mutated_body(rng: random.Random, ctx: Context) -> Probe:
    """A valid body with one place replaced by something hostile (or deleted) or, half the time for
    a route that takes a declared message, one field given a value its declaration refuses."""
    route, session = _post(rng)
    template, takes = ctx.templates[route], TAKES[route]
    declared = isinstance(takes, type) and issubclass(takes, Message) and rng.random() < 0.5
    if declared:
        body = with_replaced(template, *rng.choice(field_mutations(takes, template)))
    else:
        new = rng.choice(HOSTILE) if rng.random() < 0.5 else random_json(rng)
        body = with_replaced(template, rng.choice(list(places(template))), new, delete=rng.random() < 0.15)
    return Probe("mutated_body", "POST", route, dumps(body), session=session)


def _absurd_numbers(rng: random.Random, ctx: Context) -> Probe:
    route, session = _post(rng)
    template = ctx.templates[route]
    spots = numeric_places(template) or [("version",)]
    return Probe("absurd_numbers", "POST", route, dumps(with_replaced(template, rng.choice(spots), rng.choice(ABSURD))),
                 session=session)


def _generate_knobs(rng: random.Random, ctx: Context) -> Probe:
    knob = rng.choice([
        {"prompt": [1] * 300_000}, {"prompt": [True, 2]}, {"prompt": [-1]}, {"prompt": [ctx.vocab_size]},
        {"prompt": [1.5]}, {"prompt": [1] * 500, "max_new_tokens": 100}, {"temperature": 1e-300},
        {"temperature": float("nan")}, {"temperature": float("inf")}, {"temperature": -1}, {"temperature": 1e-9},
        {"seed": 2**64}, {"seed": -1}, {"seed": 1.5}, {"n": 10**9}, {"max_new_tokens": 10**6},
        {"max_new_tokens": 600}, {"prompt": "1 2 3"}, {"prompt": []},
    ])
    return Probe("generate_knobs", "POST", "/generate", dumps({**ctx.templates["/generate"], **knob}))


def _lying_announcement(rng: random.Random, ctx: Context) -> Probe:
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
    return Probe("lying_announcement", "POST", "/update", dumps({**update, **lie}))


def _wrong_session(rng: random.Random, ctx: Context) -> Probe:
    route = rng.choice(["/init_group", "/update", "/end", "/begin", "/claim", "/update_weights_from_distributed",
                        "/pause_generation", "/release", "/update_adapter", "/v1/load_lora_adapter",
                        "/unload_lora_adapter"])
    body = {"session": INTRUDER} if route == "/claim" else ctx.templates[route]
    return Probe("wrong_session", "POST", route, dumps(body), session=INTRUDER)


def _unknown_route(rng: random.Random, ctx: Context) -> Probe:
    method, path = rng.choice([("GET", "/admin"), ("GET", "/../../etc/passwd"), ("GET", "/" + "a" * 9000),
                               ("POST", "/health"), ("GET", "/generate"), ("PUT", "/update"), ("DELETE", "/claim"),
                               ("GET", "/weights/%00"), ("GET", "/\u00e9t\u00e9"), ("PATCH", "/end")])
    return Probe("unknown_route", method, path, b"")


def _malformed_http(rng: random.Random, ctx: Context) -> Probe:
    raw = rng.choice([b"GARBAGE\r\n\r\n", b"GET /health HTTP/1.1\r\nNoColonHere\r\n\r\n",
                      b"GET /health HTTP/1.1\r\nX: " + b"y" * 20000 + b"\r\n\r\n",
                      b"POST /generate HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
                      b"POST /generate HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
                      b"POST /generate HTTP/1.1\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n{}",
                      b"GET /health HTTP/9.9\r\n\r\n", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03"])
    return Probe("malformed_http", "GET", "/", raw=raw)


def _silent_peer(rng: random.Random, ctx: Context) -> Probe:
    route = rng.choice(["/init_group", "/init_weights_update_group"])
    body = ctx.templates["/init_group"] if route == "/init_group" else {
        **ctx.templates["/init_weights_update_group"], "master_port": ctx.silent_port}
    return Probe("silent_peer", "POST", route, dumps(body))


def _slow_body(rng: random.Random, ctx: Context) -> Probe:
    truncate = rng.random() < 0.5
    return Probe("slow_body", "POST", "/generate", dumps(ctx.templates["/generate"]), dribble_s=0 if truncate else 1.5,
                 truncate=truncate, answer_expected=not truncate)


def _read_only(rng: random.Random, ctx: Context) -> Probe:
    route = rng.choice(GET_ROUTES)
    query = rng.choice(["", "?x=" + "y" * 100, "?version=NaN", "?%ff"])
    return Probe("read_only", "GET", route + query, dumps(random_json(rng)) if rng.random() < 0.3 else b"")


def _adapter_lie(rng: random.Random, ctx: Context) -> Probe:
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


_PROBES: dict[str, Callable[[random.Random, Context], Probe]] = {
    "auth": _auth, "json_syntax": _json_syntax, "mutated_body": _mutated_body, "absurd_numbers": _absurd_numbers,
    "generate_knobs": _generate_knobs, "lying_announcement": _lying_announcement, "wrong_session": _wrong_session,
    "unknown_route": _unknown_route, "malformed_http": _malformed_http, "silent_peer": _silent_peer,
    "slow_body": _slow_body, "read_only": _read_only, "adapter_lies": _adapter_lie,
}


def oversized(ctx: Context) -> list[Probe]:
    """A 50 MB field (the issue's 50 MB error answer) and a body past the server's 64 MiB limit."""
    return [Probe("oversized", "POST", "/claim", dumps({"session": "s" * 50_000_000})),
            Probe("oversized", "POST", "/update", b"{" + b" " * (65 * 1024 * 1024) + b"}")]
