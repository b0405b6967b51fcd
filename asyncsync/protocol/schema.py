"""Messages and settings declared as data: each field's type and limits in its annotation, one reader.

A field of a frozen dataclass says what it may hold in its annotation, so that the rule, the error
that names it, the decoder and the fuzzer that probes it all read one declaration::

    version: Annotated[int, Between(0, MAX_VERSION)]
    deadlines_s: Annotated[tuple[float, ...], Items(0, MAX_BUCKETS), Each(SECONDS), OmitDefault()] = ()

Limits (``Constraint``): ``Between`` (an integer range), ``Positive`` (a number above 0), ``Text``
(a printable string), ``Items`` (how many entries), ``Each`` (a limit on every entry, reported at
the list), ``OneOf`` (a set known only when checked: a registry's names) and ``Check`` (any other
rule of one value). How a field travels: ``Key`` (its JSON name), ``IfAbsent`` (its value when the
JSON lacks it, where that differs from the default), ``OmitDefault`` (left out of the JSON at its
default), ``Why`` (appended to its errors) and ``Codec`` (a value with a JSON form of its own).
Types: ``bool``, ``int`` (never a bool), ``float`` (any number), ``str``, ``dict``, ``Any``,
``Literal``, ``X | None``, unions of scalars, ``tuple[X, ...]``, fixed ``tuple[X, Y]`` and dataclasses.

``read`` is the one walk over a field's type. A *reading* says how JSON values are taken and how a
problem is reported: ``Strict`` (asyncsync's receivers; config.py's reading derives from it) takes
exact JSON types, checks every limit and raises its first problem with the field's path; SGLang's
lax reading (``protocol/sglang.py``) coerces as pydantic does and collects every problem. A list's
length is checked before any entry is read, so no input makes a reader walk more than its limits.

A ``Declared`` class is checked by this reader when built in code (``__post_init__``) and when
decoded (``decode``): each field once, in order, then ``rules`` (what spans fields), whose errors
are relative to the object and get the path where it sits. Imports only the standard library.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import reprlib
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import MISSING, dataclass
from typing import Any, ClassVar, Literal, NoReturn

ECHO_CHARS = 60  # the most of one input value an error message quotes

_SHOW = reprlib.Repr()
_SHOW.maxstring = _SHOW.maxother = _SHOW.maxlong = ECHO_CHARS
_SHOW.maxlevel, _SHOW.maxlist, _SHOW.maxdict = 2, 4, 4

Path = tuple[Any, ...]  # keys (str) and list indexes (int) from the outermost object in


class WireError(ValueError):
    """A control request is malformed; the message says which field and why (answered with HTTP 400)."""


def shown(value: Any) -> str:
    """``value`` for an error message: its repr, cut to about ``ECHO_CHARS`` characters and two levels
    of nesting (a 50 MB field or a 10,000-deep list is never echoed back)."""
    return _SHOW.repr(value)


def sane_text(value: Any, max_chars: int) -> bool:
    """A non-empty printable string of at most ``max_chars`` characters that encodes as UTF-8 (no
    control characters, no lone surrogates): safe in a store key, a log line and an error message."""
    if not isinstance(value, str) or not 0 < len(value) <= max_chars or not value.isprintable():
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def at(path: Iterable[Any]) -> str:
    """A path as errors name it: ``update.buckets[3].names[0]``."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# The exact JSON types of the scalars (a number is a float, a bool is no int).
_TAKES: dict[Any, Callable[[Any], bool]] = {int: is_int, float: is_number, bool: lambda v: isinstance(v, bool),
                                            str: lambda v: isinstance(v, str)}


# -- the vocabulary ------------------------------------------------------------------------------

class Constraint:
    """A limit on one value. ``problem`` says what is wrong with ``value`` (None: nothing); it takes any
    value, so a limit on a list's entries can run before they are read. In a ``says`` template,
    ``{got}`` is the value as ``shown`` quotes it."""

    def problem(self, value: Any) -> str | None:
        raise NotImplementedError


@dataclass(frozen=True)
class Between(Constraint):
    """An integer (never a bool) in ``[lo, hi]``; ``hi`` None: no upper bound."""

    lo: int
    hi: int | None = None
    says: str = ""

    def problem(self, value: Any) -> str | None:
        if isinstance(value, int) and not isinstance(value, bool) and self.lo <= value and (
                self.hi is None or value <= self.hi):
            return None
        range_ = f"an integer in [{self.lo}, {self.hi}]" if self.hi is not None else f"an integer >= {self.lo}"
        return (self.says or f"expected {range_}, got {{got}}").replace("{got}", shown(value))


