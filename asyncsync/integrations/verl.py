"""asyncsync as a verl 0.9.1 checkpoint engine (backend ``asyncsync``), and a manager that keeps what
verl's stock manager takes away. Config (docs/verl.md)::

    actor_rollout_ref.rollout.checkpoint_engine.backend=asyncsync
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=asyncsync.integrations.verl
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.asyncsync.model=${actor_rollout_ref.model.path}
    +actor_rollout_ref.rollout.checkpoint_manager_class=asyncsync.integrations.verl.AsyncsyncCheckpointManager  # optional

verl builds one engine per actor rank (``is_master`` given: rank 0 sends) and one per rollout worker
(no ``is_master``). Each rollout worker's engine runs asyncsync's reference receiver for the model at
``engine_kwargs.asyncsync.model`` (built from its config; no weights are read) on a thread and a
free port; ``prepare`` answers its URL. Actor rank 0 holds one ``WeightSync`` with every rollout
worker as a server, formed at the first ``send_weights`` and kept while verl's topology names the
same workers (``init_process_group`` and ``finalize`` cost nothing then); a topology with workers
added or removed forms it again. Every sync is one asyncsync version, through ``WeightSync.publish``
as any trainer's: bucketed, every bucket's checksum checked and the version applied whole or
refused whole by each receiver, as deltas where they pay (``delta: auto``: over the data plane, so
rollout workers on another host than actor rank 0; those on its host map each version from shared
memory, nothing to save). ``global_steps`` is only a label (it repeats, can be None, restarts on a
resume): versions are asyncsync's own, continuing from the newest any receiver holds.

What a caller must know:

* ``send_weights`` drains the weights generator on every actor rank (producing a tensor is a
  collective for FSDP's ``full_tensor()``); rank 0 holds the round's full tensors together until the
  version is packed. It returns the round's figures (``asyncsync/...``), which verl's manager hands
  to the trainer. It raises when no rollout worker got the version, and when the generator failed
  on rank 0 (every rollout worker is told at once, not at its deadline).
* ``receive_weights`` waits (``engine_kwargs.asyncsync.deadline_s``) for actor rank 0's word on its
  own sync (paired by actor rank 0's session and round, handed over by ``build_topology``), then
  yields the version its receiver verified and holds, by the names the actor sent; a worker that
  refused or lost the version yields nothing and raises ``VersionNotReceived`` naming why, and
  keeps the weights it had. The tensors yielded are valid until the next version arrives.
* Dense models: the receiver's transformers module is the one the name check reads; a MoE family's
  fused experts were not run under verl here.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineManager, CheckpointEngineRegistry
from verl.utils.ray_utils import auto_await

from asyncsync import ConfigError, SyncError, WeightSyncConfig
from asyncsync.launch.http import http_call

log = logging.getLogger(__name__)

BACKEND = "asyncsync"
ROUND_PATH = "/verl/round"  # where actor rank 0 tells each rollout worker the outcome of a sync
KEPT = 16  # outcomes a rollout worker keeps for the receive_weights calls that take them


class VersionNotReceived(RuntimeError):
    """A rollout worker got no verified version in a sync (refused, lost, or no word in time)."""


@dataclass(frozen=True)
class EngineOptions:
    """``engine_kwargs.asyncsync``: ``model``, the served model's directory (its ``config.json``);
    ``weight_sync``, any ``WeightSyncConfig`` key for actor rank 0's sync (servers are verl's);
    ``deadline_s``, how long a rollout worker waits for a sync's outcome; ``host``, the address the
    rollout workers' receivers listen on and are reached at."""

    model: str | None = None
    weight_sync: Mapping[str, Any] = field(default_factory=dict)
    deadline_s: float = 600.0
    host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ConfigError(f"engine_kwargs.asyncsync.model: expected the model's directory, got {self.model!r}")
        if not isinstance(self.weight_sync, Mapping) or "servers" in self.weight_sync:
            raise ConfigError("engine_kwargs.asyncsync.weight_sync: expected a mapping of WeightSyncConfig keys "
                              f"without servers (verl's topology gives them), got {self.weight_sync!r}")
        object.__setattr__(self, "weight_sync", MappingProxyType(dict(self.weight_sync)))
        if not isinstance(self.deadline_s, (int, float)) or isinstance(self.deadline_s, bool) or self.deadline_s <= 0:
            raise ConfigError(f"engine_kwargs.asyncsync.deadline_s: expected seconds > 0, got {self.deadline_s!r}")
        if not isinstance(self.host, str) or not self.host:
            raise ConfigError(f"engine_kwargs.asyncsync.host: expected an address, got {self.host!r}")
        self.config(("http://127.0.0.1:1",))  # every other key is checked where it is read

    def config(self, servers: Iterable[str]) -> WeightSyncConfig:
        """Actor rank 0's sync: ``weight_sync`` with verl's rollout workers as reference servers."""
        data = {**self.weight_sync, "servers": list(servers)}
        return WeightSyncConfig.from_dict(data).replace(trainer_ranks=1)


