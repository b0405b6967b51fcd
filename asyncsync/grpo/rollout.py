"""Grouped sampling on the inference servers: n completions per prompt, each tagged with its version."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from asyncsync.config import ServerConfig
from asyncsync.control import ControlLoop
from asyncsync.engines import make_engine
from asyncsync.engines.protocols import Generator


@dataclass(frozen=True)
class RolloutGroup:
    """The completions of one prompt, from one server, generated with weight version ``version``."""

    prompt: tuple[int, ...]
    completions: tuple[tuple[int, ...], ...]
    version: int
    server: str


class RolloutClient:
    """Spreads prompts over the servers round-robin and samples each prompt's group concurrently."""

    def __init__(self, servers: Sequence[ServerConfig], timeout_s: float):
        self._control = ControlLoop()
        self._engines: list[Generator] = [make_engine(s, timeout_s) for s in servers]

    def sample(self, prompts: Sequence[Sequence[int]], n: int, max_new_tokens: int, temperature: float, seed: int) -> list[RolloutGroup]:
        async def one(i: int, prompt: Sequence[int]) -> RolloutGroup:
            engine = self._engines[i % len(self._engines)]
            gen = await engine.generate(list(prompt), n, max_new_tokens, temperature, seed + i)
            return RolloutGroup(tuple(prompt), tuple(tuple(c) for c in gen.completions), gen.version, engine.url)

        async def all_groups() -> list[RolloutGroup]:
            return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))

        return self._control.run(all_groups())

    def close(self) -> None:
        async def close_all() -> None:
            await asyncio.gather(*(e.close() for e in self._engines))

        self._control.run(close_all(), timeout=10)
        self._control.close()