@dataclass(frozen=True)
class Positive(Constraint):
    """A number (never a bool) in ``(0, hi]``: NaN never, infinity only when ``hi`` is."""

    hi: float = math.inf
    says: str = "expected a positive number, got {got}"

    def problem(self, value: Any) -> str | None:
        return None if is_number(value) and 0 < value <= self.hi else self.says.replace("{got}", shown(value))


@dataclass(frozen=True)
class Text(Constraint):
    """``sane_text`` of at most ``max_chars`` characters; with ``spaces`` False, no whitespace either."""

    max_chars: int
    says: str = ""
    spaces: bool = True

    def problem(self, value: Any) -> str | None:
        if sane_text(value, self.max_chars) and (self.spaces or not any(c.isspace() for c in value)):
            return None
        says = self.says or f"expected a printable string of 1 to {self.max_chars} characters, got {{got}}"
        return says.replace("{got}", shown(value))


@dataclass(frozen=True)
class Items(Constraint):
    """``lo`` to ``hi`` entries (``{n}`` in ``says``: how many there are)."""

    lo: int
    hi: int
    says: str = ""

    def problem(self, value: Any) -> str | None:
        if self.lo <= len(value) <= self.hi:
            return None
        says = self.says or (f"at most {self.hi} entries, got {{n}}" if self.lo == 0 else
                             f"expected {self.lo} to {self.hi} entries, got {{n}}")
        return says.replace("{n}", str(len(value)))


@dataclass(frozen=True)
class Each(Constraint):
    """``limit`` on every entry, reported at the list (the message names the list, not an index)."""

    limit: Constraint

    def problem(self, value: Any) -> str | None:
        for entry in value:
            problem = self.limit.problem(entry)
            if problem is not None:
                return problem
        return None


@dataclass(frozen=True)
class OneOf(Constraint):
    """One of ``options()``, a set known only when the value is checked (a registry's names);
    ``{options}`` in ``says``: them, as a list. Fixed sets are ``Literal`` types."""

    options: Callable[[], Iterable[Any]]
    says: str = "{got} is not one of {options}"

    def problem(self, value: Any) -> str | None:
        options = list(self.options())
        return None if value in options else self.says.replace("{got}", shown(value)).replace("{options}", str(options))


@dataclass(frozen=True)
class Check(Constraint):
    """Any other rule of one value: ``test(value)`` true, else ``says``."""

    test: Callable[[Any], Any]
    says: str

    def problem(self, value: Any) -> str | None:
        return None if self.test(value) else self.says.replace("{got}", shown(value))


@dataclass(frozen=True)
class Key:
    """The field's name in JSON, where it is not the attribute's."""

    name: str


@dataclass(frozen=True)
class IfAbsent:
    """The field's value when the JSON lacks it, where that is not its default (an older peer's)."""

    value: Any


@dataclass(frozen=True)
class OmitDefault:
    """The field is left out of the JSON while it holds its default (a peer that predates it reads
    the message as before)."""


@dataclass(frozen=True)
class Why:
    """Appended to a refused choice's message: what each choice does."""

    text: str


@dataclass(frozen=True)
class Codec:
    """A value with a JSON form of its own: ``read(value, path, reading)`` takes the JSON (or an
    already-built value) and returns the value, reporting problems through ``reading``;
    ``write(value)`` gives the JSON."""

    read: Callable[[Any, Path, Any], Any]
    write: Callable[[Any], Any]


# -- the walk ----------------------------------------------------------------------------------------

def unpack(hint: Any) -> tuple[Any, tuple[Any, ...]]:
    """A hint's type and its ``Annotated`` notes (limits and how it travels)."""
    if typing.get_origin(hint) is typing.Annotated:
        return hint.__origin__, hint.__metadata__
    return hint, ()