@dataclass(frozen=True)
class RoundOutcome:
    """Actor rank 0's word on one sync, posted to every rollout worker of the topology: the version
    sent (None: none was), the ``global_steps`` label, and the workers that did not apply it, why."""

    session: str
    round: int
    version: int | None
    label: int | None = None
    failures: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.session, str) or not self.session:
            raise ValueError(f"RoundOutcome.session: expected a non-empty string, got {self.session!r}")
        for key in ("round", "version", "label"):
            value = getattr(self, key)
            if not (value is None and key != "round") and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"RoundOutcome.{key}: expected an int{'' if key == 'round' else ' or None'}, got {value!r}")
        if not isinstance(self.failures, Mapping) or not all(isinstance(v, str) for v in self.failures.values()):
            raise ValueError(f"RoundOutcome.failures: expected url -> reason, got {self.failures!r}")
        object.__setattr__(self, "failures", MappingProxyType(dict(self.failures)))

    def to_json(self) -> dict[str, Any]:
        return {"session": self.session, "round": self.round, "version": self.version, "label": self.label,
                "failures": dict(self.failures)}

    @classmethod
    def from_json(cls, body: Any) -> RoundOutcome:
        if not isinstance(body, dict) or set(body) != {"session", "round", "version", "label", "failures"}:
            raise ValueError(f"{ROUND_PATH}: expected session, round, version, label and failures, got {body!r}")
        return cls(**body)

    def problem(self, url: str, held: int) -> str | None:
        """Why the worker at ``url``, holding version ``held``, has no version of this round; None if it has."""
        if url in self.failures:
            if self.version is None:
                return f"no version was sent in this sync: {self.failures[url]}"
            return f"version {self.version} was not applied here: {self.failures[url]}"
        if self.version is None:
            return "no version was sent in this sync: " + "; ".join(sorted(set(self.failures.values())))
        if held < self.version:
            return f"this worker holds version {held}, the trainer reports version {self.version} applied"
        return None


class Mailbox:
    """A rollout worker's ``RoundOutcome``s, each taken by the ``receive_weights`` of its own sync.

    Syncs pair by actor rank 0's session and round: ``expect`` (at ``init_process_group``, from
    the topology) names the round of the next sync, and each ``take`` waits for the next round in
    turn. An outcome posted after its taker gave up is never mistaken for a later sync's."""

    def __init__(self, deadline_s: float):
        self.deadline_s = deadline_s
        self._posted: dict[tuple[str, int], RoundOutcome] = {}  # the last KEPT, by (session, round)
        self._next: tuple[str, int] | None = None
        self._changed = threading.Condition()

    def post(self, outcome: RoundOutcome) -> None:
        with self._changed:
            self._posted[(outcome.session, outcome.round)] = outcome
            for key in list(self._posted)[:-KEPT]:
                del self._posted[key]
            self._changed.notify_all()

    def expect(self, session: str, round_: int) -> None:
        """The next ``take`` is for actor session ``session``'s round ``round_``."""
        with self._changed:
            self._next = (session, round_)

    def take(self, where: str) -> RoundOutcome:
        """The next sync's outcome; ``VersionNotReceived`` when none came within ``deadline_s``."""
        with self._changed:
            if self._next is None:
                raise RuntimeError("receive_weights before init_process_group: verl's manager builds the topology first")
            key = self._next
            self._next = (key[0], key[1] + 1)
            give_up = time.monotonic() + self.deadline_s
            while key not in self._posted:
                left = give_up - time.monotonic()
                if left <= 0:
                    raise VersionNotReceived(f"{where}: no word from actor rank 0 on this sync within "
                                             f"{self.deadline_s:g}s (deadline_s): the trainer died or did not "
                                             "reach this worker; the weights held stay")
                self._changed.wait(left)
            return self._posted.pop(key)


