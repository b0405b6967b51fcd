"""``WeightSyncConfig``: every knob of a sync, loadable from YAML, validated with errors that name the key."""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, NoReturn, TypeVar

import yaml

from asyncsync.packing import backend_names
from asyncsync.protocol.schema import (
    Between, Check, Codec, Declared, OneOf, Positive, Strict, Why, at, decode, fields_of,
)
from asyncsync.protocol.schema import Path as FieldPath  # (pathlib's Path is a file's)
from asyncsync.protocol.specs import DEFAULT_BUCKET_BYTES, LAYOUTS
from asyncsync.protocol.wire import MAX_DEADLINE_S, MAX_RELAY_EDGES, ReceiveMode
from asyncsync.registry import ENGINES

_ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,55}$")
_URL = re.compile(r"^https?://[^/\s]+")
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


class ConfigReading(Strict):
    """How a configuration is read: ``schema.Strict`` in a configuration's words. An unknown or a
    missing key is refused by its name, a class with a ``SHORTHAND`` field takes a bare value for it
    (a server given as its URL), and a bare ``off``/``on``, which PyYAML (YAML 1.1) reads as
    false/true, is that word wherever a string is expected."""

    error = ConfigError
    ROOT = "config"
    WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}

    def mapping(self, cls: type, value: Any, path: FieldPath) -> Mapping[str, Any]:
        shorthand = getattr(cls, "SHORTHAND", None)
        if shorthand is not None and not isinstance(value, Mapping):
            value = {shorthand: value}
        if not isinstance(value, Mapping):
            self.fail(path, f"expected a mapping, got {type(value).__name__}")
        keys = sorted(f.key for f in fields_of(cls))
        unknown = sorted(set(value) - set(keys))
        if unknown:
            self.fail((*path, unknown[0]), f"unknown key; valid keys are {keys}")
        return value

    def missing(self, path: FieldPath, key: str, data: Mapping[str, Any]) -> NoReturn:
        self.fail((*path, key), "missing; this setting has no default")

    def sequence(self, value: Any, path: FieldPath) -> Any:
        if not isinstance(value, (list, tuple)):
            self.fail(path, f"expected a list, got {type(value).__name__}")
        return value

    def literal(self, options: tuple[Any, ...], value: Any, path: FieldPath, why: str) -> Any:
        return super().literal(options, _word(value), path, why)

    def scalar(self, tp: Any, value: Any, path: FieldPath) -> Any:
        value = _word(value) if tp is str else value
        if not self.takes(tp, value):
            self.fail(path, f"expected {self.WORDS.get(tp) or self.type_name(tp)}, got {value!r}")
        return value


def _word(value: Any) -> Any:
    """A YAML 1.1 bare ``on``/``off`` (read as true/false) as the word it was."""
    return ("on" if value else "off") if isinstance(value, bool) else value


class Setting(Declared):
    """A section of the configuration, its keys declared with ``protocol/schema.py``'s vocabulary and
    read by ``ConfigReading``; ``rules`` hold what spans keys (errors name the first key involved)."""

    READING = ConfigReading()


def _byte_size(value: Any, path: FieldPath, _reading: Any) -> int:
    return parse_bytes(value, at(path))


def _http_url(value: str) -> bool:
    return _URL.match(value) is not None


def _fanout(value: str | int) -> bool:
    return value in ("direct", "auto") if isinstance(value, str) else 1 <= value <= MAX_RELAY_EDGES


PositiveSeconds = Annotated[float, Positive(says="must be a positive number, got {got}")]


