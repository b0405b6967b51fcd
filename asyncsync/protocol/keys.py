"""The data plane's keys: who may take part in a group, proven without ever sending the key.

The trainer draws a key per data-plane group and relay edge, every epoch (``new_key``), and hands
it to each member in the token-checked ``/init_group`` (``GroupSpec.key``): only a holder of the
server's bearer token learns it, and a server learns only the keys of the groups it is a member of.
What a key guards (docs/faults.md, "The trust boundary"):

* the rendezvous (``SealedStore``): every value a member writes into the trainer's store (a gloo
  or NCCL address, a relay edge's listening address) carries a MAC over its key and value, and a
  value without a valid one is never read: a foreign client of the store, which can list, overwrite
  and delete any key there, cannot make a member connect to it;
* membership (``Proof``): right after a group forms, every rank proves the key over a fresh nonce
  (``protocol.group``), and the two ends of a relay edge prove it to each other before the first
  byte of a version (``protocol.stream``): a peer that took a member's place is found before any
  version byte flows;
* every frame header (``protocol.frames.FrameSeal``): a header without the group's MAC is refused.

``credential`` is what asyncsync's vLLM backend takes instead of the bearer token vLLM's own route
guard never checks on the weight-transfer routes. Imports torch's store and the standard library only.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import time
from datetime import timedelta
from typing import Any

from torch.distributed import Store

log = logging.getLogger(__name__)

KEY_BYTES = 32
KEY_HEX = 2 * KEY_BYTES
MAC_BYTES = 32
_READ_AGAIN_S = 0.05  # how often a reader looks again for a sealed value after it found a forged one


def new_key() -> str:
    """A fresh data-plane key, as it travels (hex)."""
    return secrets.token_hex(KEY_BYTES)


def is_key(value: Any) -> bool:
    """A data-plane key as ``GroupSpec.key`` carries it: ``KEY_HEX`` lowercase hex digits."""
    return isinstance(value, str) and len(value) == KEY_HEX and all(c in "0123456789abcdef" for c in value)


def mac(key: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 of ``parts``, each length-prefixed so that no two sequences of parts collide."""
    h = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


class Proof:
    """A member's proof that it holds ``key`` for ``binding`` (a group's or an edge's name): the MAC of
    a role and a fresh nonce, which a recording of an older proof cannot answer."""

    def __init__(self, key: bytes, binding: bytes):
        self.key, self.binding = key, binding

    def of(self, role: bytes, nonce: bytes) -> bytes:
        return mac(self.key, b"asyncsync proof", self.binding, role, nonce)

    def holds(self, role: bytes, nonce: bytes, proof: bytes) -> bool:
        return hmac.compare_digest(self.of(role, nonce), bytes(proof))


class Forged(RuntimeError):
    """A store value did not carry its key's MAC by the reader's deadline."""


class SealedStore(Store):
    """A store whose values carry a MAC over the key and value, under the group's data-plane key: what
    gloo, NCCL and the relay edges rendezvous through on asyncsync's keyed groups.

    ``set`` appends the MAC; ``get`` returns a value only once its MAC holds: a forged value (a foreign
    client wrote it, before the member's own or over it) is read again every ``_READ_AGAIN_S`` until a
    sealed one is there, and past ``timeout_s`` raises ``Forged`` naming the key. So a foreign client
    can delay a rendezvous, or deny it by overwriting again and again, but never redirect a member.
    Counters (``add``) and the rest pass through unsealed: no address is ever read from them.

    The Python object must outlive every process group built on it (the C++ side calls back into it):
    ``protocol.group.DataPlaneGroup`` keeps it."""

    def __init__(self, inner: Store, key: bytes, timeout_s: float):
        super().__init__()
        self.inner, self.key, self.timeout_s = inner, key, timeout_s

    def _seal(self, key: str, value: bytes) -> bytes:
        return mac(self.key, b"asyncsync store", key.encode(), value)

    def set(self, key: str, value: Any) -> None:
        value = value.encode() if isinstance(value, str) else bytes(value)
        self.inner.set(key, value + self._seal(key, value))

    def opened(self, key: str, raw: bytes) -> bytes | None:
        """The value in ``raw``, or None when its MAC does not hold."""
        value, seal = raw[:-MAC_BYTES], raw[-MAC_BYTES:]
        return value if len(raw) >= MAC_BYTES and hmac.compare_digest(seal, self._seal(key, value)) else None

    def get(self, key: str) -> bytes:
        give_up = time.monotonic() + self.timeout_s
        warned = False
        while True:
            value = self.opened(key, bytes(self.inner.get(key)))
            if value is not None:
                return value
            if not warned:
                log.warning("the rendezvous store holds a value of %s that no key holder wrote: a foreign client of "
                            "the trainer's store wrote it; waiting for the member's own", key)
                warned = True
            if time.monotonic() > give_up:
                raise Forged(f"the rendezvous store held only forged values of '{key}' for {self.timeout_s:g}s: a "
                             "foreign client of the trainer's store keeps overwriting it (bind master_addr to an "
                             "address only the servers reach)")
            time.sleep(_READ_AGAIN_S)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self.inner.compare_set(key, expected, desired)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        for k, v in zip(keys, values):
            self.set(k, v)


CREDENTIAL_FIELD = "asyncsync_credential"  # where a weight-transfer payload to vLLM carries it
TOKEN_VARIABLES = ("ASYNCSYNC_TOKEN", "VLLM_API_KEY")  # where a server's token is read from, first first


def credential(token: str) -> str:
    """What the trainer's client puts in every weight-transfer payload to a vLLM server started with
    ``token``, and what the server's backend compares: derived from the token (the token itself
    never appears in a body vLLM might log)."""
    return mac(token.encode(), b"asyncsync vllm weight transfer").hex()


class Unauthorized(PermissionError):
    """A call carried no credential, or another server's."""


class PayloadGuard:
    """The check a receiver makes where no route guard checks the bearer token: asyncsync's vLLM
    backend, whose routes (``/init_weight_transfer_engine``, ``/update_weights``) vLLM's
    ``--api-key`` does not cover (it guards ``/v1/*`` only). Every payload must carry
    ``credential(token)`` under ``CREDENTIAL_FIELD``; without a token (none in the environment)
    nothing is checked, as vLLM without ``--api-key`` checks nothing."""

    def __init__(self, token: str | None):
        self.expected = credential(token) if token else None

    @classmethod
    def from_environment(cls, environ: Any) -> PayloadGuard:
        """The token the server was started with: ``ASYNCSYNC_TOKEN``, else ``VLLM_API_KEY`` (which
        vLLM's own guard of ``/v1/*`` reads too)."""
        return cls(next((environ[v] for v in TOKEN_VARIABLES if environ.get(v)), None))

    @property
    def guarding(self) -> bool:
        return self.expected is not None

    def check(self, payload: Any, route: str) -> None:
        """``Unauthorized`` unless ``payload`` carries this server's credential."""
        if self.expected is None:
            return
        given = payload.get(CREDENTIAL_FIELD) if isinstance(payload, dict) else None
        if not isinstance(given, str) or not hmac.compare_digest(given.encode(), self.expected.encode()):
            raise Unauthorized(f"weight-transfer call refused: {route} carried {'a wrong' if given else 'no'} "
                               "asyncsync credential; the trainer's servers[].token must be the token this server "
                               f"was started with ({' or '.join(TOKEN_VARIABLES)})")