class RolloutReceiver:
    """A rollout worker's side: asyncsync's reference receiver for the served model, on a thread of its
    own and a free port, plus the route actor rank 0 posts each ``RoundOutcome`` to (``mailbox``).

    The receiver is ``asyncsync.receivers.reference.app.ReferenceServer`` (asyncsync has no other
    in-process receiver); this class uses only its ``app()``, ``serve_lock`` and its receiver's
    ``version`` and ``served()``."""

    def __init__(self, options: EngineOptions):
        if options.model is None:
            raise ConfigError("engine_kwargs.asyncsync.model: set it to the model's directory "
                              "(${actor_rollout_ref.model.path}): the rollout's receiver checks every version against it")
        from transformers import AutoConfig, AutoModelForCausalLM

        from asyncsync.receivers.reference.app import ReferenceServer

        config = AutoConfig.from_pretrained(options.model)
        self.model = AutoModelForCausalLM.from_config(config, dtype=getattr(config, "dtype", None) or torch.float32)
        self.server = ReferenceServer(self.model)
        self.options = options
        self.mailbox = Mailbox(options.deadline_s)
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self.url = ""
        self._thread = threading.Thread(target=self._serve, name="asyncsync-verl-receiver", daemon=True)
        self._thread.start()
        if not self._started.wait(60):
            raise RuntimeError("the rollout worker's asyncsync receiver did not start within 60s")

    def _serve(self) -> None:
        from aiohttp import web

        from asyncsync.launch.reference import free_port

        asyncio.set_event_loop(self._loop)
        app = self.server.app()
        app.router.add_post(ROUND_PATH, self._round)
        self._runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(self._runner.setup())
        port = free_port(self.options.host)
        self._loop.run_until_complete(web.TCPSite(self._runner, self.options.host, port).start())
        self.url = f"http://{self.options.host}:{port}"
        self._started.set()
        self._loop.run_forever()

    async def _round(self, request: Any) -> Any:
        from aiohttp import web

        try:
            outcome = RoundOutcome.from_json(await request.json())
        except ValueError as e:
            return web.json_response({"error": str(e)}, status=400)
        self.mailbox.post(outcome)
        return web.json_response({"ok": True, "version": self.server.receiver.version})

    def live(self) -> tuple[int, list[tuple[str, torch.Tensor]]]:
        """The version served and its tensors by the names versions arrive in (the checkpoint's, as
        the actor sent them; a fused layout converted back), valid until the next version is received."""
        with self.server.serve_lock:
            return self.server.receiver.version, list(self.server.receiver.served().items())

    def close(self) -> None:
        async def stop() -> None:
            await self._runner.cleanup()

        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(30)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)


