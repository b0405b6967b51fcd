"""SGLang's weight-update messages, shared by the SGLang client and the reference server's SGLang API.

Everything here follows SGLang 0.5.23's own source (``SGLANG_RELEASE``; unchanged in 0.5.21-0.5.22
unless noted): the request structs of ``sglang/srt/managers/io_struct.py``, how SGLang's HTTP layer
validates them, ``FlattenedTensorBucket.empty`` (``sglang/srt/weight_sync/tensor_bucket.py``) and the
answers of the scheduler's weight updater (``sglang/srt/managers/scheduler_components/weight_updater.py``).

* Each message mirrors one struct field for field (names, types, defaults). ``from_json`` validates a
  body as SGLang's HTTP layer does (pydantic in lax mode: ``"2"`` is the integer 2, unknown keys are
  ignored, a body is required even when every field has a default); what it refuses is
  ``RequestInvalid``, which SGLang answers with HTTP 400 before the request reaches the scheduler.
* One ``/update_weights_from_distributed`` request carries one bucket. With
  ``load_format="flattened_bucket"`` its tensors travel as one uint8 broadcast laid out in request
  order with no padding, each offset a multiple of its item size: exactly an asyncsync bucket.
  ``UpdateWeightsFromDistributed.flattened_nbytes`` makes SGLang 0.5.23's checks of that layout, with
  its messages; SGLang runs them before it receives anything.
* ``consumed`` reads an answer's message: did SGLang take part in that request's broadcast before it
  refused? A refusal before the receive leaves the trainer's broadcast without this receiver.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Literal, TypeVar

import torch

from asyncsync.protocol.schema import Path, present, read_as
from asyncsync.protocol.wire import BucketMeta, GroupSpec, WireError, shown

SGLANG_RELEASE = "0.5.23"
DEFAULT_GROUP_NAME = "weight_update_group"
FLATTENED_BUCKET = "flattened_bucket"

# The scheduler's answers (``scheduler_components/weight_updater.py`` and the model runner's
# ``weight_updater.py``); several ranks' answers are joined with " | " (attention data parallelism).
NO_SESSION = ("update_weights_from_distributed must run between begin_weight_update() and end_weight_update()")
SESSION_OPEN = "a weight-update session is already open; call end_weight_update() first"
NO_SESSION_TO_END = "no weight-update session is open; call begin_weight_update() first"
RECEIVE_FAILED = "Failed to receive weights: "            # before or during the broadcast
LOAD_FAILED = "Failed to update parameter online: "       # after it: the model refused the tensors
FLUSH_REFUSED = "Weights were updated, but the cache was not flushed"  # after it (0.5.22+)
UPDATED = "Succeeded to update parameter online."
GROUP_CREATED = "Succeeded to initialize custom process group."
GROUP_DESTROYED = "Succeeded to destroy custom process group."
LORA_DISABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."  # tokenizer_control_mixin.py
NO_GROUP_TO_DESTROY = "The group to be destroyed does not exist."
ANSWERS_AFTER_RECEIVE = (LOAD_FAILED, FLUSH_REFUSED)


def consumed(message: str) -> bool:
    """Whether a refused ``/update_weights_from_distributed`` took part in its broadcast first.

    True only for the answers SGLang (0.5.21+) gives after the bucket arrived: the model's loader
    refused it, or the cache could not be flushed. Every other refusal (no session, an unknown
    group, a bucket layout ``FlattenedTensorBucket.empty`` rejects, a failed receive, a body that fails
    validation, and anything not recognised) may have left the broadcast without this receiver."""
    parts = [p.strip() for p in message.split(" | ")]
    return bool(parts) and all(p.startswith(ANSWERS_AFTER_RECEIVE) for p in parts)


def load_failure(reason: object) -> str:
    """SGLang's answer when the model refuses received tensors (``load_weights_from_distributed``)."""
    return (f"{LOAD_FAILED}{reason}. The full weights of the ModelRunner are partially updated. "
            "Please discard the whole weights.")


def group_missing(group_name: str, known: list[str]) -> str:
    """What SGLang's receive asserts when the request names a group it does not have."""
    return f"Group {group_name} not in {known}. Please call `init_weights_update_group` first."


# -- validation as SGLang's HTTP layer does it ----------------------------------------------------

MAX_LISTED_ERRORS = 10  # a message lists this many problems, then how many more there are


class _Quoted:
    """An input value in an error message: at most ``ECHO_CHARS`` of it (SGLang quotes it whole)."""

    def __init__(self, value: Any):
        self.value = value

    def __repr__(self) -> str:
        return shown(self.value)


