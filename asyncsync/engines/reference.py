"""Client of asyncsync's own reference server (``asyncsync serve``)."""

from __future__ import annotations

from asyncsync.protocol.wire import GroupSpec
from asyncsync.engines.base import EngineClient, Generation
from asyncsync.protocol.wire import InitGroupRequest, UpdateRequest, VersionRequest


class ReferenceEngine(EngineClient):
    """The reference server swaps whole versions in and pauses nothing: there is nothing to abort."""

    kind = "reference"

    async def world_size(self) -> int:
        return int((await self.http.get("/world_size"))["world_size"])

    async def init_group(self, spec: GroupSpec, rank_offset: int) -> None:
        await self.http.post("/init_group", InitGroupRequest(spec, rank_offset).to_json())

    async def expected_names(self) -> frozenset[str]:
        return frozenset((await self.http.get("/weights/names"))["names"])

    async def begin(self, version: int) -> None:
        await self.http.post("/begin", VersionRequest(version).to_json())

    async def update(self, request: UpdateRequest) -> None:
        await self.http.post("/update", request.to_json())

    async def end(self, version: int) -> int:
        return int((await self.http.post("/end", VersionRequest(version).to_json()))["version"])

    async def version(self) -> int:
        return int((await self.http.get("/version"))["version"])

    async def generate(self, prompt: list[int], n: int, max_new_tokens: int, temperature: float, seed: int) -> Generation:
        body = {"prompt": prompt, "n": n, "max_new_tokens": max_new_tokens, "temperature": temperature, "seed": seed}
        out = await self.http.post("/generate", body)
        return Generation(out["completions"], int(out["weight_version"]))