@dataclass(frozen=True)
class ServerConfig(Setting):
    """One inference server: its kind, its control URL, an optional bearer token, and the update
    policies of vLLM and SGLang servers (the reference server swaps versions atomically and needs none):

    * ``pause``: hold generation while the new version is switched in, so no token is generated with
      new weights under the old version's number (vLLM: only around the load when ``receive`` is
      ``background``; from ``begin`` to ``end`` otherwise);
    * ``mix_versions``: whether a request in flight at a switch may continue on the new version.
      false: the switch waits for in-flight requests to finish (new ones wait: vLLM 0.32 queues them,
      0.33 answers them 503 "Generation is paused" and the client sends them again until the
      request's deadline), so every request is generated by one version; true: they freeze and continue on the new version (vLLM ``keep``);
    * ``reset_prefix_cache``: drop KV computed with the old weights once the new ones are in;
    * ``receive`` (vLLM): ``background`` receives and verifies a version on a worker thread while the
      engine keeps generating, and holds the engine only to load it; ``in_rpc`` does all of it inside
      vLLM's update RPC, which stops the engine for the whole transfer but keeps the receive's
      transient memory (checksums, the data plane's buffers) off the engine's peak;
    * ``lora_receiver`` (SGLang, ``lora: adapter``): the URL of an asyncsync receiver on the SGLang
      server's host (``asyncsync serve`` of the same architecture), which receives each adapter
      version and writes it where SGLang's ``/load_lora_adapter`` reads it (SGLang runs no code of ours)."""

    url: Annotated[str, Check(_http_url, "{got} is not an http(s) URL such as http://127.0.0.1:8000")]
    kind: Annotated[str, OneOf(ENGINES.names, "{got} is not a registered engine kind; registered: {options} "
                                              "(asyncsync.engines.register_engine adds one)")] = "reference"
    token: str | None = None
    pause: bool = True
    mix_versions: bool = False
    reset_prefix_cache: bool = True
    receive: ReceiveMode = "background"
    lora_receiver: str | None = None

    SHORTHAND = "url"  # a bare string in a config is a server's URL

    def rules(self) -> None:
        if self.kind == "vllm" and not self.pause and not self.mix_versions:
            raise ConfigError("pause: false lets vLLM switch versions under running requests, so a request may be "
                              "generated by two versions; set mix_versions: true to allow that, or keep pause: true")
        if self.lora_receiver is not None and (self.kind != "sglang" or not _http_url(self.lora_receiver)):
            raise ConfigError(f"lora_receiver: {self.lora_receiver!r}: the http(s) URL of an asyncsync receiver on an "
                              "SGLang server's host (kind: sglang only)")

    @property
    def base_url(self) -> str:
        return self.url.rstrip("/")


@dataclass(frozen=True)
class Deadlines(Setting):
    """Seconds each kind of wait may take before the server involved is considered failed.

    ``collective_s`` is the ceiling of one broadcast. Once a version has been sent, each broadcast's
    own deadline follows the measured rate: ``broadcast_factor`` times its expected time, at least
    ``broadcast_floor_s`` (``transport.pace``), so a dead server costs seconds, not ``collective_s``.
    ``load_s``: an engine loading an adapter version through its own API (``lora: adapter``); no
    collective of the trainer waits on it, so it is not part of the trainer ranks' deadline."""

    rendezvous_s: PositiveSeconds = 60.0
    collective_s: PositiveSeconds = 120.0
    http_s: PositiveSeconds = 120.0
    broadcast_floor_s: PositiveSeconds = 2.0
    broadcast_factor: PositiveSeconds = 8.0
    load_s: PositiveSeconds = 120.0

    def rules(self) -> None:
        if self.broadcast_factor < 1:
            raise ConfigError(f"broadcast_factor: a deadline below the expected time fails healthy broadcasts; "
                              f"use a factor >= 1, got {self.broadcast_factor}")
        if self.collective_s > MAX_DEADLINE_S:
            raise ConfigError(f"collective_s: receivers refuse a group whose broadcasts may take longer than "
                              f"{MAX_DEADLINE_S:.0f}s, got {self.collective_s}")

    @property
    def version_s(self) -> float:
        """The longest one version may take before a server is given up on: forming an epoch
        (``rendezvous_s``), a broadcast (``collective_s``) and the HTTP phases (``http_s`` each)."""
        return self.rendezvous_s + self.collective_s + 4 * self.http_s


