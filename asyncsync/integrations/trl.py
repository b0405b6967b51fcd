"""asyncsync inside TRL 1.16: GRPOTrainer's vLLM server mode, and AsyncGRPOTrainer's ``weight_transfer``.

``GRPOTrainer`` is TRL's trainer (``use_vllm=True, vllm_mode="server"``) with its ``VLLMGeneration``
replaced, so asyncsync moves the weights to stock vLLM servers that run asyncsync's backend. The user
adds one argument, ``weight_sync=`` (a YAML file, a dict or a ``WeightSyncConfig``):
``async_weight_update: false`` keeps TRL's semantics exactly, ``true`` lets rollouts lag up to
``max_staleness`` versions, each rollout's version logged beside TRL's metrics. ``WeightTransfer``
implements AsyncGRPOTrainer's ``WeightTransferProtocol``.

What a caller must know: this overrides TRL's private ``_init_vllm`` and ``sync_weights``, so it is
tested with TRL 1.16.0 only (another version gets a warning). Every rank of a multi-process
(accelerate) run calls it, as TRL does. TRL is imported on first use. The rest: docs/trl.md.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from asyncsync.launch.http import wait_healthy
from asyncsync.config import ConfigError, ServerConfig, WeightSyncConfig
from asyncsync.engines.base import parse_weight_version
from asyncsync.metrics import SyncResult
from asyncsync.trainer.sync import WeightSync
from asyncsync.transport.fleet import SyncError

log = logging.getLogger(__name__)

TESTED_TRL = "1.16.0"
_CONSTRUCTING = threading.Lock()  # TRL's module global is swapped while one trainer constructs

WeightSyncSource = WeightSyncConfig | Mapping[str, Any] | str | Path


def weight_sync_config(source: WeightSyncSource, trl_url: str | None) -> WeightSyncConfig:
    """The ``WeightSyncConfig`` of a TRL run: ``source`` as given (a YAML file's ``weight_sync``
    section, or the whole file), its ``servers`` defaulting to TRL's own (``trl_url``), every one a
    vLLM server, TRL's first. Raises ``ConfigError`` naming the key."""
    if isinstance(source, WeightSyncConfig):
        config = source
    else:
        data: Any = source
        if isinstance(source, (str, Path)):
            with open(source) as f:
                data = yaml.safe_load(f) or {}
            if isinstance(data, Mapping) and "weight_sync" in data:
                data = data["weight_sync"]
        if not isinstance(data, Mapping):
            raise ConfigError(f"weight_sync: expected a mapping, a YAML file or a WeightSyncConfig, got {type(data).__name__}")
        config = WeightSyncConfig.from_dict(dict(data))
    if not config.servers:
        if trl_url is None:
            raise ConfigError("servers: list the vLLM servers to sync (there is no TRL server URL to default to)")
        config = config.replace(servers=(ServerConfig(trl_url, kind="vllm"),))
    others = [s for s in config.servers if s.kind != "vllm"]
    if others:
        raise ConfigError(f"servers: {others[0].url} is a {others[0].kind!r} server; TRL generates through vLLM's "
                          "OpenAI routes, so every server here must be kind: vllm (stock vLLM with asyncsync's backend)")
    if trl_url is not None:
        own = trl_url.rstrip("/")
        urls = [s.base_url for s in config.servers]
        if own not in urls:
            raise ConfigError(f"servers: TRL generates from {own} (vllm_server_base_url), which is not listed {urls}: "
                              "it would serve weights no version reaches; list it, or leave servers out to sync it alone")
        config = config.replace(servers=tuple(sorted(config.servers, key=lambda s: s.base_url != own)))
    return config


# -- rollouts and the servers that generate them ---------------------------------------------------


@dataclass(frozen=True)
class Rollouts:
    """One generation's completions and the weight version of each, from the servers' answers.

    ``versions[i]`` is the version completion i's server served when the request was sent,
    ``upper[i]`` when it returned: a completion is exact where they agree (the server held
    generation for a switch, and requests in flight finished first); otherwise every token came
    from a version between the two. ``logprobs[i]`` are the sampled tokens' logprobs as the server
    computed them (what TRL's importance-sampling correction uses)."""

    prompt_ids: tuple[tuple[int, ...], ...]
    completion_ids: tuple[tuple[int, ...], ...]
    logprobs: tuple[tuple[float, ...], ...] | None
    versions: tuple[int, ...]
    upper: tuple[int, ...]
    servers: tuple[str, ...]

    def __post_init__(self) -> None:
        n = len(self.completion_ids)
        sizes = {len(self.prompt_ids), len(self.versions), len(self.upper), len(self.servers)}
        if self.logprobs is not None:
            sizes.add(len(self.logprobs))
        if sizes != {n}:
            raise ValueError(f"Rollouts: {n} completions but fields of lengths {sorted(sizes)}")
        if any(u < v for v, u in zip(self.versions, self.upper)):
            raise ValueError("Rollouts: a server reported an older version after a request than before it")

    @property
    def exact(self) -> tuple[bool, ...]:
        return tuple(v == u for v, u in zip(self.versions, self.upper))