class RequestInvalid(WireError):
    """A body SGLang's request schema refuses: answered 400 ``{"object": "error", ...}`` before the
    scheduler sees it. ``errors`` lists each problem as pydantic reports it; the message quotes each
    input short (``wire.shown``) and lists the first ``MAX_LISTED_ERRORS``."""

    def __init__(self, errors: list[dict[str, Any]]):
        n = len(errors)
        listed = [f"  {({**e, 'input': _Quoted(e['input'])} if 'input' in e else e)}" for e in errors[:MAX_LISTED_ERRORS]]
        if n > MAX_LISTED_ERRORS:
            listed.append(f"  ... and {n - MAX_LISTED_ERRORS} more")
        super().__init__(f"{n} validation error{'s' if n != 1 else ''}:\n" + "\n".join(listed))
        self.errors = errors


_TRUE = {"1", "on", "t", "true", "y", "yes"}
_FALSE = {"0", "off", "f", "false", "n", "no"}
R = TypeVar("R", bound="SglangRequest")


class PydanticLax:
    """How pydantic's lax mode reads a body for SGLang's request structs (``schema.read`` walks the
    types): ``"2"`` is the integer 2, ``"yes"`` is true, unknown keys are ignored; every problem is
    recorded in ``errors`` as pydantic reports it, and reading goes on."""

    def __init__(self, errors: list[dict[str, Any]]):
        self.errors = errors

    def bad(self, kind: str, msg: str, path: Path, value: Any) -> None:
        self.errors.append({"type": kind, "loc": path, "msg": msg, "input": value})

    def missing(self, path: Path, key: str, data: Any) -> None:
        self.bad("missing", "Field required", (*path, key), data)

    def literal(self, options: tuple[Any, ...], value: Any, path: Path, _why: str) -> Any:
        if value not in options:
            self.bad("literal_error", "Input should be " + " or ".join(", ".join(repr(a) for a in options).rsplit(", ", 1)),
                     path, value)
        return value

    def sequence(self, value: Any, path: Path) -> list[Any] | None:
        if isinstance(value, list):
            return value
        self.bad("list_type", "Input should be a valid list", path, value)
        return None

    def scalar(self, tp: Any, value: Any, path: Path) -> Any:
        if tp is str:
            if not isinstance(value, str):
                self.bad("string_type", "Input should be a valid string", path, value)
            return value
        if tp is bool:
            return self._bool(value, path)
        if tp is int:
            return self._int(value, path)
        raise TypeError(f"no lax validator for {tp!r}")  # a message type this module does not know

    def _bool(self, value: Any, path: Path) -> Any:
        if isinstance(value, bool):
            return value
        if isinstance(value, (int, float)) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        self.bad("bool_parsing", "Input should be a valid boolean", path, value)
        return value

    def _int(self, value: Any, path: Path) -> Any:
        if isinstance(value, int):
            return int(value)
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass
        self.bad("int_parsing", "Input should be a valid integer", path, value)
        return value


@dataclass(frozen=True)
class SglangRequest:
    """A request body of SGLang's HTTP API: fields, types and defaults are those of the struct named
    ``STRUCT`` in SGLang's ``io_struct.py``; ``from_json`` validates as SGLang does."""

    STRUCT: ClassVar[str] = ""

    @classmethod
    def from_json(cls: type[R], data: Any) -> R:
        """Validate a decoded JSON body; raise ``RequestInvalid`` where SGLang answers 400."""
        if data is None:
            raise RequestInvalid([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}])
        if not isinstance(data, dict):
            raise RequestInvalid([{"type": "dict_type", "loc": ("body",), "msg": "Input should be a valid dictionary",
                                   "input": data}])
        errors: list[dict[str, Any]] = []
        lax = PydanticLax(errors)
        values = {f.name: read_as(f.plan, value, ("body", f.key), lax) for f, value in present(cls, data, ("body",), lax)}
        if errors:
            raise RequestInvalid(errors)
        return cls(**values)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class InitWeightsUpdateGroup(SglangRequest):
    """``POST /init_weights_update_group``: the server's ranks join the trainer's group as ranks
    ``rank_offset`` + tp_rank. SGLang checks nothing more before the rendezvous."""

    STRUCT = "InitWeightsUpdateGroupReqInput"
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = DEFAULT_GROUP_NAME
    backend: str = "nccl"

    @classmethod
    def of(cls, spec: GroupSpec, rank_offset: int) -> InitWeightsUpdateGroup:
        return cls(spec.host, spec.port, rank_offset, spec.world_size, spec.group_name, spec.backend)

    def spec(self, timeout_s: float) -> GroupSpec:
        """The group to join; raises ``WireError`` for values no group can have."""
        if not 1 <= self.rank_offset < self.world_size:
            raise WireError(f"rank_offset must be in [1, world_size={self.world_size}), got {self.rank_offset}")
        return GroupSpec(self.master_address, self.master_port, self.world_size, self.group_name, self.backend, timeout_s)


