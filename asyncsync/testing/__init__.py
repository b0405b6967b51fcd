"""For tests and benchmarks: models that mix what real checkpoints mix in, so the data plane is
exercised on all of it; reference servers in child processes; a rogue trainer, a rogue relay. The route fuzzer
(``fuzz``, its requests ``probes``, the values that break them ``mutations``) is here too: a test
imports what it shares with a benchmark from this package, never from ``benchmarks``."""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from asyncsync.engines.base import ASYNCSYNC_PROTOCOL
from asyncsync.launch.http import http_call
from asyncsync.models import ModelConfig, build_model
from asyncsync.protocol.device import HostRuntime
from asyncsync.protocol.frames import FrameHeader
from asyncsync.protocol.group import DataPlaneError, DataPlaneGroup, free_port, serve_store
from asyncsync.protocol.keys import CREDENTIAL_FIELD, credential, new_key
from asyncsync.protocol.specs import BucketPlan
from asyncsync.protocol.stream import StreamEdge
from asyncsync.protocol.wire import BucketMeta, CommitRequest, GroupSpec, InitGroupRequest, UpdateRequest
from asyncsync.receivers.reference.app import Faults
from asyncsync.launch.reference import ServerProcess, running
from asyncsync.transport.topology import TrainerGroups

__all__ = ["Faults", "RogueRelay", "RogueTrainer", "ServerProcess", "http_call", "mixed_dtype_model", "running",
           "version_of"]


def mixed_dtype_model(cfg: ModelConfig) -> torch.nn.Module:
    """``build_model`` plus what real checkpoints mix in: a bf16 embedding and final norm, an int64
    buffer and a 0-dim fp32 buffer (greedy decoding still works: Qwen2's RMSNorm upcasts)."""
    model = build_model(cfg)
    model.model.embed_tokens.to(torch.bfloat16)
    model.model.norm.to(torch.bfloat16)
    model.register_buffer("token_counts", torch.zeros(cfg.vocab_size, dtype=torch.int64))
    model.register_buffer("temperature_scale", torch.tensor(1.0))
    return model


def version_of(named: Mapping[str, torch.Tensor], names: set[str], version: int, bucket_bytes: int = 16 * 1024,
               deadline_s: float = 5.0, checksum: bool = False) -> tuple[UpdateRequest, list[torch.Tensor]]:
    """A valid version of the tensors of ``named`` a server expects (``names``): the request and each
    bucket's bytes."""
    plan = BucketPlan.from_tensors([(n, t) for n, t in named.items() if n in names], bucket_bytes)
    flat = [torch.cat([named[s.name].detach().reshape(-1).view(torch.uint8) for s in b.specs]) for b in plan.buckets]
    return UpdateRequest(version, tuple(BucketMeta.of(b) for b in plan.buckets), checksum,
                         (deadline_s,) * len(flat)), flat


class RogueRelay:
    """The upper end of a relay edge (rank 0 of a ``stream``, ``protocol.stream``) above a chain of
    reference servers, the first relaying to the second and so on, in the test's own rendezvous
    store: a server above them that lies, sending whatever a test tells it to as raw bytes.

        rogue = RogueRelay(urls)                        # the chain joined its edges (POST /init_group)
        request, buckets = version_of(named, names, 7)
        answers = rogue.send(request, [tensor, ...])    # each server's answer to /update meanwhile
        rogue.close()
    """

    def __init__(self, urls: Sequence[str], timeout_s: float = 10.0):
        self.urls, self.runtime = list(urls), HostRuntime()
        self.store = serve_store("127.0.0.1", 0, timeout_s)
        edges = [GroupSpec("127.0.0.1", self.store.port, 2, f"rogue.{secrets.token_hex(6)}", "stream", timeout_s,
                           key=new_key()) for _ in self.urls]
        with ThreadPoolExecutor(len(self.urls)) as pool:
            joins = [pool.submit(http_call, url, "POST", "/init_group", InitGroupRequest(edge, 1, relay=tuple(
                edges[i + 1:i + 2])).to_json()) for i, (url, edge) in enumerate(zip(self.urls, edges))]
            self.edge = StreamEdge.join(edges[0], 0, self.runtime)
            answers = [j.result(timeout_s + 30) for j in joins]
        if any(status != 200 for status, _ in answers):
            self.close()
            raise RuntimeError(f"the chain did not join the rogue relay's edges: {answers}")

    def send(self, request: UpdateRequest, sends: Sequence[torch.Tensor], then_close: bool = False,
             timeout_s: float = 5.0) -> dict[str, tuple[int, Any]]:
        """Post ``request`` to every server and send ``sends`` down the edge meanwhile (``then_close``:
        end the stream after them, else leave it open and silent): each server's answer."""
        with ThreadPoolExecutor(len(self.urls)) as pool:
            answers = {url: pool.submit(http_call, url, "POST", "/update", request.to_json()) for url in self.urls}
            try:
                for tensor in sends:
                    self.edge.wait(self.edge.broadcast_async(tensor, timeout_s))
            except DataPlaneError:
                pass  # the server below left the edge: what a refusal does
            if then_close:
                self.edge.close()
            return {url: answer.result(120) for url, answer in answers.items()}

    def close(self) -> None:
        self.edge.close()
        self.store = None