class ActorSender:
    """Actor rank 0's side: one ``WeightSync`` to the rollout workers verl's topology names, kept
    across syncs and formed again when they change, one version per sync, and the round's outcome
    posted to every worker (async mode: once the version is done, from a thread of its own)."""

    def __init__(self, options: EngineOptions):
        self.options = options
        self.session = uuid.uuid4().hex
        self.servers: tuple[str, ...] = ()
        self.sync: Any = None
        self.formed = 0      # times the sync (its groups) was formed: once per set of workers
        self.version = 0
        self.round = 0
        self._told = 0       # the last round whose outcome was posted (or is posted by a reporter)
        self._reporters: list[threading.Thread] = []
        # One sync at a time: verl's stock manager may start the next sync while a send it stopped
        # waiting for (a worker died) is still evicting.
        self._busy = threading.Lock()

    def join(self, servers: tuple[str, ...]) -> None:
        """Nothing when verl names the same workers; otherwise the old sync closes and the next
        ``send`` forms one for the new set."""
        with self._busy:
            if servers != self.servers:
                self._close()
                self.servers = servers

    def send(self, named: dict[str, torch.Tensor], label: int | None) -> dict[str, Any]:
        """``named`` as the next version; the round's figures. Every rollout worker of the topology
        is told the round's outcome, whatever happens; ``SyncError`` when no worker applied it."""
        with self._busy:
            self.round += 1
            try:
                return self._send(named, label)
            except Exception as e:
                if self._told < self.round:
                    self._tell(RoundOutcome(self.session, self.round, None, label, self._everyone(
                        f"actor rank 0 failed to send the version: {type(e).__name__}: {e}")))
                raise

    def abandon(self, label: int | None, reason: str) -> None:
        """A round that produced no version (the weights generator failed): every rollout worker
        waiting on it is told at once, instead of at its ``deadline_s``."""
        with self._busy:
            self.round += 1
            if self.servers:
                self._tell(RoundOutcome(self.session, self.round, None, label, self._everyone(reason)))

    def _everyone(self, reason: str) -> dict[str, str]:
        return {url: reason for url in self.servers}

    def _send(self, named: dict[str, torch.Tensor], label: int | None) -> dict[str, Any]:
        if not self.servers:
            raise RuntimeError("send_weights before init_process_group: verl's manager builds the topology first")
        if self.sync is None:
            self._form(named)
        self.version += 1
        start = time.perf_counter()
        result = self.sync.publish(named, self.version)
        if self.sync.is_async:
            self.sync.wait_snapshot()
            self._report_later(self.version, self.round, label)
            return {"asyncsync/version": self.version, "asyncsync/publish_s": time.perf_counter() - start,
                    "asyncsync/groups_formed": self.formed}
        self._tell(RoundOutcome(self.session, self.round, self.version, label, result.failures))
        if not result.server_versions:
            raise SyncError(f"version {self.version} (global_steps {label}) reached no rollout worker: "
                            + "; ".join(f"{u}: {w}" for u, w in result.failures.items()))
        return {"asyncsync/version": self.version, "asyncsync/sync_s": result.total_s,
                "asyncsync/bytes": result.nbytes, "asyncsync/wire_bytes": result.wire_bytes,
                "asyncsync/delta_buckets": result.delta_buckets, "asyncsync/failed_workers": len(result.failures),
                "asyncsync/groups_formed": self.formed}

    def _form(self, named: dict[str, torch.Tensor]) -> None:
        from asyncsync import WeightSync

        sync = WeightSync(self.options.config(self.servers))
        try:
            sync.connect(named)
        except BaseException:
            sync.close()
            raise
        self.sync, self.formed = sync, self.formed + 1
        self.version = max(self.version, *sync.server_versions.values(), 0)
        log.info("asyncsync: formed the sync with %d rollout worker(s), versions from %d", len(self.servers),
                 self.version + 1)

    def _report_later(self, version: int, round_: int, label: int | None) -> None:
        """Async mode: post the round's outcome once ``version`` was applied, refused or superseded."""
        sync, self._told = self.sync, round_

        def report() -> None:
            give_up = time.monotonic() + sync.config.deadlines.version_s
            while time.monotonic() < give_up:
                done = [r for r in list(sync.metrics.history) if r.version >= version]
                if done:
                    r = done[0]
                    self._post(RoundOutcome(self.session, round_, r.version, label, r.failures))
                    return
                time.sleep(0.02)
            self._post(RoundOutcome(self.session, round_, None, label, {u: "no outcome within the version deadline"
                                                                        for u in self.servers}))

        thread = threading.Thread(target=report, name="asyncsync-verl-report", daemon=True)
        thread.start()
        self._reporters = [t for t in self._reporters if t.is_alive()] + [thread]

    def _tell(self, outcome: RoundOutcome) -> None:
        self._told = outcome.round
        self._post(outcome)

    def _post(self, outcome: RoundOutcome) -> None:
        for url in self.servers:
            try:
                status, answer = http_call(url, "POST", ROUND_PATH, outcome.to_json(), timeout_s=10.0)
            except OSError as e:  # a worker gone: it is evicted, and verl's own call to it fails
                status, answer = None, e
            if status != 200:
                log.warning("asyncsync: could not tell %s the outcome of version %s: %s %s", url, outcome.version,
                            status, answer)

    def close(self) -> None:
        """Drain (async: the last version reaches the workers), wait for the last outcomes, release."""
        with self._busy:
            self._close()

    def _close(self) -> None:
        if self.sync is not None:
            sync, self.sync = self.sync, None
            sync.close()
        for thread in self._reporters:
            thread.join(60)
        self._reporters = []


