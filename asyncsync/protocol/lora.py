"""LoRA adapters as versions (``lora: adapter``): what a receiver needs to take one, torch and stdlib only.

A trainer in adapter mode sends each version's adapter tensors (PEFT's ``lora_A`` / ``lora_B`` and
``modules_to_save``, under the names PEFT saves them by) over the same data plane as any version,
bucketed and checksummed; the receiver verifies them, writes them as a PEFT directory
(``adapter_config.json`` + ``adapter_model.safetensors``) in the server host's tmpfs, and the
trainer's control plane then loads that directory through the engine's own API under the versioned
name ``<name>-v<N>`` (a new name per version: vLLM's prefix cache is keyed by the adapter's name, so
reloading a name in place would reuse blocks computed with the previous weights).

Messages (each carried where the receiver takes a control message)::

    AdapterCheck    at connect: would the receiver serve this adapter (tensors, config) on its base?
    BaseCheck       at connect: does the receiver serve exactly these base tensors (CRC32C each)?
    AdapterUpdate   per version: an ``UpdateRequest`` of the adapter's buckets and where it goes
                    (``AdapterVersion``: name, the trainer's directory slot, the config, the
                    versions whose directories must stay)

The directory of version N is ``LORA_ROOT/<slot>/<name>-v<N>``, computed the same way on both sides:
``slot`` is chosen by the trainer per server (its session and the server), so two servers on one
host, or two trainers, never share a directory, and the trainer knows the path it asks the engine
to load without a shared filesystem or an answer carrying it (vLLM's update routes return nothing).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any

import torch

from asyncsync.protocol.checksum import crc32c_of
from asyncsync.protocol.schema import Between, Check, Codec, Each, Items, Key, Message, Path, at
from asyncsync.protocol.shm import SHM_DIR
from asyncsync.protocol.specs import TensorSpec
from asyncsync.protocol.wire import MAX_CHECKED_TENSORS, Spec, UpdateRequest, WireError, shown

LORA_ROOT = os.path.join(SHM_DIR, "asyncsync-lora")  # the server host's tmpfs
ADAPTER_REFUSED = "refused for lora: adapter"  # every receiver's refusal of an AdapterCheck or BaseCheck says this
CONFIG_FILE = "adapter_config.json"   # PEFT's file names (peft.utils.constants)
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."     # every tensor name PEFT saves from a PeftModel starts with it
MAX_CONFIG_CHARS = 64 * 1024
MAX_RANK = 1 << 16  # past any LoRA rank in use; bounds the shapes a check computes
_MODULE = re.compile(r"^[A-Za-z0-9_.-]{1,256}$")  # a rank_pattern key: a module name, never a regex operator
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")  # one path component, never "." or ".."
_VERSIONED = re.compile(r"^(?P<name>.+)-v(?P<version>\d+)$")


NAME_RULE = "expected 1-64 letters, digits, '.', '_' or '-' (starting with a letter or digit), got {got}"


def valid_name(value: Any) -> bool:
    """Safe as one path component and in a URL (letters, digits, ``._-``, at most 64, never ``.``/``..``)."""
    return isinstance(value, str) and _NAME.fullmatch(value) is not None


def check_name(value: Any, where: str) -> str:
    """``value`` when it is a ``valid_name``, else ``WireError`` naming ``where``."""
    if not valid_name(value):
        raise WireError(f"{where}: {NAME_RULE.replace('{got}', shown(value))}")
    return value


AdapterName = Annotated[str, Check(valid_name, NAME_RULE)]


def version_name(name: str, version: int) -> str:
    """The name an engine serves version ``version`` of adapter ``name`` under."""
    return f"{name}-v{version}"


def parse_version_name(served: str, name: str | None = None) -> int | None:
    """The version in ``served`` when it is ``<name>-v<N>`` (any name, for None), else None."""
    found = _VERSIONED.match(served)
    return int(found["version"]) if found and name in (None, found["name"]) else None


def adapter_dir(slot: str, name: str, version: int, root: str = LORA_ROOT) -> str:
    """Where the receiver writes version ``version`` and the trainer tells the engine to load it from."""
    return os.path.join(root, check_name(slot, "slot"), version_name(check_name(name, "name"), version))


def _config(value: Any, path: Path, _reading: Any) -> dict[str, Any]:
    """A PEFT LoRA ``adapter_config.json`` object: JSON, bounded, with a positive integer rank ``r``."""
    where = at(path)
    if not isinstance(value, dict):
        raise WireError(f"{where}: expected a JSON object (adapter_config.json), got {type(value).__name__}")
    try:
        chars = len(json.dumps(value))
    except (RecursionError, ValueError):
        raise WireError(f"{where}: nested too deep for adapter_config.json") from None
    if chars > MAX_CONFIG_CHARS:
        raise WireError(f"{where}: longer than {MAX_CONFIG_CHARS} characters")
    r = value.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or not 0 < r <= MAX_RANK:
        raise WireError(f"{where}.r: expected the adapter's rank, an integer in [1, {MAX_RANK}], got {shown(r)}")
    if value.get("peft_type", "LORA") != "LORA":
        raise WireError(f"{where}.peft_type: only LORA adapters are served, got {shown(value.get('peft_type'))}")
    _pattern(value.get("rank_pattern"), f"{where}.rank_pattern", int)
    _pattern(value.get("alpha_pattern"), f"{where}.alpha_pattern", (int, float))
    return value


def _pattern(value: Any, where: str, kind: type | tuple[type, ...]) -> None:
    """PEFT's ``rank_pattern``/``alpha_pattern``: module names (or dot-separated suffixes) to positive
    numbers. A key is matched as PEFT matches it, as a regular expression (``rank_of``): only names
    are taken (letters, digits, ``._-``), so a key can neither fail to compile nor backtrack without end."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise WireError(f"{where}: expected an object of module name -> number, got {type(value).__name__}")
    for key, number in value.items():
        if not _MODULE.fullmatch(key):
            raise WireError(f"{where}: expected module names (letters, digits, '.', '_', '-'; at most 256), "
                            f"got {shown(key)}")
        if not isinstance(number, kind) or isinstance(number, bool) or not 0 < number <= MAX_RANK:
            raise WireError(f"{where}[{shown(key)}]: expected a number in (0, {MAX_RANK}], got {shown(number)}")