def _optional_of(tp: Any) -> Any:
    """The type ``tp`` allows beside None, or None when it does not allow None."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) not in (typing.Union, types.UnionType) or type(None) not in args:
        return None
    rest = tuple(a for a in args if a is not type(None))
    return rest[0] if len(rest) == 1 else typing.Union[rest]


def _note(notes: Iterable[Any], kind: type) -> Any:
    return next((n for n in notes if isinstance(n, kind)), None)


def is_declared(tp: Any) -> bool:
    """A dataclass read field by field (a nested message or section)."""
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


@dataclass(frozen=True)
class Plan:
    """A hint taken apart once (``plan``): how ``read`` and ``encode`` walk a value of it.

    ``kind``: ``scalar``, ``literal`` (``options``), ``tuple`` (``entries``: one plan for
    ``tuple[X, ...]``, one per place for a ``fixed`` tuple), ``declared`` (a dataclass) or ``codec``;
    ``optional``: None is taken; ``limits``: its constraints, in order; ``why``: the suffix of a
    refused choice; ``plain``: its JSON is the value itself."""

    kind: str
    tp: Any
    notes: tuple[Any, ...]
    optional: bool
    options: tuple[Any, ...] = ()
    entries: tuple[Plan, ...] = ()
    fixed: bool = False
    limits: tuple[Constraint, ...] = dataclasses.field(init=False)
    codec: Codec | None = dataclasses.field(init=False)
    why: str = dataclasses.field(init=False)
    plain: bool = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        why = _note(self.notes, Why)
        object.__setattr__(self, "limits", tuple(n for n in self.notes if isinstance(n, Constraint)))
        object.__setattr__(self, "codec", _note(self.notes, Codec))
        object.__setattr__(self, "why", f" ({why.text})" if why else "")
        object.__setattr__(self, "plain", self.kind in ("scalar", "literal"))


@functools.cache
def plan(hint: Any) -> Plan:
    """``hint`` taken apart, once per hint (every field of every message is walked through this)."""
    tp, notes = unpack(hint)
    inner = _optional_of(tp)
    if inner is not None:
        tp, more = unpack(inner)
        notes += more
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if _note(notes, Codec) is not None:
        return Plan("codec", tp, notes, inner is not None)
    if origin is Literal:
        return Plan("literal", tp, notes, inner is not None, options=args)
    if origin is tuple:
        fixed = not (len(args) == 2 and args[1] is Ellipsis)
        entries = tuple(plan(a) for a in (args if fixed else args[:1]))
        return Plan("tuple", tp, notes, inner is not None, entries=entries, fixed=fixed)
    return Plan("declared" if is_declared(tp) else "scalar", tp, notes, inner is not None)


def read(hint: Any, value: Any, path: Path, how: Any) -> Any:
    """``value`` (JSON, or a value already built) as a field of type ``hint``, every limit checked;
    problems go to ``how``, the reading, which raises or records them."""
    return read_as(plan(hint), value, path, how)


def read_as(p: Plan, value: Any, path: Path, how: Any) -> Any:
    """``read`` for a hint already taken apart (a field's ``Field.plan``)."""
    if value is None and p.optional:
        return None
    if p.kind == "codec":
        return p.codec.read(value, path, how)  # type: ignore[union-attr]
    if p.kind == "literal":
        return how.literal(p.options, value, path, p.why)
    if p.kind == "tuple":
        return _sequence(p, value, path, how)
    if p.kind == "declared":
        return how.message(p.tp, value, path)
    value = how.scalar(p.tp, value, path)
    _limits(p, value, path, how)
    return value


def _limits(p: Plan, value: Any, path: Path, how: Any) -> None:
    for limit in p.limits:
        problem = limit.problem(value)
        if problem is not None:
            how.fail(path, problem)


def _sequence(p: Plan, value: Any, path: Path, how: Any) -> Any:
    """A JSON list as a tuple: its limits first (its length before any entry is read), then each entry."""
    entries = how.sequence(value, path)
    if entries is None:  # refused, and recorded
        return value
    _limits(p, entries, path, how)
    if not p.fixed:
        (entry,) = p.entries
        if _taken_as_they_are(entry, entries):
            return tuple(entries)
        return tuple([read_as(entry, v, (*path, i), how) for i, v in enumerate(entries)])
    if len(entries) != len(p.entries):
        how.fail(path, f"expected a list of {len(p.entries)} entries, got {shown(value)}")
    return tuple([read_as(e, v, (*path, i), how) for i, (e, v) in enumerate(zip(p.entries, entries))])


def _taken_as_they_are(p: Plan, values: Iterable[Any]) -> bool:
    """Every value already of the scalar type of ``p`` and within its limits, so that every reading
    takes it unchanged: a long list (a bucket's names, a shape's sizes) skips the walk per entry,
    which a failing entry takes, to be named by its index."""
    test = _TAKES.get(p.tp) if p.kind == "scalar" else None
    if test is None or not all(map(test, values)):
        return False
    return not any(limit.problem(v) is not None for limit in p.limits for v in values)


@dataclass(frozen=True)
class Field:
    """A field of a dataclass as this module reads it: its name, JSON key, plan and default."""

    name: str
    key: str
    plan: Plan
    required: bool
    default: Callable[[], Any]


@functools.cache
def fields_of(cls: type) -> tuple[Field, ...]:
    """Each field of dataclass ``cls``, its hint (notes included) taken apart once."""
    hints = typing.get_type_hints(cls, include_extras=True)
    out = []
    for f in dataclasses.fields(cls):
        p = plan(hints[f.name])
        key = _note(p.notes, Key)
        required = f.default is MISSING and f.default_factory is MISSING
        default = f.default_factory if f.default is MISSING else (lambda value=f.default: value)
        out.append(Field(f.name, key.name if key else f.name, p, required, default))  # type: ignore[arg-type]
    return tuple(out)


def present(cls: type, data: Mapping[str, Any], path: Path, how: Any) -> Iterator[tuple[Field, Any]]:
    """Each field of ``cls`` that ``data`` gives (or whose ``IfAbsent`` stands in), with its JSON
    value, in order; ``how.missing`` hears of each required field it lacks."""
    for f in fields_of(cls):
        if f.key in data:
            yield f, data[f.key]
            continue
        absent = _note(f.plan.notes, IfAbsent)
        if absent is not None:
            yield f, absent.value
        elif f.required:
            how.missing(path, f.key, data)


def check(obj: Any, path: Path, how: Any) -> None:
    """Read every field of ``obj`` in place (its limits; JSON lists become tuples, JSON objects nested
    dataclasses), then its rules: a ``Declared`` class's ``rules``, a plain dataclass's
    ``__post_init__``. A rule's error, relative to ``obj``, gets ``path`` in front."""
    for f in fields_of(type(obj)):
        object.__setattr__(obj, f.name, read_as(f.plan, getattr(obj, f.name), (*path, f.key), how))
    rules = obj.rules if isinstance(obj, Declared) else getattr(obj, "__post_init__", None)
    if rules is None:
        return
    try:
        rules()
    except how.error as e:
        raise how.error(f"{at(path)}.{e}" if path else str(e)) from None


def decode(cls: type, data: Any, path: Path, how: Any) -> Any:
    """The dataclass ``cls`` read from JSON (or parsed YAML) ``data`` as ``how`` reads; errors name
    their path from ``path`` on. Built without ``__init__`` so that each check runs once, under the
    path the object was read at."""
    data = how.mapping(cls, data, path)
    given = {f.name: value for f, value in present(cls, data, path, how)}
    obj = object.__new__(cls)
    for f in fields_of(cls):
        object.__setattr__(obj, f.name, given[f.name] if f.name in given else f.default())
    check(obj, path, how)
    return obj


def encode(obj: Any) -> Any:
    """The JSON of a dataclass instance, field by field as declared (keys, codecs, omitted defaults)."""
    out = {}
    for f in fields_of(type(obj)):
        value = getattr(obj, f.name)
        if _note(f.plan.notes, OmitDefault) and value == f.default():
            continue
        out[f.key] = _write(f.plan, value)
    envelope = getattr(obj, "ENVELOPE", "")
    return {envelope: out} if envelope else out


def _write(p: Plan, value: Any) -> Any:
    if value is None or p.plain:
        return value
    if p.kind == "codec":
        return p.codec.write(value)  # type: ignore[union-attr]
    if p.kind == "declared":
        return encode(value)
    if not p.fixed and p.entries[0].plain:
        return list(value)
    entries = p.entries * len(value) if not p.fixed else p.entries
    return [_write(e, v) for e, v in zip(entries, value)]


# -- asyncsync's reading ------------------------------------------------------------------------------

class Strict:
    """asyncsync's own reading: exact JSON types (an int is never a bool, a float is any number), every
    limit, the first problem raised as ``error`` with its field's path; keys a class does not
    declare are ignored (a newer peer's). config.py's reading derives from it."""

    error: type[ValueError] = WireError
    ROOT = "body"  # what an error names when the problem is the whole input

    def fail(self, path: Path, reason: str) -> NoReturn:
        raise self.error(f"{at(path) or self.ROOT}: {reason}")

    def mapping(self, cls: type, value: Any, path: Path) -> Mapping[str, Any]:
        if not isinstance(value, dict):
            self.fail(path, f"expected a JSON object, got {type(value).__name__}")
        return value

    def missing(self, path: Path, key: str, data: Mapping[str, Any]) -> NoReturn:
        self.fail(path, f"missing field '{key}'")

    def message(self, cls: type, value: Any, path: Path) -> Any:
        """A nested object: as built (it checked itself), or read from its JSON."""
        return value if isinstance(value, cls) else decode(cls, value, path, self)

    def sequence(self, value: Any, path: Path) -> Any:
        if not isinstance(value, (list, tuple)):
            self.fail(path, f"expected list, got {type(value).__name__}")
        return value

    def literal(self, options: tuple[Any, ...], value: Any, path: Path, why: str) -> Any:
        if value not in options:
            self.fail(path, f"{shown(value)} is not one of {list(options)}{why}")
        return value

    def scalar(self, tp: Any, value: Any, path: Path) -> Any:
        if not self.takes(tp, value):
            self.fail(path, f"expected {self.type_name(tp)}, got {type(value).__name__}")
        return value

    def takes(self, tp: Any, value: Any) -> bool:
        """Whether ``value`` is a value of the scalar type ``tp`` (or of any type of a union)."""
        test = _TAKES.get(tp)
        if test is not None:
            return test(value)
        if typing.get_origin(tp) in (typing.Union, types.UnionType):
            return any(self.takes(t, value) for t in typing.get_args(tp))
        return tp is Any or isinstance(value, typing.get_origin(tp) or tp)

    def type_name(self, tp: Any) -> str:
        if typing.get_origin(tp) in (typing.Union, types.UnionType):
            return " or ".join(self.type_name(t) for t in typing.get_args(tp))
        return "a number" if tp is float else getattr(typing.get_origin(tp) or tp, "__name__", str(tp))


STRICT = Strict()


class Declared:
    """A frozen dataclass whose fields are declared with this vocabulary: checked by ``READING`` when
    built (paths from ``WHERE``) and when decoded (paths from where it was read), then ``rules``."""

    WHERE: ClassVar[str] = ""  # the path of its fields in errors, when built in code
    CHECKED_WHEN_BUILT: ClassVar[bool] = True
    READING: ClassVar[Strict] = STRICT

    def __post_init__(self) -> None:
        if self.CHECKED_WHEN_BUILT:
            check(self, (self.WHERE,) if self.WHERE else (), self.READING)

    def rules(self) -> None:
        """Rules across fields, after every field was read; errors relative to this object
        (``"delta.base: ..."``)."""


class Message(Declared):
    """A declared message of the wire: ``from_json`` decodes it strictly, ``to_json`` encodes it.
    ``ENVELOPE``: its fields travel as one object under this key (its tag)."""

    ENVELOPE: ClassVar[str] = ""

    @classmethod
    def from_json(cls, data: Any, where: str | None = None) -> Any:
        """The message, or ``WireError`` naming the first bad field (paths from ``where``, by default
        ``WHERE``), for any JSON value."""
        root = cls.WHERE if where is None else where
        if cls.ENVELOPE:
            data = data.get(cls.ENVELOPE) if isinstance(data, dict) else None
        return decode(cls, data, (root,) if root else (), cls.READING)

    def to_json(self) -> Any:
        return encode(self)

    @classmethod
    def json_keys(cls) -> set[str]:
        """The keys at the top of its JSON object."""
        return {cls.ENVELOPE} if cls.ENVELOPE else {f.key for f in fields_of(cls)}


class Tags:
    """Messages that travel in one slot, each known by its tag (a top-level key only its JSON holds),
    ``default`` the one without a tag: the one table both the side that sends and the side that
    dispatches read. Each tag is checked against its class's declared keys when the table is made."""

    def __init__(self, default: type[Message], tagged: Mapping[str, type[Message]]):
        for tag, cls in tagged.items():
            if tag not in cls.json_keys() or tag in default.json_keys():
                raise TypeError(f"{cls.__name__}'s JSON does not hold its tag {tag!r} alone")
        self.default = default
        self.tagged = dict(tagged)

    def decode(self, data: Any) -> Message:
        """The message ``data`` holds: the class of the first tag it has, else ``default``."""
        cls = next((c for tag, c in self.tagged.items() if isinstance(data, dict) and tag in data), self.default)
        return cls.from_json(data)

    def encode(self, message: Message) -> Any:
        """``message``'s JSON, for a class of this table only (the receiver could not tell it apart)."""
        if type(message) is not self.default and type(message) not in self.tagged.values():
            raise TypeError(f"{type(message).__name__} is not carried in this slot")
        return message.to_json()