class StaleServer(RuntimeError):
    """A server serves a version older than the rollouts may come from."""


class ServerFleet:
    """TRL's ``VLLMClient`` for each server, in the one place TRL generates (``vllm_client.generate``).

    The unique prompts are split over the servers that are up, each part sent with TRL's own request
    (``/v1/completions`` with token ids), bracketed by ``GET /weight_info``. Every request has
    ``deadlines.http_s``; a server that fails, or serves a version older than ``min_version``, is
    marked down for ``readmit_interval_s`` and its part goes to another. Anything else TRL asks of
    its client (server info, multimodal features) goes to TRL's own server."""

    def __init__(self, config: WeightSyncConfig, startup_s: float):
        from trl.generation.vllm_client import VLLMClient

        self.config = config
        self.clients: dict[str, Any] = {}
        for server in config.servers:
            url = server.base_url
            wait_healthy(url, startup_s, "the vLLM server (vllm_server_timeout; start it, or check the URL)", poll_s=1.0)
            # TRL's constructor asks the server with its own session, which has no timeout.
            client = run_within(config.deadlines.http_s, f"TRL's client connecting to {url}", VLLMClient, base_url=url,
                            connection_timeout=startup_s)
            client.session = http_session(config.deadlines.http_s)  # TRL's has no timeout and retries for a minute
            self.clients[server.base_url] = client
        self.primary = self.clients[config.servers[0].base_url]
        self.min_version = 0  # set by the trainer before each generation
        self.rollouts: Rollouts | None = None
        self._down: dict[str, tuple[float, str]] = {}  # url -> (when it failed, why)

    def __getattr__(self, name: str) -> Any:
        if name == "primary":  # not set yet: no recursion
            raise AttributeError(name)
        return getattr(self.primary, name)

    def up(self) -> list[str]:
        now = time.monotonic()
        return [u for u in self.clients if u not in self._down or now - self._down[u][0] >= self.config.readmit_interval_s]

    def served_version(self, url: str) -> int:
        client = self.clients[url]
        return parse_weight_version(url, client._get(f"{url}/weight_info")["weight_version"])

    def generate(self, prompts: list, features: list | None = None, n: int = 1, **sampling: Any) -> dict[str, Any]:
        """TRL's ``VLLMClient.generate`` over the servers; records ``rollouts``. Raises ``SyncError``
        when no server could generate (each one's reason)."""
        parts: dict[int, dict[str, Any]] = {}
        why: dict[str, str] = {}
        pending = [(0, len(prompts))]
        while pending:
            servers = self.up()
            if not servers:
                raise SyncError(f"no vLLM server could generate the rollouts (need version >= {self.min_version}): "
                                + "; ".join(f"{u}: {w}" for u, w in {**{u: d[1] for u, d in self._down.items()}, **why}.items()))
            jobs = _assign(pending, servers)
            pending = []
            with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
                done = list(pool.map(lambda job: self._part(job[0], prompts, features, job[1], n, sampling), jobs))
            for (url, span), (out, error) in zip(jobs, done):
                if error is None:
                    parts[span[0]] = out
                    self._down.pop(url, None)
                else:
                    log.warning("%s did not generate %d prompt(s): %s; trying another server", url, span[1] - span[0], error)
                    why[url] = error
                    self._down[url] = (time.monotonic(), error)
                    pending.append(span)
        return self._join([parts[k] for k in sorted(parts)], n)

    def _part(self, url: str, prompts: list, features: list | None, span: tuple[int, int], n: int,
              sampling: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
        lo, hi = span
        try:
            before = self.served_version(url)
            if before < self.min_version:
                raise StaleServer(f"serves version {before}, older than {self.min_version} (max_staleness)")
            out = self.clients[url].generate(prompts=prompts[lo:hi], features=None if features is None else features[lo:hi],
                                             n=n, **sampling)
            after = self.served_version(url)
        except Exception as e:  # any failure of the server or its answer: the part goes elsewhere
            return None, f"{type(e).__name__}: {e}"
        return {**out, "url": url, "before": before, "after": after}, None

    def _join(self, parts: list[dict[str, Any]], n: int) -> dict[str, Any]:
        out: dict[str, Any] = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "logprob_token_ids": []}
        versions, upper, servers, per_completion_prompt = [], [], [], []
        for p in parts:
            out["prompt_ids"] += p["prompt_ids"]
            out["completion_ids"] += p["completion_ids"]
            for key in ("logprobs", "logprob_token_ids"):
                out[key] = None if out[key] is None or p.get(key) is None else out[key] + p[key]
            count = len(p["completion_ids"])
            versions += [p["before"]] * count
            upper += [p["after"]] * count
            servers += [p["url"]] * count
            per_completion_prompt += [ids for ids in p["prompt_ids"] for _ in range(n)][:count]
        lp = out["logprobs"]
        self.rollouts = Rollouts(
            tuple(tuple(ids) for ids in per_completion_prompt), tuple(tuple(c) for c in out["completion_ids"]),
            None if lp is None else tuple(tuple(t[0] for t in seq) for seq in lp),
            tuple(versions), tuple(upper), tuple(servers))
        return out


