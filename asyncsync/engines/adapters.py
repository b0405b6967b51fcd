"""What an engine client does for ``lora: adapter`` unless its kind says otherwise: refuse adapters,
and load, unload and list them through the routes vLLM, SGLang and the reference server share
(``POST /v1/load_lora_adapter {lora_name, lora_path}``, ``/v1/unload_lora_adapter {lora_name}``;
``GET /v1/models`` lists every adapter loaded by name). ``EngineClient`` inherits these defaults;
the trainer sees them as ``protocols.AdapterReceiver`` and ``protocols.AdapterHost``."""

from __future__ import annotations

from typing import Any

from asyncsync.control import HttpClient, ServerError
from asyncsync.protocol.lora import AdapterCheck, AdapterUpdate, BaseCheck, parse_version_name


class AdapterDefaults:
    """The adapter calls of a kind that cannot receive adapters, over the shared load/list routes."""

    kind: str
    http: HttpClient

    async def check_adapter(self, check: AdapterCheck) -> str | None:
        """At ``connect``: None when the server can serve ``check``'s adapter on its base, with
        ``check.loaded`` versions loaded at once; else why not and what to change (the flag to set).
        Engines without adapter support keep this default refusal."""
        return f"a {self.kind} server cannot load LoRA adapters at run time: use lora: merged"

    async def serves_base(self, check: BaseCheck) -> bool | None:
        """At ``connect``: whether the server serves exactly ``check``'s base tensors (False: it is
        sent the base once); None where it cannot tell and cannot be sent one either (it is assumed to)."""
        return None

    async def begin_adapter(self, version: int) -> None:
        """Prepare to receive adapter version ``version`` (nothing to pause: no weights change)."""

    async def update_adapter(self, update: AdapterUpdate) -> None:
        """Like ``update``, for an adapter version: answered after the receiver verified it (or at
        once: ``receives_in_background``)."""
        raise ServerError(self.http.base_url, "this server cannot receive adapter versions", status=400)

    async def end_adapter(self, version: int, digests: tuple[str, ...] = ()) -> None:
        """The receiver writes the verified adapter's PEFT directory (``update.adapter.path``), where
        its buckets hashed to the trainer's ``digests`` (a version announced with them)."""
        raise ServerError(self.http.base_url, "this server cannot receive adapter versions", status=400)

    async def load_adapter(self, name: str, path: str, timeout_s: float) -> None:
        """Load the PEFT directory ``path`` into the engine as ``name``, through the engine's own API."""
        await self.http.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path}, timeout_s)

    async def unload_adapter(self, name: str) -> None:
        await self.http.post("/v1/unload_lora_adapter", {"lora_name": name})

    async def adapter_versions(self, name: str) -> list[int]:
        """The versions of adapter ``name`` the engine serves (as ``<name>-v<N>``)."""
        return served_versions(await self.http.get("/v1/models"), name)


def served_versions(models: Any, name: str) -> list[int]:
    """The versions of adapter ``name`` in an OpenAI-style model list (``GET /v1/models``: vLLM,
    SGLang and the reference server list every loaded adapter by its name)."""
    data = models.get("data", []) if isinstance(models, dict) else []
    found = (parse_version_name(str(m.get("id", "")), name) for m in data if isinstance(m, dict))
    return sorted(v for v in found if v is not None)
