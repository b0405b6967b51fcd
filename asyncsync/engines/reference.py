"""Client of asyncsync's own reference server (``asyncsync serve``)."""

from __future__ import annotations

import logging

from asyncsync.engines.base import EngineClient, Generation, Scored, UnsupportedServer
from asyncsync.protocol.lora import AdapterCheck, AdapterUpdate, BaseCheck
from asyncsync.protocol.shm import HostIdentity
from asyncsync.protocol.wire import (
    PROTOCOL_VERSION, ClaimRequest, EndRequest, GroupSpec, InitGroupRequest, LayoutCheck, UpdateRequest,
)
from asyncsync.control import ServerError

log = logging.getLogger(__name__)


class ReferenceEngine(EngineClient):
    """The reference server swaps whole versions in and pauses nothing: there is nothing to abort."""

    kind = "reference"

    async def world_size(self) -> int:
        """The server's data-plane ranks; ``UnsupportedServer`` when it speaks another data-plane
        protocol (``PROTOCOL_VERSION``; an older server sends none): its receives would not match
        this trainer's broadcasts, so it is never put in a group."""
        out = await self.http.get("/world_size")
        protocol = out.get("protocol", 1)
        if protocol != PROTOCOL_VERSION:
            raise UnsupportedServer(self.url, f"speaks asyncsync data-plane protocol {protocol}, this trainer "
                                              f"{PROTOCOL_VERSION}: run the same asyncsync release on the trainer and "
                                              "its servers")
        return int(out["world_size"])

    async def claim(self, takeover: bool) -> None:
        assert self.session is not None, "a client that claims a server speaks for a trainer session"
        try:
            await self.http.post("/claim", ClaimRequest(self.session, takeover).to_json())
        except ServerError as e:
            if e.status != 404:
                raise
            log.info("%s has no /claim (an older server): it is synced without owner protection", self.url)

    async def release(self) -> None:
        await self.best_effort(self.http.post("/release"), "release the server")

    async def host_identity(self) -> HostIdentity | None:
        try:
            return HostIdentity.from_json((await self.http.get("/host"))["host"])
        except ServerError as e:
            if e.status != 404:
                raise
            return None  # an older server: the data plane

    async def init_group(self, specs: tuple[GroupSpec, ...], rank_offset: int, relay: tuple[GroupSpec, ...] = ()) -> None:
        await self.http.post("/init_group", InitGroupRequest(specs[0], rank_offset, specs[1:], relay=relay).to_json())

    async def expected_names(self) -> frozenset[str]:
        return frozenset((await self.http.get("/weights/names"))["names"])

    async def check_layout(self, check: LayoutCheck) -> str | None:
        try:
            return await self._refusal("/check_layout", check.to_json())
        except ServerError as e:
            if e.status != 404:
                raise
            return await super().check_layout(check)  # an older server: it refuses a mismatched version when it arrives

    async def begin(self, version: int) -> None:
        """Nothing to prepare: the server judges a version in ``/update`` and swaps it in at ``/end``
        (its ``/begin`` route only validates), so no round trip delays the first bucket's receive."""

    async def update(self, request: UpdateRequest) -> None:
        await self.http.post("/update", request.to_json())

    async def end(self, version: int, digests: tuple[str, ...] = ()) -> int:
        out = await self.http.post("/end", EndRequest(version, digests).to_json())
        self.holds = frozenset(out.get("holds", ()))
        switch = out.get("switch_s")
        self.last_switch_s = float(switch) if isinstance(switch, (int, float)) else None  # older servers: None
        return int(out["version"])

    def staging_bytes(self, version_bytes: int, ranks: int) -> int:
        """One set of buffers beside the one the live weights are (the swap-in is zero-copy)."""
        return version_bytes

    async def version(self) -> int:
        return int((await self.http.get("/version"))["version"])

    async def generate(self, prompt: list[int], n: int, max_new_tokens: int, temperature: float, seed: int,
                       adapter: str | None = None) -> Generation:
        body = {"prompt": prompt, "n": n, "max_new_tokens": max_new_tokens, "temperature": temperature, "seed": seed,
                "adapter": adapter}
        out = await self.http.post("/generate", body)
        return Generation(out["completions"], int(out["weight_version"]))

    async def score(self, tokens: list[int]) -> Scored:
        """``POST /score``: the served model's log-probabilities, under the lock one version serves by."""
        out = await self.http.post("/score", {"tokens": tokens})
        return Scored(tuple(float(x) for x in out["logprobs"]), int(out["weight_version"]))

    # -- lora: adapter (receivers/reference/adapters.py) --------------------------------------------

    async def check_adapter(self, check: AdapterCheck) -> str | None:
        return await self._refusal("/check_adapter", check.to_json())

    async def serves_base(self, check: BaseCheck) -> bool:
        return await self._refusal("/check_base", check.to_json()) is None

    async def _refusal(self, path: str, body: dict[str, object]) -> str | None:
        """None when the server accepts ``body`` at ``path``, its reason when it refuses (409)."""
        try:
            await self.http.post(path, body)
        except ServerError as e:
            if e.status != 409:
                raise
            return str(e.detail)
        return None

    async def update_adapter(self, update: AdapterUpdate) -> None:
        await self.http.post("/update_adapter", update.to_json())

    async def end_adapter(self, version: int, digests: tuple[str, ...] = ()) -> None:
        await self.http.post("/end_adapter", EndRequest(version, digests).to_json())