@CheckpointEngineRegistry.register(BACKEND)
class AsyncsyncCheckpointEngine(CheckpointEngine):
    """verl's ``CheckpointEngine`` contract on asyncsync: an ``ActorSender`` on actor rank 0 (built with
    ``is_master=True``), nothing but the generator's drain on the other actor ranks
    (``is_master=False``), a ``RolloutReceiver`` on each rollout worker (built without ``is_master``,
    as verl's ``CheckpointEngineWorker`` builds it). ``bucket_size`` is verl's
    ``update_weights_bucket_megabytes`` (the version's bucket size unless ``weight_sync`` sets one)."""

    def __init__(self, bucket_size: int, is_master: bool | None = None, **engine_kwargs: Any) -> None:
        options = EngineOptions(**engine_kwargs)
        if "bucket_bytes" not in options.weight_sync:
            options = EngineOptions(options.model, {**options.weight_sync, "bucket_bytes": bucket_size},
                                    options.deadline_s, options.host)
        self.is_actor = is_master is not None
        self.sender = ActorSender(options) if is_master else None
        self.receiver = RolloutReceiver(options) if not self.is_actor else None

    def prepare(self) -> dict[str, Any]:
        """A rollout worker: its receiver's URL. Actor rank 0: its session and the next sync's round."""
        if self.sender is not None:
            return {"rollout": None, "session": self.sender.session, "next_round": self.sender.round + 1}
        return {"rollout": self.receiver.url if self.receiver is not None else None}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Every actor rank gets the rollout workers' URLs, in verl's order (the workers' metadata
        follow the actor ranks'); every rollout worker gets actor rank 0's session and next round."""
        urls = tuple(m["rollout"] for m in metadata[actor_wg_world_size:])
        if len(urls) != rollout_world_size or not all(urls) or "session" not in metadata[0]:
            raise ValueError(f"asyncsync build_topology: expected actor rank 0's session, then {rollout_world_size} "
                             f"rollout URLs after {actor_wg_world_size} actor ranks' metadata, got {metadata}")
        actor = {"servers": [urls] * actor_wg_world_size}
        rollout = {"servers": [urls] * rollout_world_size, "session": [metadata[0]["session"]] * rollout_world_size,
                   "next_round": [metadata[0]["next_round"]] * rollout_world_size}
        return actor, rollout

    def init_process_group(self, servers: tuple[str, ...], session: str | None = None,
                           next_round: int | None = None) -> None:
        """Actor rank 0: the workers to send to (the same as last time: nothing happens). A rollout
        worker: the actor session and round its next ``receive_weights`` is for."""
        if self.sender is not None:
            self.sender.join(tuple(servers))
        if self.receiver is not None and session is not None and next_round is not None:
            self.receiver.mailbox.expect(session, next_round)

    def finalize(self) -> None:
        """Nothing: the sync and its groups are kept for the next sync."""

    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, Any]:
        """Drain ``weights`` (every rank, to the end: producing a tensor may be collective); on rank 0
        send them as one version. A generator that fails on rank 0 is reported to every rollout
        worker at once (they raise ``VersionNotReceived``), then raised here."""
        named: dict[str, torch.Tensor] = {}
        twice: list[str] = []
        try:
            async for name, tensor in _as_async(weights):
                if self.sender is not None:
                    if name in named:
                        twice.append(name)
                    named[name] = tensor.detach()
        except Exception as e:
            if self.sender is not None:
                self.sender.abandon(global_steps, f"actor rank 0's weights generator failed: {type(e).__name__}: {e}")
            raise
        if self.sender is None:
            return {}
        if twice:
            self.sender.abandon(global_steps, f"the weights generator yielded {twice[:3]} twice")
            raise ValueError(f"send_weights: the weights generator yielded {twice[:3]} twice: each name once per sync")
        return await asyncio.to_thread(self.sender.send, named, global_steps)

    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Yield the version of this sync that this worker's receiver verified and holds; raise
        ``VersionNotReceived`` (nothing yielded, the weights held stay) when it has none."""
        if self.receiver is None:
            raise RuntimeError("receive_weights on an actor rank: only rollout workers receive")
        outcome = await asyncio.to_thread(self.receiver.mailbox.take, self.receiver.url)
        held, tensors = self.receiver.live()
        problem = outcome.problem(self.receiver.url, held)
        if problem is not None:
            raise VersionNotReceived(f"{self.receiver.url} (global_steps {global_steps}): {problem}; "
                                     f"it keeps version {held}")
        for name, tensor in tensors:
            yield name, tensor

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        if self.receiver is not None:
            self.receiver.close()


async def _as_async(weights: Any) -> AsyncIterator[Any]:
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item


class AsyncsyncCheckpointManager(CheckpointEngineManager):
    """verl's ``CheckpointEngineManager`` for the ``asyncsync`` backend (``checkpoint_manager_class``),
    keeping what the stock one takes away. The stock manager, on every sync: aborts every replica and
    releases its KV cache, rebuilds the topology, waits for the actor ranks and every rollout worker
    together, finalizes, resumes, and raises as soon as any worker fails (a failure before the resume
    leaves every replica aborted). This one:

    * forms the topology only when the replicas changed (``add_replicas`` / ``remove_replicas``);
    * lets every replica generate while the version travels and is verified (asyncsync's receivers
      are not the inference servers), and aborts only around the load into the servers, resuming
      them in a ``finally``; the KV cache is kept (the receivers staged the version in their memory);
    * a worker that refused or lost the version does not fail the sync: its replica keeps serving its
      old version, the others load the new one; ``last_failures`` says which and why, and the
      figures count them (``asyncsync/workers_not_loaded``; a worker that died is counted too: take
      its replica out with ``remove_replicas``). It raises only when no worker loaded it;
    * with ``weight_sync.async_weight_update: true`` returns once the actor ranks copied the version
      (the trainer may go on); the workers load it when it lands, and the next ``update_weights``
      (or ``drain()``) first waits for those loads. Generation is then not aborted for the load:
      requests in flight may see both versions (verl's partial rollouts).
    """

    def __init__(self, config: Any, actor_wg: Any, replicas: list[Any]) -> None:
        super().__init__(config, actor_wg, replicas)
        if self.backend != BACKEND:
            raise ConfigError(f"checkpoint_manager_class: AsyncsyncCheckpointManager drives the asyncsync backend; "
                              f"checkpoint_engine.backend is {self.backend!r}: set it to {BACKEND!r}")
        options = EngineOptions(**dict(config.engine_kwargs.get(BACKEND, {})))
        self.is_async = bool(options.weight_sync.get("async_weight_update", False))
        self.last_failures: dict[int, str] = {}  # rollout worker index -> why it did not load the last version
        self._workers: tuple[Any, ...] = ()
        self._rollout: Any = None
        self._pending: list[Any] = []

    def _rollout_group(self) -> Any:
        """The rollout workers as one worker group, its topology built only when they changed."""
        from verl.checkpoint_engine.base import _worker_cls
        from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup

        workers = tuple(w for replica in self.replicas for w in replica.workers)
        if workers != self._workers:
            rollout = RayWorkerGroup(worker_handles=list(workers), ray_cls_with_init=RayClassWithInitArgs(cls=_worker_cls))
            self.build_process_group(rollout)
            self._workers, self._rollout = workers, rollout
        return self._rollout

    @auto_await
    async def update_weights(self, global_steps: int | None = None) -> dict[str, Any]:
        """One sync (verl's trainer calls it as the stock manager's): the actor ranks' figures, plus
        ``asyncsync/workers_not_loaded`` when blocking. Raises ``SyncError`` when no rollout worker
        loaded the version (the actor ranks failed, or every worker refused or lost it); every
        replica keeps serving the weights it had then."""
        import ray

        self.drain()
        rollout = self._rollout_group()
        try:
            results = ray.get(self.actor_wg.update_weights(global_steps=global_steps, mode=self.backend))
        except Exception as e:
            # No worker got a version; each still takes this sync's outcome, so the next sync pairs with its own.
            self.last_failures = _failures(rollout.update_weights(global_steps=global_steps))
            raise SyncError(f"no rollout worker loaded the version of global_steps {global_steps}: {_reason(e)}") from e
        metrics: dict[str, Any] = {}
        for result in results:
            metrics.update(result or {})
        if self.is_async:
            self._pending = rollout.update_weights(global_steps=global_steps)
            return metrics
        await self.abort_replicas()
        try:
            loads = rollout.update_weights(global_steps=global_steps)
            self.last_failures = _failures(loads)
        finally:
            await self.resume_generation_replicas()
        if len(self.last_failures) == len(loads):
            raise SyncError(f"no rollout worker loaded the version of global_steps {global_steps}: {self.last_failures}")
        return {**metrics, "asyncsync/workers_not_loaded": len(self.last_failures)}

    def drain(self) -> dict[int, str]:
        """Wait for the loads an async sync left running; which workers did not load, and why."""
        if self._pending:
            pending, self._pending = self._pending, []
            self.last_failures = _failures(pending)
        return self.last_failures


def _failures(refs: list[Any]) -> dict[int, str]:
    """Each ref's error (index -> why) once every one has finished."""
    import ray

    failed = {}
    for i, ref in enumerate(refs):
        try:
            ray.get(ref)
        except Exception as e:  # a worker that refused, lost or never got the version: the others go on
            failed[i] = _reason(e)
    return failed


def _reason(error: BaseException) -> str:
    """What failed, in one line: a Ray task error's cause (the worker's own exception), not its traceback."""
    cause = getattr(error, "cause", None)
    cause = cause if isinstance(cause, BaseException) else error
    lines = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {lines[0] if lines else ''}"