AdapterConfig = Annotated[dict[str, Any], Codec(_config, dict)]


@dataclass(frozen=True)
class AdapterVersion(Message):
    """Where a version of adapter ``name`` goes on one server: the directory slot the trainer chose
    for it, the ``adapter_config.json`` to write beside the tensors, and ``keep``: the versions whose
    directories must stay (the engine may still load them, or re-read them from disk after evicting
    them from its cache); the receiver removes the slot's other versions."""

    WHERE = "adapter"
    name: AdapterName
    slot: AdapterName
    config: AdapterConfig = field(hash=False)
    keep: Annotated[tuple[int, ...], Each(Between(0, None, "expected versions >= 0, got {got}"))] = ()

    def path(self, version: int, root: str = LORA_ROOT) -> str:
        return adapter_dir(self.slot, self.name, version, root)


@dataclass(frozen=True)
class AdapterUpdate(Message):
    """One version of an adapter: its buckets (``update``, received and verified like any version,
    against the tensors ``adapter_problems`` accepts) and where it goes (``adapter``). Carried where
    an ``UpdateRequest`` would be (vLLM's ``update_info``), known by its ``adapter``."""

    update: UpdateRequest
    adapter: AdapterVersion


@dataclass(frozen=True)
class AdapterCheck(Message):
    """Asked at ``connect``: would the receiver serve adapter ``name`` (its tensors ``specs`` and
    ``config``) on the base it serves, with ``loaded`` versions of it loaded at once (the staleness
    bound's versions plus the one being loaded)? The answer is None, or why not and what to change."""

    WHERE = ENVELOPE = "adapter_check"
    name: AdapterName
    config: AdapterConfig = field(hash=False)
    specs: Annotated[tuple[Spec, ...], Items(0, MAX_CHECKED_TENSORS)] = ()
    loaded: Annotated[int, Between(1, None, "expected a positive integer, got {got}")] = 1

    @property
    def rank(self) -> int:
        """The largest rank of any module (``r`` and PEFT's per-module ``rank_pattern``)."""
        pattern = self.config.get("rank_pattern") or {}
        return max([int(self.config["r"]), *(int(v) for v in pattern.values() if isinstance(v, int))])

    @classmethod
    def from_json(cls, data: Any, where: str | None = None) -> AdapterCheck:
        """An arriving check names at least one tensor (one built here may name none: a trainer asks an
        engine that takes no adapter at all before it plans one)."""
        check = super().from_json(data, where)
        if not check.specs:
            raise WireError("adapter_check.specs: expected a non-empty list of [name, dtype, [sizes...]]")
        return check


