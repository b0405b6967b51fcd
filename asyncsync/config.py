"""``WeightSyncConfig``: every knob of a sync, loadable from YAML, validated with errors that name the key."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, get_args, get_origin, get_type_hints

import yaml

from asyncsync.engines import engine_kinds
from asyncsync.packing import backend_names
from asyncsync.protocol.specs import DEFAULT_BUCKET_BYTES

DATA_PLANE_BACKENDS = ("auto", "gloo", "nccl")
TRANSPORTS = ("auto", "collective", "shm")
T = TypeVar("T")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range; the message names the key."""


def parse_bytes(value: int | str, key: str) -> int:
    """``536870912``, ``"512MiB"`` or ``"0.5 GB"`` -> bytes."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a byte size such as 536870912 or '512MiB', got {value!r}")
    if isinstance(value, int):
        n = value
    else:
        m = _SIZE.match(str(value))
        if not m:
            raise ConfigError(f"{key}: expected a byte size such as 536870912 or '512MiB', got {value!r}")
        n = int(float(m.group(1)) * _UNITS[(m.group(2) or "b").lower()])
    if n <= 0:
        raise ConfigError(f"{key}: must be positive, got {value!r}")
    return n


@dataclass(frozen=True)
class ServerConfig:
    """One inference server: its kind, its control URL, an optional bearer token, and the update
    policies of vLLM and SGLang servers (the reference server swaps versions atomically and needs none):
    ``pause`` stops generation from ``begin`` to ``end`` so no token mixes versions, and
    ``reset_prefix_cache`` drops KV computed with the old weights once the new ones are in."""

    url: str
    kind: str = "reference"
    token: str | None = None
    pause: bool = True
    reset_prefix_cache: bool = True

    SHORTHAND = "url"  # a bare string in a config is a server's URL

    def __post_init__(self) -> None:
        if self.kind not in engine_kinds():
            raise ConfigError(f"kind: {self.kind!r} is not a registered engine kind; registered: {engine_kinds()} "
                              "(asyncsync.engines.register_engine adds one)")
        for name in ("pause", "reset_prefix_cache"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}: expected true or false, got {getattr(self, name)!r}")
        if not isinstance(self.url, str) or not re.match(r"^https?://[^/\s]+", self.url):
            raise ConfigError(f"url: {self.url!r} is not an http(s) URL such as http://127.0.0.1:8000")

    @property
    def base_url(self) -> str:
        return self.url.rstrip("/")


@dataclass(frozen=True)
class Deadlines:
    """Seconds each kind of wait may take before the server involved is considered failed.

    ``collective_s`` is the ceiling of one broadcast. Once a version has been sent, each broadcast's
    own deadline follows the measured rate: ``broadcast_factor`` times its expected time, at least
    ``broadcast_floor_s`` (``transport.pace``), so a dead server costs seconds, not ``collective_s``."""

    rendezvous_s: float = 60.0
    collective_s: float = 120.0
    http_s: float = 120.0
    broadcast_floor_s: float = 2.0
    broadcast_factor: float = 8.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"{f.name}: must be a positive number, got {v!r}")
        if self.broadcast_factor < 1:
            raise ConfigError(f"broadcast_factor: a deadline below the expected time fails healthy broadcasts; "
                              f"use a factor >= 1, got {self.broadcast_factor}")


@dataclass(frozen=True)
class WeightSyncConfig:
    """How weights travel from the trainer to its servers. See ``configs/default.yaml`` for every field."""

    async_weight_update: bool = False
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    backend: str = "auto"
    pack_backend: str = "auto"
    checksum: bool = True
    max_staleness: int = 1
    servers: tuple[ServerConfig, ...] = ()
    deadlines: Deadlines = field(default_factory=Deadlines)
    group_per_server: bool = False
    readmit_interval_s: float = 5.0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    group_name: str = "asyncsync"
    takeover: bool = False
    trainer_ranks: str | int = "auto"
    funnel: bool = False
    snapshot: str = "device"
    transport: str = "auto"

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"transport: {self.transport!r} is not one of {list(TRANSPORTS)} (auto: shared memory for "
                              "servers on this host, the data-plane group for the others)")
        if not isinstance(self.async_weight_update, bool):
            raise ConfigError(f"async_weight_update: expected true or false, got {self.async_weight_update!r}")
        if not isinstance(self.group_per_server, bool):
            raise ConfigError(f"group_per_server: expected true or false, got {self.group_per_server!r}")
        if self.group_per_server and not self.async_weight_update:
            raise ConfigError("group_per_server: needs async_weight_update: true (a blocking publish waits for every server anyway)")
        if not isinstance(self.checksum, bool):
            raise ConfigError(f"checksum: expected true or false, got {self.checksum!r}")
        if not isinstance(self.takeover, bool):
            raise ConfigError(f"takeover: expected true or false, got {self.takeover!r}")
        if self.trainer_ranks not in ("auto", 1):
            raise ConfigError(f"trainer_ranks: expected auto (every rank of torch.distributed's default group calls "
                              f"connect/publish/close) or 1 (only this process), got {self.trainer_ranks!r}")
        if not isinstance(self.funnel, bool):
            raise ConfigError(f"funnel: expected true or false, got {self.funnel!r}")
        if self.snapshot not in ("device", "host"):
            raise ConfigError(f"snapshot: expected device or host, got {self.snapshot!r}")
        object.__setattr__(self, "bucket_bytes", parse_bytes(self.bucket_bytes, "bucket_bytes"))
        if self.backend not in DATA_PLANE_BACKENDS:
            raise ConfigError(f"backend: {self.backend!r} is not one of {list(DATA_PLANE_BACKENDS)}")
        if self.pack_backend not in backend_names():
            raise ConfigError(f"pack_backend: {self.pack_backend!r} is not one of {backend_names()}")
        if not isinstance(self.max_staleness, int) or isinstance(self.max_staleness, bool) or self.max_staleness < 0:
            raise ConfigError(f"max_staleness: expected an integer >= 0, got {self.max_staleness!r}")
        if not isinstance(self.readmit_interval_s, (int, float)) or isinstance(self.readmit_interval_s, bool) or self.readmit_interval_s <= 0:
            raise ConfigError(f"readmit_interval_s: expected a positive number of seconds, got {self.readmit_interval_s!r}")
        if not isinstance(self.master_port, int) or not 0 <= self.master_port < 65536:
            raise ConfigError(f"master_port: expected 0 (pick a free port) or a port number, got {self.master_port!r}")
        urls = [s.base_url for s in self.servers]
        if len(set(urls)) != len(urls):
            raise ConfigError(f"servers: the same URL is listed twice: {urls}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> WeightSyncConfig:
        return from_mapping(cls, data or {})

    @classmethod
    def from_yaml(cls, path: str | Path, section: str | None = None) -> WeightSyncConfig:
        """Load from a YAML file; ``section`` picks a nested mapping such as ``weight_sync``."""
        with open(path) as f:
            data = yaml.safe_load(f) or {}
        if section is not None:
            if section not in data:
                raise ConfigError(f"{path}: no '{section}' section")
            data = data[section]
        return cls.from_dict(data)

    def replace(self, **changes: Any) -> WeightSyncConfig:
        return dataclasses.replace(self, **changes)


def from_mapping(cls: type[T], data: Any, prefix: str = "") -> T:
    """Build the frozen dataclass ``cls`` from a mapping (parsed YAML): unknown keys are refused, fields
    typed as dataclasses (or tuples of them) are built recursively, and every error names its key path
    from the top (``prefix``), e.g. ``servers[1].kind: ...``. A class with a ``SHORTHAND`` field name
    also accepts a bare value for that field (a server given as its URL)."""
    where = prefix.rstrip(".") or "config"
    shorthand = getattr(cls, "SHORTHAND", None)
    if shorthand is not None and not isinstance(data, Mapping):
        data = {shorthand: data}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    hints = get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{prefix}{unknown[0]}: unknown key; valid keys are {sorted(known)}")
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in data
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{prefix}{missing[0]}: missing; this setting has no default")
    kwargs = {key: _field_value(hints[key], value, f"{prefix}{key}") for key, value in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError as e:  # __post_init__ names the field; add where the dataclass sits
        raise ConfigError(f"{prefix}{e}") from None
    except TypeError as e:
        raise ConfigError(f"{where}: {e}") from None


def _field_value(hint: Any, value: Any, path: str) -> Any:
    if dataclasses.is_dataclass(hint):
        return from_mapping(hint, value, f"{path}.")
    args = get_args(hint)
    if get_origin(hint) is tuple and len(args) == 2 and args[1] is Ellipsis and dataclasses.is_dataclass(args[0]):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__}")
        return tuple(from_mapping(args[0], v, f"{path}[{i}].") for i, v in enumerate(value))
    return value