class RogueTrainer:
    """Rank 0 of a data-plane group with one server running asyncsync's receiver (a reference server,
    or with ``vllm`` a vLLM server with asyncsync's backend, through vLLM's own routes), sending
    whatever a test tells it to: the trainer that lies (a bucket longer than announced, frames of
    another plan) or goes silent. On vLLM with a ``token`` its payloads carry the trainer's
    credential (``protocol.keys.credential``), as the trainer's own client's do.

        rogue = RogueTrainer(url)                       # the server joined the group (POST /init_group)
        request, buckets = rogue.version(named, 7)      # a valid version of ``named`` for this server
        status, body, failed, took = rogue.send(request, [(header, payload), ...])
        rogue.close()
    """

    def __init__(self, url: str, token: str | None = None, session: str | None = None, timeout_s: float = 10.0,
                 vllm: bool = False):
        self.url, self.token, self.session, self.vllm = url, token, session, vllm
        self.credential = {CREDENTIAL_FIELD: credential(token)} if vllm and token else {}
        self.spec = GroupSpec("127.0.0.1", free_port(), 2, f"rogue{free_port()}", "gloo", timeout_s, key=new_key())
        with ThreadPoolExecutor(1) as pool:
            joined = pool.submit(self.init_group, InitGroupRequest(self.spec, 1).to_json())
            group = DataPlaneGroup.join(self.spec, 0, HostRuntime())
            status, body = joined.result(timeout_s + 30)
        if status != 200:
            group.close(broken=True)
            raise RuntimeError(f"{url} did not join the rogue trainer's group: {status} {body}")
        self.groups = TrainerGroups([(ASYNCSYNC_PROTOCOL, group)], HostRuntime())

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        return http_call(self.url, method, path, body, self.token, self.session)

    def init_group(self, body: Any) -> tuple[int, Any]:
        """Post an ``InitGroupRequest`` body (anything) as the server's route takes it."""
        if self.vllm:
            return self.call("POST", "/init_weight_transfer_engine", {"init_info": self._credited(body)})
        return self.call("POST", "/init_group", body)

    def _credited(self, body: Any) -> Any:
        return {**body, **self.credential} if isinstance(body, dict) else body

    def update(self, body: Any, commit: int | None = None) -> tuple[int, Any]:
        """Post an ``UpdateRequest`` body (anything) as the server's route takes it; on vLLM inside an
        update session (start, update, [the commit of version ``commit``], finish: a refused update
        leaves nothing open)."""
        if not self.vllm:
            return self.call("POST", "/update", body)
        self.call("POST", "/start_weight_update", {})
        try:
            answer = self.call("POST", "/update_weights", {"update_info": self._credited(body)})
            if commit is not None and answer[0] == 200:
                answer = self.call("POST", "/update_weights", {"update_info": self._credited(
                    CommitRequest(commit).to_json())})
            return answer
        finally:
            self.call("POST", "/finish_weight_update", {})

    def version(self, named: Mapping[str, torch.Tensor], version: int, bucket_bytes: int = 16 * 1024,
                deadline_s: float = 5.0, checksum: bool = False) -> tuple[UpdateRequest, list[torch.Tensor]]:
        """A valid version of ``named`` (on a reference server, of the tensors it expects by its
        ``/weights/names``; on vLLM, ``named`` as it is): the request and each bucket's bytes."""
        names = set(named) if self.vllm else set(self.call("GET", "/weights/names")[1]["names"])
        return version_of(named, names, version, bucket_bytes, deadline_s, checksum)

    def send(self, request: UpdateRequest, payloads: Sequence[tuple[FrameHeader, torch.Tensor]],
             timeout_s: float = 5.0, commit: int | None = None) -> tuple[int, Any, str | None, float]:
        """Post ``request`` (``commit``: as ``update``) and broadcast ``payloads`` (each after the given
        header) meanwhile: the server's answer, what the rogue's own broadcasts said (None: all sent),
        and the answer's delay."""
        start = time.monotonic()
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(self.update, request.to_json(), commit)
            failed = None
            try:
                for header, payload in payloads:
                    self.groups.wait(self.groups.broadcast_async(payload, timeout_s, header))
            except DataPlaneError as e:
                failed = str(e)
            status, body = answer.result(120)
        return status, body, failed, time.monotonic() - start

    def close(self) -> None:
        self.groups.close(broken=True)
