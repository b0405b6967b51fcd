"""Every parser of the weight-update protocol, driven by hypothesis: for any JSON value (random, or a
valid message with one field replaced by something hostile) a parser returns its message or raises
its one documented error, whose message quotes little of the input; what it accepts is safe to act
on (deadlines a ``timedelta`` takes, sizes an int64 holds, offsets aligned, names encodable); every
limit a message declares refuses the value just past it, naming the field; and every valid message
survives a round trip through JSON."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncsync.protocol import sglang
from asyncsync.protocol.frames import HEADER_WORDS, MAGIC, FrameHeader, VersionFrames, plan_hash
from asyncsync.protocol.lora import AdapterCheck, AdapterUpdate, AdapterVersion, BaseCheck
from asyncsync.protocol.schema import Message, Tags, at
from asyncsync.protocol.shm import ALIGN, HostIdentity
from asyncsync.protocol.specs import TensorSpec
from asyncsync.protocol.tags import UPDATE_INFO
from asyncsync.protocol.wire import (
    MAX_BYTES, MAX_DEADLINE_S, PROTOCOL_VERSION, BucketMeta, ClaimRequest, CommitRequest, DeltaVersion, DiscardRequest,
    EndRequest, GroupSpec, InitGroupRequest, LayoutCheck, SharedVersion, UpdateRequest, VersionRequest, WireError,
)
from asyncsync.testing.mutations import HOSTILE as HOSTILE_VALUES
from asyncsync.testing.mutations import field_mutations, places, with_replaced

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LONG = "x" * 5000  # a field this long (one of HOSTILE_VALUES) must never come back in an error message

HOSTILE = st.sampled_from(HOSTILE_VALUES)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20) | HOSTILE,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=16,
)


_DELETE = object()


def mutants(valid: dict[str, Any]) -> st.SearchStrategy[Any]:
    """``valid`` with one place replaced by a hostile or random JSON value, deleted, or kept."""
    return st.tuples(st.sampled_from(list(places(valid))), st.one_of(HOSTILE, JSON, st.just(_DELETE))).map(
        lambda pn: with_replaced(valid, pn[0], None, delete=True) if pn[1] is _DELETE else with_replaced(valid, *pn))


GROUP = GroupSpec("127.0.0.1", 29500, 3, "asyncsync.1.ab12", "gloo", 120.0, key="ab" * 32)
BUCKET = BucketMeta(("a.weight", "b.bias"), ("float32", "bfloat16"), ((4, 2), (3,)), 38)
HOST = HostIdentity("0b8c4f52-7a1c-4e55-9d1e-2f3b4a5c6d7e", 27)
UPDATE = UpdateRequest(7, (BUCKET, BucketMeta(("c",), ("int8",), ((5,),), 5)), True, (2.0, 3.5), (0, 1),
                       "background", SharedVersion("asyncsync-123-ab12-0", (0, 64), (1, 2), HOST))
INIT = InitGroupRequest(GROUP, 1, (GroupSpec("127.0.0.1", 29500, 3, "asyncsync.1.cd34", "gloo", 120.0, key="cd" * 32),))
VALID: dict[str, tuple[Callable[[Any], Any], dict[str, Any]]] = {
    "update": (UpdateRequest.from_json, UPDATE.to_json()),
    "bucket": (BucketMeta.from_json, BUCKET.to_json()),
    "shm": (SharedVersion.from_json, UPDATE.shm.to_json()),  # type: ignore[union-attr]
    "init_group": (InitGroupRequest.from_json, INIT.to_json()),
    "begin": (lambda d: VersionRequest.from_json(d, "begin"), VersionRequest(3).to_json()),
    "discard": (DiscardRequest.from_json, DiscardRequest(3).to_json()),
    "claim": (ClaimRequest.from_json, ClaimRequest("host:12:ab12", True).to_json()),
    "check_layout": (LayoutCheck.from_json, LayoutCheck(BUCKET.to_bucket(0).specs).to_json()),
}
SGLANG = {
    cls: valid for cls, valid in [
        (sglang.InitWeightsUpdateGroup, sglang.InitWeightsUpdateGroup("127.0.0.1", 29500, 1, 2, "g", "gloo").to_json()),
        (sglang.DestroyWeightsUpdateGroup, {"group_name": "g"}),
        (sglang.BeginWeightUpdate, {"selector": "all"}),
        (sglang.EndWeightUpdate, {}),
        (sglang.PauseGeneration, {"mode": "retract"}),
        (sglang.ContinueGeneration, {"torch_empty_cache": True}),
        (sglang.UpdateWeightsFromDistributed, sglang.UpdateWeightsFromDistributed.of(BUCKET, "g", True, "7").to_json()),
    ]
}


def safe_to_act_on(message: Any) -> None:
    """What a receiver does with an accepted message must not fail: every derived quantity fits."""
    if isinstance(message, GroupSpec):
        timedelta(seconds=message.timeout_s)
        message.group_name.encode()
        message.host.encode()
        assert 0 < message.timeout_s <= MAX_DEADLINE_S and 1 < message.world_size and 0 < message.port < 65536
    elif isinstance(message, BucketMeta):
        bucket = message.to_bucket(0)
        assert bucket.nbytes == message.nbytes <= MAX_BYTES
        assert all(len(n.encode()) > 0 for n in message.names)
    elif isinstance(message, UpdateRequest):
        for b in message.buckets:
            safe_to_act_on(b)
        assert message.nbytes <= MAX_BYTES
        assert all(math.isfinite(d) and 0 < d <= MAX_DEADLINE_S for d in message.deadlines_s)
        if message.deadlines_s:
            timedelta(seconds=message.deadline_s(len(message.buckets)))
        FrameHeader(plan_hash(message), message.version, len(message.buckets), message.nbytes).tensor()
        if message.shm is not None:
            safe_to_act_on(message.shm)
    elif isinstance(message, SharedVersion):
        assert all(o % ALIGN == 0 and 0 <= o <= MAX_BYTES for o in message.offsets)
    elif isinstance(message, InitGroupRequest):
        assert message.protocol == PROTOCOL_VERSION
        for g in message.groups:
            safe_to_act_on(g)
            assert 1 <= message.rank_offset < g.world_size


def check_parser(parse: Callable[[Any], Any], data: Any, kind: type | tuple[type, ...]) -> None:
    try:
        message = parse(data)
    except WireError as e:  # the one documented error: a short message, never the input itself
        assert type(e) in (WireError, sglang.RequestInvalid), f"{type(e).__name__}: {e}"
        assert len(str(e)) < 2500 and "x" * 100 not in str(e), f"the error echoes its input: {str(e)[:200]}"
        return
    assert isinstance(message, kind)
    safe_to_act_on(message)


@pytest.mark.parametrize("name", sorted(VALID))
@FUZZ
@given(data=st.data())
def test_asyncsync_parsers_return_the_message_or_a_wire_error(name, data):
    parse, valid = VALID[name]
    value = data.draw(st.one_of(JSON, mutants(valid)))
    check_parser(parse, value, object)


@pytest.mark.parametrize("cls", sorted(SGLANG, key=lambda c: c.__name__), ids=lambda c: c.__name__)
@FUZZ
@given(data=st.data())
def test_sglang_parsers_return_the_message_or_request_invalid(cls, data):
    value = data.draw(st.one_of(JSON, mutants(SGLANG[cls])))
    check_parser(cls.from_json, value, cls)


@FUZZ
@given(data=st.data())
def test_what_the_sglang_api_derives_from_a_parsed_request_is_checked(data):
    """The reference server's SGLang routes act on an accepted body through ``spec`` (a group) and
    ``flattened_nbytes`` then ``bucket`` (a bucket): each gives a valid value or raises, and what it
    raises is caught by the route (``WireError``; SGLang's own checks raise plain exceptions)."""
    for cls in (sglang.InitWeightsUpdateGroup, sglang.UpdateWeightsFromDistributed):
        try:
            req = cls.from_json(data.draw(mutants(SGLANG[cls])))
        except sglang.RequestInvalid:
            continue
        if isinstance(req, sglang.InitWeightsUpdateGroup):
            try:
                safe_to_act_on(req.spec(120.0))
            except WireError:
                pass
        else:
            try:
                nbytes = req.flattened_nbytes()
            except Exception:  # noqa: BLE001 - SGLang's checks; the scheduler catches every one of them
                continue
            try:
                meta = req.bucket()
            except WireError:
                continue
            safe_to_act_on(meta)
            assert meta.nbytes == nbytes


def test_a_long_or_deep_input_is_never_echoed():
    for parse, valid in VALID.values():
        for bad in (LONG, [LONG] * 3, json.loads("[" * 500 + "]" * 500)):
            for path in places(valid):
                try:
                    parse(with_replaced(valid, path, bad))
                except WireError as e:
                    assert len(str(e)) < 600 and LONG[:100] not in str(e)


# -- declared limits ------------------------------------------------------------------------------

ADAPTER = AdapterVersion("pol", "slot", {"r": 4, "peft_type": "LORA"}, (2,))
ADAPTER_CHECK = AdapterCheck("pol", ADAPTER.config, (TensorSpec("base_model.model.a.lora_A.weight", torch.float32, (4, 8)),), 3)
DECLARED: list[tuple[Message, str | None]] = [  # a valid message of each declared type, and where it is read
    (UPDATE, None), (UpdateRequest(5, (BUCKET,), True, delta=DeltaVersion(4, (10,))), None), (BUCKET, None),
    (UPDATE.shm, None), (INIT, None), (VersionRequest(3), "begin"), (DiscardRequest(3), None),
    (ClaimRequest("host:12:ab12", True), None), (LayoutCheck(BUCKET.to_bucket(0).specs), None),
    (ADAPTER_CHECK, None), (BaseCheck((("w", 7),)), None), (AdapterUpdate(UPDATE, ADAPTER), None),
    (EndRequest(3, ("0" * 64,)), "end"), (CommitRequest(3, ("0" * 64,)), None),
]


@pytest.mark.parametrize("message, where", DECLARED, ids=lambda m: type(m).__name__ if isinstance(m, Message) else m)
def test_a_value_past_any_declared_limit_is_refused_naming_its_field(message, where):
    """Each field of the message (nested messages' too) given a value just past a limit its
    declaration states, or of the wrong JSON type, is refused with an error that names that field
    (or, for a limit on every entry of a list, the list)."""
    valid = message.to_json()
    mutations = field_mutations(type(message), valid)
    assert len(mutations) >= 3 * len(valid), "the declaration was not read"
    for place, bad in mutations:
        with pytest.raises(WireError) as refused:
            type(message).from_json(with_replaced(valid, place, bad), where)
        named = str(refused.value).split(": ", 1)[0]
        assert named.endswith(at(place)) or (isinstance(place[-1], int) and named.endswith(at(place[:-1]))), (
            place, bad, str(refused.value))


def test_the_update_info_slot_tells_every_message_apart_by_its_tag():
    carried = [UPDATE, DiscardRequest(3), LayoutCheck(BUCKET.to_bucket(0).specs), AdapterUpdate(UPDATE, ADAPTER),
               ADAPTER_CHECK, BaseCheck((("w", 7),)), CommitRequest(3, ("0" * 64,)), CommitRequest(4)]
    assert {type(m) for m in carried} == {UPDATE_INFO.default, *UPDATE_INFO.tagged.values()}
    for message in carried:
        assert UPDATE_INFO.decode(json.loads(json.dumps(UPDATE_INFO.encode(message)))) == message
    with pytest.raises(TypeError, match="is not carried in this slot"):
        UPDATE_INFO.encode(ClaimRequest("host:1:ab"))
    with pytest.raises(TypeError, match="does not hold its tag 'discard' alone"):
        Tags(UpdateRequest, {"discard": VersionRequest})  # its JSON holds "version", not its tag


# -- round trips ---------------------------------------------------------------------------------

NAMES = st.text(st.characters(codec="utf-8", categories=["L", "N", "P", "S"]), min_size=1, max_size=40)
DTYPES = st.sampled_from([("float32", 4), ("bfloat16", 2), ("float16", 2), ("int8", 1), ("float64", 8), ("bool", 1)])


@st.composite
def buckets(draw: st.DrawFn) -> BucketMeta:
    specs = draw(st.lists(st.tuples(NAMES, DTYPES, st.lists(st.integers(0, 6), max_size=3)), min_size=1, max_size=4,
                          unique_by=lambda t: t[0]))
    specs.sort(key=lambda t: -t[1][1])  # descending item size: every offset aligned, as the plan packs them
    nbytes = sum(math.prod(shape) * size for _, (_, size), shape in specs)
    return BucketMeta(tuple(n for n, _, _ in specs), tuple(d for _, (d, _), _ in specs),
                      tuple(tuple(s) for _, _, s in specs), nbytes)


SECONDS = st.floats(min_value=1e-3, max_value=MAX_DEADLINE_S)
GROUPS = st.builds(GroupSpec, st.sampled_from(["127.0.0.1", "node-3.cluster", "::1"]), st.integers(1, 65535),
                   st.integers(2, 64), NAMES, st.sampled_from(["gloo", "nccl"]), SECONDS,
                   key=st.text("0123456789abcdef", min_size=64, max_size=64))


@st.composite
def updates(draw: st.DrawFn) -> UpdateRequest:
    bs = tuple(draw(st.lists(buckets(), min_size=1, max_size=3)))
    n = len(bs)
    shm = draw(st.none() | st.builds(SharedVersion, st.just("asyncsync-9-ab-0"),
                                     st.lists(st.integers(0, 100).map(lambda k: k * ALIGN), min_size=n, max_size=n).map(tuple),
                                     st.lists(st.integers(0, 2**32 - 1), min_size=n, max_size=n).map(tuple), st.just(HOST)))
    return UpdateRequest(draw(st.integers(0, 2**63 - 1)), bs, draw(st.booleans()),
                         tuple(draw(st.lists(SECONDS, min_size=n, max_size=n) | st.just([]))),
                         tuple(draw(st.lists(st.integers(0, 7), min_size=n, max_size=n) | st.just([]))),
                         draw(st.sampled_from(["in_rpc", "background"])), shm)


def through_json(message: Any) -> Any:
    return json.loads(json.dumps(message.to_json()))


@FUZZ
@given(update=updates(), group=GROUPS, more=st.lists(GROUPS, max_size=2), session=NAMES, version=st.integers(0, 2**63 - 1))
def test_every_valid_message_survives_a_round_trip(update, group, more, session, version):
    assert UpdateRequest.from_json(through_json(update)) == update
    for meta in update.buckets:
        assert BucketMeta.from_json(through_json(meta)) == meta
    world = min(g.world_size for g in (group, *more))
    init = InitGroupRequest(group, world - 1, tuple(more))
    assert InitGroupRequest.from_json(through_json(init)) == init
    assert ClaimRequest.from_json(through_json(ClaimRequest(session))) == ClaimRequest(session)
    assert VersionRequest.from_json(through_json(VersionRequest(version)), "end") == VersionRequest(version)
    assert DiscardRequest.from_json(through_json(DiscardRequest(version))) == DiscardRequest(version)


def test_a_trainer_of_another_protocol_is_refused_by_name():
    old = {k: v for k, v in INIT.to_json().items() if k != "protocol"}
    with pytest.raises(WireError, match=f"protocol 1 .*no protocol field.*this server speaks {PROTOCOL_VERSION}"):
        InitGroupRequest.from_json(old)
    newer = PROTOCOL_VERSION + 1
    with pytest.raises(WireError, match=f"protocol {newer}, this server speaks {PROTOCOL_VERSION}"):
        InitGroupRequest.from_json({**INIT.to_json(), "protocol": newer})
    before_keys = {**INIT.to_json(), "protocol": 2}
    for group in (before_keys["group"], *before_keys["more_groups"]):
        del group["key"]
    with pytest.raises(WireError, match=f"protocol 2, this server speaks {PROTOCOL_VERSION}"):
        InitGroupRequest.from_json(before_keys)  # the release before keys is refused by its protocol, not a key


# -- frame headers -------------------------------------------------------------------------------

@FUZZ
@given(words=st.lists(st.integers(-(2**63), 2**63 - 1), min_size=HEADER_WORDS, max_size=HEADER_WORDS),
       magic=st.booleans(), update=updates())
def test_any_received_header_is_parsed_or_refused_never_raises(words, magic, update):
    if magic:
        words[0] = MAGIC
    header = FrameHeader.parse(torch.tensor(words, dtype=torch.int64))
    frames = VersionFrames.of(update)
    problem = frames.mismatch(header, 0, update.buckets[0].nbytes)
    assert header is not None or problem is not None
    good = frames.header(0, torch.empty(update.buckets[0].nbytes, dtype=torch.uint8))
    assert FrameHeader.parse(good.tensor()) == good
    assert frames.mismatch(good, 0, update.buckets[0].nbytes) is None
    assert frames.mismatch(good, 0, update.buckets[0].nbytes + 4096) is not None, "a longer payload is refused"