@dataclass(frozen=True)
class DestroyWeightsUpdateGroup(SglangRequest):
    """``POST /destroy_weights_update_group``: drop one group (local to the server, not collective)."""

    STRUCT = "DestroyWeightsUpdateGroupReqInput"
    group_name: str = DEFAULT_GROUP_NAME


@dataclass(frozen=True)
class BeginWeightUpdate(SglangRequest):
    """``POST /begin_weight_update`` (SGLang 0.5.21+): open the session updates must run in."""

    STRUCT = "BeginWeightUpdateReqInput"
    selector: Literal["target", "draft", "all"] = "all"


@dataclass(frozen=True)
class EndWeightUpdate(SglangRequest):
    """``POST /end_weight_update`` (SGLang 0.5.21+): close the session; the body is ``{}``."""

    STRUCT = "EndWeightUpdateReqInput"


@dataclass(frozen=True)
class PauseGeneration(SglangRequest):
    """``POST /pause_generation``: ``retract`` puts running requests back in the queue."""

    STRUCT = "PauseGenerationReqInput"
    mode: Literal["abort", "retract", "in_place"] = "abort"


@dataclass(frozen=True)
class ContinueGeneration(SglangRequest):
    """``POST /continue_generation``: resume what ``/pause_generation`` stopped."""

    STRUCT = "ContinueGenerationReqInput"
    torch_empty_cache: bool = True


@dataclass(frozen=True)
class LoadLoraAdapter(SglangRequest):
    """``POST /load_lora_adapter``: load the PEFT directory ``lora_path`` (on the server's host) as
    adapter ``lora_name``; answered ``{"success", "error_message", "loaded_adapters"}``, 400 on failure."""

    STRUCT = "LoadLoRAAdapterReqInput"
    lora_name: str
    lora_path: str
    pinned: bool = False
    lora_id: str | None = None


@dataclass(frozen=True)
class UnloadLoraAdapter(SglangRequest):
    """``POST /unload_lora_adapter``: drop adapter ``lora_name`` (requests using it finish first)."""

    STRUCT = "UnloadLoRAAdapterReqInput"
    lora_name: str
    lora_id: str | None = None


@dataclass(frozen=True)
class UpdateWeightsFromDistributed(SglangRequest):
    """``POST /update_weights_from_distributed``: one bucket, broadcast by the trainer right after the
    request is posted. ``weight_version`` goes with a version's last bucket only (SGLang adopts it
    when that request succeeds), and so does ``flush_cache`` (drop the radix cache once per version).

    The layout may be anything the schema admits: SGLang judges it when it receives
    (``flattened_nbytes``), and so does the reference server."""

    STRUCT = "UpdateWeightsFromDistributedReqInput"
    names: tuple[str, ...]
    dtypes: tuple[str, ...]          # attribute names of torch: "bfloat16", never "torch.bfloat16"
    shapes: tuple[tuple[int, ...], ...]
    group_name: str = DEFAULT_GROUP_NAME
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None   # None: one broadcast per tensor; "flattened_bucket": one per bucket
    selector: Literal["target", "draft", "all"] = "all"
    torch_empty_cache: bool = False

    @classmethod
    def of(cls, bucket: BucketMeta, group_name: str, flush_cache: bool, weight_version: str | None) -> UpdateWeightsFromDistributed:
        """A bucket of asyncsync's, sent as one flattened broadcast."""
        return cls(bucket.names, bucket.dtypes, bucket.shapes, group_name, flush_cache, False, weight_version, FLATTENED_BUCKET)

    def flattened_nbytes(self) -> int:
        """Bytes of the flattened broadcast, with the checks and messages of SGLang 0.5.23's
        ``FlattenedTensorBucket.empty``: equal list lengths, dtypes that are torch attributes, no
        negative dimension, every offset a multiple of its item size, at least one tensor."""
        offset, count = 0, 0
        for name, dtype_name, shape in zip(self.names, self.dtypes, self.shapes, strict=True):
            dtype = getattr(torch, dtype_name)
            size = torch.Size(shape)
            if any(dim < 0 for dim in size):
                raise ValueError(f"Negative dimension in received tensor {name}: {size}")
            if offset % dtype.itemsize:
                raise ValueError(f"Unaligned received tensor {name}: byte offset {offset}, dtype {dtype}")
            offset += size.numel() * dtype.itemsize
            count += 1
        if not count:
            raise ValueError("Cannot create empty tensor bucket")
        return offset

    def bucket(self) -> BucketMeta:
        """The bucket as asyncsync reads it; raises ``WireError`` when asyncsync cannot represent it
        (a dtype outside its table). Call ``flattened_nbytes`` first: SGLang's checks come first."""
        data = {"names": list(self.names), "dtypes": list(self.dtypes), "shapes": [list(s) for s in self.shapes],
                "nbytes": self.flattened_nbytes()}
        return BucketMeta.from_json(data, "update_weights_from_distributed")
