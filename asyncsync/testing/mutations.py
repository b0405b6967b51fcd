"""Values that break a request, for the route fuzzer (``testing/fuzz.py``) and the parsers' tests.

Two sources: values hostile to any parser (``HOSTILE``: NaN, 2**64, lone surrogates, 5,000-character
strings, deep lists, paths out of a directory; ``random_json``), put at any place of a valid body
(``places``, ``with_replaced``); and, for a message declared with ``protocol/schema.py``'s
vocabulary, values its declaration refuses (``field_mutations``): just past each limit of each
field, and the wrong JSON type. A receiver must refuse every one of the latter with an error that
names the field.
"""

from __future__ import annotations

import json
import math
import random
import typing
from collections.abc import Iterator
from typing import Any

from asyncsync.protocol.schema import Between, Constraint, Each, Items, Message, OneOf, Plan, Positive, Text, fields_of

HOSTILE: list[Any] = [
    float("nan"), float("inf"), -float("inf"), 1e300, -1e300, 1e-300, 2**63, 2**64, -(2**63) - 1, 10**40, -1, 0, 1,
    0.5, "", " ", "\ud800", "a\x00b", "x" * 5000, "float33", [], {}, [[[[[[[[]]]]]]]], [-1], [2**62, 2**62], True,
    False, None, {"a": "x" * 5000}, ["x" * 5000], "1", "1e9", "../../../../etc", "/", "org/model", "a\n",
]
ABSURD = [float("nan"), float("inf"), -float("inf"), 1e300, -1e300, 1e-300, 2**64, 2**63, -(2**63) - 1, 10**40, -1]
LONGEST_LIST = 4096  # a limit on entries is probed one past it only up to this many (a body stays small)

Place = tuple[Any, ...]  # keys and list indexes into a JSON document


def places(value: Any, path: Place = ()) -> Iterator[Place]:
    """Every place in a JSON document: the whole, then each key's and each entry's, depth first."""
    yield path
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        yield from places(v, (*path, k))


def with_replaced(doc: Any, path: Place, new: Any, delete: bool = False) -> Any:
    """A copy of ``doc`` with the value at ``path`` replaced by ``new`` (or, in an object, deleted)."""
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


def numeric_places(value: Any) -> list[Place]:
    """The places of ``value`` that hold a number (not a bool)."""
    def numeric(path: Place) -> bool:
        node = value
        for k in path:
            node = node[k]
        return isinstance(node, (int, float)) and not isinstance(node, bool)
    return [p for p in places(value) if p and numeric(p)]


def random_json(rng: random.Random, depth: int = 0) -> Any:
    """A random JSON value, a third of the time ``HOSTILE``'s, nested at most three deep."""
    roll = rng.random()
    if depth > 2 or roll < 0.5:
        return rng.choice([rng.randint(-10**6, 10**6), rng.random() * 10**rng.randint(-5, 5), rng.choice(HOSTILE),
                           "".join(rng.choice("ab.\\\"/ \u00e9\u4e2d\ud83d") for _ in range(rng.randint(0, 8))), None, True])
    if roll < 0.75:
        return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(["version", "names", "a", "", "shm", "group"]): random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def field_mutations(cls: type[Message], doc: Any) -> list[tuple[Place, Any]]:
    """(place, value) pairs that break ``doc``, the JSON of a valid ``cls``, at one declared field
    each: values just past the field's limits, and of the wrong JSON type; inside a list, at its
    first entry (the others are read the same way)."""
    if cls.ENVELOPE:
        return _fields(cls, doc[cls.ENVELOPE], (cls.ENVELOPE,))
    return _fields(cls, doc, ())


def _fields(cls: type, doc: dict[str, Any], place: Place) -> list[tuple[Place, Any]]:
    out = []
    for f in fields_of(cls):
        if f.key in doc:
            out += _breaking(f.plan, doc[f.key], (*place, f.key))
    return out


def _breaking(p: Plan, value: Any, place: Place) -> list[tuple[Place, Any]]:
    out = [(place, bad) for bad in [*_past_limits(p), *_wrong_types(p)]]
    if p.kind == "tuple" and isinstance(value, list):  # a list's first entry (its one plan), a fixed tuple's every place
        for i, (entry, v) in enumerate(zip(p.entries, value)):
            out += _breaking(entry, v, (*place, i))
    elif p.kind == "declared" and isinstance(value, dict):
        out += _fields(p.tp, value, place)
    return out


def _past_limits(p: Plan) -> list[Any]:
    """Values just past each limit of ``p``."""
    return [bad for limit in p.limits for bad in _past(limit)]


def _past(limit: Constraint) -> list[Any]:
    if isinstance(limit, Between):
        return [limit.lo - 1] + ([limit.hi + 1] if limit.hi is not None else [])
    if isinstance(limit, Positive):
        return [0, -1.0, float("nan")] + ([limit.hi * 2] if math.isfinite(limit.hi) else [])
    if isinstance(limit, Text):
        return ["", "x" * (limit.max_chars + 1), "a\nb", "\ud800"] + ([] if limit.spaces else ["a b"])
    if isinstance(limit, Items):
        return ([[]] if limit.lo > 0 else []) + ([[0] * (limit.hi + 1)] if limit.hi < LONGEST_LIST else [])
    if isinstance(limit, Each):
        return [[bad] for bad in _past(limit.limit)]
    if isinstance(limit, OneOf):
        return ["no-such-choice"]
    return []  # a Check: its rule is code; the wrong types probe it


def _wrong_types(p: Plan) -> list[Any]:
    """Values of another JSON type than ``p`` takes (never None: an optional field takes it)."""
    if p.kind == "codec":  # no codec of the protocol reads a number or a bare string
        return [7, "x"]
    if p.kind == "literal":
        return ["no-such-choice", 0]
    if p.kind == "tuple":
        return ["x", {}]
    if p.kind == "declared" or p.tp is dict or typing.get_origin(p.tp) is dict:
        return [[], "x"]
    return {int: ["1", 1.5, True], float: ["1", True], bool: ["true", 1], str: [7, ["x"]]}.get(p.tp, [[], {}])