@dataclass(frozen=True)
class WeightSyncConfig(Setting):
    """How weights travel from the trainer to its servers. See ``configs/default.yaml`` for every field."""

    async_weight_update: bool = False
    bucket_bytes: Annotated[int, Codec(_byte_size, int)] = DEFAULT_BUCKET_BYTES
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    pack_backend: Annotated[str, OneOf(backend_names)] = "auto"
    checksum: bool = True
    max_staleness: Annotated[int, Between(0)] = 1
    servers: tuple[ServerConfig, ...] = ()
    deadlines: Deadlines = field(default_factory=Deadlines)
    group_per_server: bool = False
    fanout: Annotated[str | int, Check(_fanout, "expected direct (the trainer sends to every server), auto (servers "
                                                "relay along a chain or tree planned from the bucket count) or the "
                                                f"servers each one relays to (1-{MAX_RELAY_EDGES}; 1: a chain), got "
                                                "{got}")] = "direct"
    digest: Annotated[Literal["auto", "on", "off"], Why(
        "auto: on with a relay (fanout other than direct); on: every bucket's BLAKE3 digest goes to each server with "
        "end and it commits only matching bytes; off: CRC32C only")] = "auto"
    readmit_interval_s: Annotated[float, Positive(says="expected a positive number of seconds, got {got}")] = 5.0
    master_addr: str = "127.0.0.1"
    master_port: Annotated[int, Between(0, 65535, "expected 0 (pick a free port) or a port number, got {got}")] = 0
    group_name: str = "asyncsync"
    takeover: bool = False
    trainer_ranks: Annotated[str | int, Check(lambda ranks: ranks in ("auto", 1), (
        "expected auto (every rank of torch.distributed's default group calls connect/publish/close) or 1 (only this "
        "process), got {got}"))] = "auto"
    funnel: bool = False
    snapshot: Literal["device", "host"] = "device"
    transport: Annotated[Literal["auto", "collective", "shm"], Why(
        "auto: shared memory for servers on this host, the data-plane group for the others")] = "auto"
    delta: Annotated[Literal["auto", "off"], Why(
        "auto: a server that committed the last version gets what changed since, off: every version whole")] = "auto"
    layout: Annotated[Literal[LAYOUTS], Why(
        "checkpoint: the names and layouts engines load, from transformers' own conversion; trainer: the module's "
        "own names")] = "checkpoint"
    lora: Annotated[Literal["merged", "adapter"], Why(
        "merged: a PEFT model's adapter merged into the weights sent; adapter: only the adapter per version, loaded "
        "by each engine's own LoRA API")] = "merged"
    lora_name: Annotated[str, Check(_ADAPTER_NAME.match, "{got}: expected 1-56 letters, digits, '.', '_' or '-' "
                                                         "(versions are served as <lora_name>-v<N>)")] = "policy"
    verify: Annotated[Literal["auto", "logprobs", "off"], Why(
        "auto: each server scores a probe the trainer scores too, after the first version it takes and every "
        "verify_every versions, where the trainer can score (a causal LM module), else off; logprobs: also at "
        "connect, and a model that cannot be scored is refused; off: bytes only")] = "auto"
    verify_every: Annotated[int, Between(1, None, "expected a whole number of versions >= 1, got {got}")] = 10
    verify_tolerance: Annotated[float | None, Positive(sys.float_info.max, (
        "expected a positive number (nats of log-probability), or null for the weights' dtype's default, got "
        "{got}"))] = None
    on_divergence: Annotated[Literal["report", "evict"], Why(
        "report: an event, an error and a counter; evict: also evict the server, as a dead one")] = "report"

    def rules(self) -> None:
        """The pairs of settings that cannot work together."""
        if self.lora == "adapter" and self.layout != "checkpoint":
            raise ConfigError("lora: adapter sends the base in the checkpoint layout engines load: keep layout: checkpoint")
        if self.verify == "logprobs" and self.lora == "adapter":
            raise ConfigError("verify: logprobs checks the weights a server serves; with lora: adapter each version is an "
                              "adapter the engine loads under its own name: use verify: auto (off with adapters) or off")
        if self.group_per_server and not self.async_weight_update:
            raise ConfigError("group_per_server: needs async_weight_update: true (a blocking publish waits for every server anyway)")
        if self.fanout != "direct" and self.group_per_server:
            raise ConfigError("fanout: a relay sends one version down one tree; group_per_server sends each server its "
                              "own: use one of them")
        if self.fanout != "direct" and not self.checksum:
            raise ConfigError("fanout: a relayed version is checked at every server against the trainer's checksums and "
                              "digests; with checksum: false nothing would be: set checksum: true, or fanout: direct")
        self._check_servers()

    @property
    def digests(self) -> bool:
        """Whether every bucket's digest goes to each server with ``end`` (``protocol/digest.py``): ``digest:
        on``, or ``auto`` with a relay, where the bytes a server receives come through other servers."""
        return self.digest == "on" or (self.digest == "auto" and self.fanout != "direct")

    def _check_servers(self) -> None:
        urls = [s.base_url for s in self.servers]
        if len(set(urls)) != len(urls):
            raise ConfigError(f"servers: the same URL is listed twice: {urls}")
        for i, s in enumerate(self.servers):
            if self.digests and s.kind == "vllm" and s.receive == "in_rpc":
                raise ConfigError(f"servers[{i}].receive: in_rpc loads a version inside the transfer, before the trainer's "
                                  "digests (digest, or a relay) can reach it: use receive: background (the default)")
            if s.kind == "sglang" and (s.lora_receiver is not None) != (self.lora == "adapter"):
                raise ConfigError(f"servers[{i}].lora_receiver: " + (
                    "lora: adapter needs an asyncsync receiver on the SGLang server's host (asyncsync serve), which "
                    "writes each adapter version where SGLang loads it: give its URL" if s.lora_receiver is None else
                    "is only used with lora: adapter"))

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
    """Build the frozen dataclass ``cls`` from a mapping (parsed YAML) as ``ConfigReading`` reads it:
    unknown keys are refused, each key's type and limits are checked, sections (dataclasses, or
    tuples of them) are built recursively, and every error names its key path from the top
    (``prefix``), e.g. ``servers[1].kind: ...``. A plain dataclass's ``__post_init__`` runs as its
    rules, its errors prefixed alike."""
    return decode(cls, data, (prefix.rstrip("."),) if prefix else (), Setting.READING)