def _assign(spans: list[tuple[int, int]], servers: list[str]) -> list[tuple[str, tuple[int, int]]]:
    """Each pending span to a server: a single span is split evenly over the servers (contiguous
    parts, so the completions keep TRL's prompt-major order), several go round-robin."""
    if len(spans) == 1:
        lo, hi = spans[0]
        k = min(len(servers), hi - lo) or 1
        cuts = [lo + (hi - lo) * i // k for i in range(k + 1)]
        return [(servers[i], (cuts[i], cuts[i + 1])) for i in range(k)]
    return [(servers[i % len(servers)], span) for i, span in enumerate(spans)]


def http_session(timeout_s: float) -> Any:
    """A ``requests`` session whose every request has ``timeout_s`` and at most two quick retries of
    a refused connection (TRL's own retries for about a minute, with no timeout)."""
    import requests
    from requests.adapters import HTTPAdapter
    from urllib3.util.retry import Retry

    session = requests.Session()
    adapter = HTTPAdapter(max_retries=Retry(total=2, connect=2, read=0, status=0, backoff_factor=0.2), pool_maxsize=64)
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    plain = session.request

    def request(method: str, url: str, **kwargs: Any) -> Any:
        kwargs.setdefault("timeout", timeout_s)
        return plain(method, url, **kwargs)

    session.request = request  # type: ignore[method-assign]
    return session


def run_within(timeout_s: float, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` on a daemon thread, given up with ``TimeoutError`` after ``timeout_s``
    (for calls into code that sets no deadline of its own; the thread is left to end with the process)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as e:  # re-raised on the caller's thread
            box["error"] = e

    thread = threading.Thread(target=run, name="asyncsync-trl-call", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"{what} did not finish within {timeout_s:g}s (deadlines.http_s)")
    if "error" in box:
        raise box["error"]
    return box["value"]


# -- GRPOTrainer ---------------------------------------------------------------------------------


class _SyncedGeneration:
    """Mixed into TRL's ``VLLMGeneration`` (server mode): the servers through a ``ServerFleet``, the
    weights through a ``WeightSync``. Built per trainer by ``GRPOTrainer``."""

    def __init__(self, *args: Any, weight_sync: WeightSyncSource, **kwargs: Any):
        self.weight_sync_source = weight_sync
        self.sync: WeightSync | None = None
        self.version = 0  # the last version published (every rank agrees)
        self.trainer_metrics: Any = None  # TRL's per-mode metric lists, set by the trainer
        self._publishes = False  # this rank takes part in the sync
        self._connected = False  # on every rank, from the first sync_weights to close()
        super().__init__(*args, **kwargs)

    def _init_vllm(self) -> None:
        if self.mode != "server":
            raise ConfigError(f"vllm_mode: asyncsync syncs vLLM servers; set vllm_mode='server' (got {self.mode!r})")
        url = self.server_base_url or f"http://{self.server_host}:{self.server_port}"
        self.config = weight_sync_config(self.weight_sync_source, url.rstrip("/"))
        if self.accelerator.is_main_process:
            self.vllm_client = ServerFleet(self.config, self.server_timeout)
        self.accelerator.wait_for_everyone()

    @property
    def rollouts(self) -> Rollouts | None:
        """The last generation's completions and versions (main process)."""
        return self.vllm_client.rollouts if self.accelerator.is_main_process else None

    def sync_weights(self) -> None:
        """Publish the trainer's weights as the next version (TRL calls this right before a step's
        generation, on every rank), then make sure the servers asked for rollouts are fresh enough."""
        start = time.perf_counter()
        first = not self._connected
        if first:
            self._connect()
        version = self.version + 1
        if self._publishes:
            assert self.sync is not None
            result = self.sync.publish(self.model, version)
            if result is not None and result.failures:
                log.warning("version %d did not reach %s", version, result.failures)
        self.version = version
        if self.accelerator.is_main_process:
            assert self.sync is not None
            cfg = self.config
            # The first version always: before it, servers hold whatever they were started or left with.
            needed = version - cfg.max_staleness if cfg.async_weight_update and not first else version
            # wait_for_fresh_servers(v) waits for v - max_staleness
            if not self.sync.wait_for_fresh_servers(needed + cfg.max_staleness, timeout=cfg.deadlines.version_s):
                log.warning("not every server serves version %d yet (%s); generating from those that do", needed,
                            self.sync.server_versions)
            self.vllm_client.min_version = needed
            self._metric("asyncsync/sync_s", time.perf_counter() - start)

    def _connect(self) -> None:
        """Connect on the ranks that sync (all of them for DTensor weights, else the main process),
        and continue from the newest version any server serves."""
        from torch.distributed.tensor import DTensor

        sharded = any(isinstance(p, DTensor) for p in self.model.parameters())
        self._publishes = sharded or self.accelerator.is_main_process
        live = 0
        if self._publishes:
            self.sync = WeightSync(self.config.replace(trainer_ranks="auto" if sharded else 1))
            self.sync.connect(self.model)
            live = max(self.sync.server_versions.values(), default=0)
        if self.accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            live = broadcast_object_list([live], from_process=0)[0]
        self.version = max(self.version, live)
        self._connected = True
        if self.accelerator.is_main_process:
            log.info("asyncsync: %s sync of %s, versions from %d", "async" if self.config.async_weight_update else "blocking",
                     [s.base_url for s in self.config.servers], live + 1)

    def generate(self, prompts: list, images: list | None, num_generations: int, profiler: Any = None) -> tuple:
        out = super().generate(prompts, images, num_generations, profiler)
        rollouts = self.rollouts
        if rollouts is not None and rollouts.versions:
            lags = [self.version - v for v in rollouts.versions]
            self._metric("asyncsync/version_lag/mean", sum(lags) / len(lags))
            self._metric("asyncsync/version_lag/max", float(max(lags)))
            self._metric("asyncsync/rollout_version/min", float(min(rollouts.versions)))
            self._metric("asyncsync/versions_exact", sum(rollouts.exact) / len(lags))
        return out

    def _metric(self, key: str, value: float) -> None:
        if self.trainer_metrics is not None:
            self.trainer_metrics["train" if self.model.training else "eval"][key].append(value)

    def wait_snapshot(self) -> None:
        """Before the optimizer changes the weights (async: the published version's snapshot is done)."""
        if self.sync is not None:
            self.sync.wait_snapshot()

    def close(self) -> None:
        """Drain (async: the last version reaches the servers) and release them; a later
        ``sync_weights`` connects again, continuing the versions."""
        self._connected = False
        if self.sync is not None:
            sync, self.sync = self.sync, None
            sync.close()
            if sync.errors:
                log.error("asyncsync: %d version(s) could not be sent: %s", len(sync.errors), sync.errors[-1])


class _GRPOTrainer:
    """Mixed into ``trl.GRPOTrainer``: its ``VLLMGeneration`` syncs through asyncsync."""

    def __init__(self, *args: Any, weight_sync: WeightSyncSource, **kwargs: Any):
        import trl.trainer.grpo_trainer as grpo

        generation = functools.partial(_trl_classes()["generation"], weight_sync=weight_sync)
        with _CONSTRUCTING:
            stock = grpo.VLLMGeneration
            grpo.VLLMGeneration = generation
            try:
                super().__init__(*args, **kwargs)
            finally:
                grpo.VLLMGeneration = stock
        if not self.use_vllm:
            raise ConfigError("use_vllm: asyncsync syncs vLLM servers; set use_vllm=True, vllm_mode='server' in GRPOConfig")
        self.vllm_generation.trainer_metrics = self._metrics
        self.add_callback(_trl_classes()["callback"](self.vllm_generation))
        if self.vllm_generation.config.async_weight_update and not self.vllm_importance_sampling_correction:
            log.warning("async_weight_update: rollouts may come from an older version, and "
                        "vllm_importance_sampling_correction=False trains on them as if they did not")

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """TRL's ``train``; the sync is drained and closed when it returns or raises."""
        try:
            return super().train(*args, **kwargs)
        finally:
            try:
                self.vllm_generation.close()
            except Exception:  # never hide the training's own error
                log.exception("asyncsync: closing the weight sync failed")


@functools.cache
def _trl_classes() -> dict[str, type]:
    """TRL's classes with asyncsync mixed in, built on first use (TRL is imported here)."""
    import trl
    from transformers import TrainerCallback
    from trl.generation.vllm_generation import VLLMGeneration

    if trl.__version__ != TESTED_TRL:
        log.warning("asyncsync.integrations.trl was tested with TRL %s, this is %s: it overrides the private "
                    "VLLMGeneration._init_vllm and sync_weights", TESTED_TRL, trl.__version__)

    class SnapshotCallback(TrainerCallback):
        """Hold the optimizer step until the published version's snapshot is taken (async mode)."""

        def __init__(self, generation: Any):
            self.generation = generation

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.generation.wait_snapshot()

    generation = type("AsyncsyncVLLMGeneration", (_SyncedGeneration, VLLMGeneration), {"__module__": __name__})
    trainer = type("GRPOTrainer", (_GRPOTrainer, trl.GRPOTrainer),
                   {"__module__": __name__, "__doc__": _GRPOTrainer.__doc__ + "\n\n" + (__doc__ or "")})
    return {"generation": generation, "trainer": trainer, "callback": SnapshotCallback}


def __getattr__(name: str) -> Any:
    if name == "GRPOTrainer":
        return _trl_classes()["trainer"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- AsyncGRPOTrainer ------------------------------------------------------------------------------


class WeightTransfer:
    """TRL's ``WeightTransferProtocol`` (``trl.experimental.async_grpo``) on asyncsync::

        AsyncGRPOTrainer(..., weight_transfer=WeightTransfer("weight_sync.yaml", args.vllm_server_base_url))

    AsyncGRPOTrainer calls, on its main process: ``init_weight_transfer()`` at train begin, then every
    ``weight_sync_steps`` ``pause()``, ``send_weights(iterator)``, ``resume()``, and ``destroy()`` at
    train end. ``send_weights`` sends what the iterator yields (TRL's names: PEFT merged, wrapper
    prefixes stripped; FSDP2 parameters gathered whole, which TRL does one at a time and this holds
    together until the version is sent) as one version, bucketed and checksummed, with asyncsync's
    deadlines, and returns once every server applied it or was evicted; it raises ``SyncError`` only
    when no server got the version. ``pause``/``resume`` pause nothing: vLLM generates while the
    version is received and verified, and is held only for the load. Versions continue from the
    servers' live versions. ``async_weight_update`` must be false: TRL tags rollouts with its own
    model version right after ``resume``, so the version must be live by then."""

    def __init__(self, weight_sync: WeightSyncSource, server_url: str | None = None):
        config = weight_sync_config(weight_sync, server_url.rstrip("/") if server_url else None)
        if config.async_weight_update:
            raise ConfigError("async_weight_update: AsyncGRPOTrainer tags rollouts with the new model version as soon "
                              "as send_weights and resume return, so the version must be live then; set it to false "
                              "(the trainer is asynchronous already: rollouts are generated while it trains)")
        self.config = config.replace(trainer_ranks=1)  # TRL calls it on the main process only
        self.sync: WeightSync | None = None
        self.version = 0
        self.last: SyncResult | None = None
        self.paused = False

    def init_weight_transfer(self) -> None:
        """Nothing to set up yet: the plan needs the tensors, which the first ``send_weights`` brings."""
        self.paused = False

    def pause(self) -> None:
        self.paused = True

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        """One version of the tensors ``iterator`` yields; raises ``SyncError`` when no server applied it."""
        named: dict[str, torch.Tensor] = {}
        for name, tensor in iterator:
            if name in named:
                raise ValueError(f"send_weights: tensor '{name}' was yielded twice")
            named[name] = tensor
        if self.sync is None:
            sync = WeightSync(self.config)
            sync.connect(named)
            self.sync = sync
            self.version = max(self.version, max(sync.server_versions.values(), default=0))
        self.version += 1
        result = self.sync.publish(named, self.version)
        assert result is not None  # blocking
        self.last = result
        if not result.server_versions:
            raise SyncError(f"version {self.version} reached no vLLM server: " +
                            "; ".join(f"{u}: {w}" for u, w in result.failures.items()))

    def resume(self) -> None:
        self.paused = False

    def destroy(self) -> None:
        if self.sync is not None:
            sync, self.sync = self.sync, None
            sync.close()