@dataclass(frozen=True)
class BaseCheck(Message):
    """Asked at ``connect``: does the receiver serve exactly these base tensors (name, CRC32C of
    its bytes, in the checkpoint layout)? If not, the trainer sends the base once, as a version."""

    crcs: Annotated[tuple[tuple[str, Annotated[int, Between(0, 2**32 - 1)]], ...], Key("base_check")]

    def mismatch(self, served: Mapping[str, torch.Tensor]) -> str | None:
        """None when ``served`` holds exactly these tensors with these bytes; else the first difference."""
        names = {n for n, _ in self.crcs}
        if names != set(served):
            extra, missing = sorted(set(served) - names), sorted(names - set(served))
            return f"other tensors: {len(missing)} not served (e.g. {missing[:2]}), {len(extra)} not in the base (e.g. {extra[:2]})"
        for name, crc in self.crcs:
            if tensor_crc(served[name]) != crc:
                return f"tensor '{name}' differs"
        return None


def tensor_crc(t: torch.Tensor) -> int:
    """CRC32C of a tensor's bytes in C order (the same on the trainer and on any receiver)."""
    return crc32c_of(t.detach().contiguous().reshape(-1).view(torch.uint8))


def adapter_targets(specs: Iterable[TensorSpec]) -> set[str]:
    """The last name of every module the LoRA tensors ``specs`` adapt (``q_proj``, ...): what engines
    list as LoRA target modules."""
    return {s.name[len(PEFT_PREFIX):].rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] for s in specs if ".lora_" in s.name}


def rank_of(module: str, config: Mapping[str, Any]) -> int:
    """The rank PEFT gives ``module`` (its name without ``base_model.model.``): the first key of
    ``rank_pattern`` that is a dot-bounded suffix of it, else ``r`` (PEFT's ``get_pattern_key``)."""
    for key, rank in (config.get("rank_pattern") or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return int(rank)
    return int(config["r"])


def adapter_problems(base: Mapping[str, TensorSpec], specs: Iterable[TensorSpec], config: Mapping[str, Any]) -> list[str]:
    """Why adapter tensors ``specs`` (PEFT's saved names) cannot be served on a base whose checkpoint
    tensors are ``base``: each LoRA pair must target a linear weight of the base, ``lora_A`` being
    ``[r, in]`` and ``lora_B`` ``[out, r]`` for that weight's ``[out, in]`` at the module's rank,
    and a ``modules_to_save`` tensor must have its base tensor's dtype and shape. Empty: servable."""
    problems: list[str] = []
    pairs: dict[str, set[str]] = {}
    for spec in specs:
        if not spec.name.startswith(PEFT_PREFIX):
            problems.append(f"'{spec.name}' is not a PEFT adapter tensor (no {PEFT_PREFIX!r} prefix)")
            continue
        rest = spec.name[len(PEFT_PREFIX):]
        lora = re.match(r"^(?P<module>.+)\.lora_(?P<side>[AB])\.weight$", rest)
        if lora is None:  # a modules_to_save copy of a base tensor
            want = base.get(rest)
            if want is None:
                problems.append(f"'{spec.name}' is neither a LoRA A/B weight nor a copy of a base tensor")
            elif (want.dtype, want.shape) != (spec.dtype, spec.shape):
                problems.append(f"'{spec.name}' is {spec.dtype} {spec.shape}; the base's '{rest}' is {want.dtype} {want.shape}")
            continue
        module, side = lora["module"], lora["side"]
        pairs.setdefault(module, set()).add(side)
        weight = base.get(f"{module}.weight")
        if weight is None or len(weight.shape) != 2:
            problems.append(f"'{spec.name}': the base has no linear weight '{module}.weight' to adapt")
            continue
        out, inp = weight.shape
        r = rank_of(module, config)
        want_shape = (r, inp) if side == "A" else (out, r)
        if spec.shape != want_shape:
            problems.append(f"'{spec.name}' is {spec.shape}; rank {r} on '{module}.weight' {weight.shape} needs {want_shape}")
        if not spec.dtype.is_floating_point:
            problems.append(f"'{spec.name}' is {spec.dtype}, not a floating-point tensor")
    problems += [f"'{PEFT_PREFIX}{m}': lora_{'B' if s == {'A'} else 'A'} is missing" for m, s in pairs.items() if len(s) != 2]
    return problems
