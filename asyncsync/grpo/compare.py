"""Blocking vs async sync on the demo, in two regimes, and what the figures mean.

    regimes = compare(cfg, ["host", "link"])        # each: both modes, side by side, same seed
    for r in regimes: print(r.line())

* ``host``: trainer and servers on this machine as they are: same-host servers map each version
  from shared memory (``transport: auto``), so a sync costs little of a step and async has little
  to hide; its background work also shares the cores with training.
* ``link``: trainer and servers as if on different hosts, as clusters run them: the run happens in
  a private network namespace whose loopback is shaped to ``cfg.link_gbit`` (``asyncsync.netns``),
  with the data-plane collective, so every byte of every version crosses that one link. When no
  namespace can be made here (no root, no user namespaces, no ``tc``) it says why and runs on plain
  loopback with the collective instead.

The ``link`` regime runs this very module again inside the namespace (the servers it starts are its
children there) and reads back its figures; the CLI and ``benchmarks/grpo.py`` both use this.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncsync.grpo.config import GRPOConfig
from asyncsync.grpo.loop import RunSummary, run_grpo

log = logging.getLogger(__name__)

REGIMES = ("host", "link")
LINK_RUN_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class ModeFigures:
    """One mode's run: throughput, what the sync cost the trainer per step, staleness, learning."""

    mode: str
    steps: int
    steps_per_s: float
    step_s: float          # wall time per step (the run's wall / steps)
    stall_s: float         # mean time per step the sync held the trainer (wait_snapshot + publish)
    sync_s: float          # median duration of one sync (blocking: inside the step; async: in the background)
    rollout_s: float       # mean time per step waiting for rollouts
    train_s: float         # mean time per step computing the loss and the optimizer steps
    max_version_lag: int
    superseded: int
    evictions: int         # servers evicted (no answer within a deadline) during the run
    rewards: list[float] = field(default_factory=list)

    @classmethod
    def of(cls, s: RunSummary) -> ModeFigures:
        records = s.records
        syncs = sorted(r.sync_s for r in records) or [0.0]
        return cls(mode=s.mode, steps=s.steps, steps_per_s=s.steps_per_s, step_s=s.wall_s / max(1, s.steps),
                   stall_s=statistics.mean(r.stall_s for r in records) if records else 0.0,
                   sync_s=syncs[len(syncs) // 2], rollout_s=statistics.mean(r.rollout_s for r in records) if records else 0.0,
                   train_s=statistics.mean(r.train_s for r in records) if records else 0.0,
                   max_version_lag=s.max_version_lag, superseded=int(s.sync_metrics.get("superseded", 0)),
                   evictions=sum(e.get("kind") == "evicted" for e in s.sync_metrics.get("events", [])),
                   rewards=[r.reward for r in records])

    @property
    def reward_first(self) -> float:
        return statistics.mean(self.rewards[: max(1, len(self.rewards) // 10)])

    @property
    def reward_last(self) -> float:
        return statistics.mean(self.rewards[-max(1, len(self.rewards) // 10):])

    def line(self) -> str:
        every = max(1, len(self.rewards) // 12)
        evicted = f", {self.evictions} eviction(s)" if self.evictions else ""
        return (f"[{self.mode}] {self.steps} steps, {self.steps_per_s:.2f} steps/s ({self.step_s * 1e3:.0f} ms a step: "
                f"rollouts {self.rollout_s * 1e3:.0f}, training {self.train_s * 1e3:.0f}, held by the sync "
                f"{self.stall_s * 1e3:.0f}; one sync {self.sync_s * 1e3:.0f} ms); version lag <= {self.max_version_lag}, "
                f"{self.superseded} superseded{evicted}; reward "
                f"{self.reward_first:.2f} -> {self.reward_last:.2f}: " + " ".join(f"{r:.2f}" for r in self.rewards[::every]))


@dataclass(frozen=True)
class RegimeFigures:
    """The modes run in one regime (``modes``: blocking, async, or both in that order); with both,
    the ratio, the sync's share of a blocking step, and what async hid of the most it could hide
    (the time a blocking sync holds the trainer per step)."""

    regime: str  # "host", "link 4 gbit", or "link (plain loopback: <why>)"
    modes: tuple[ModeFigures, ...]

    @property
    def compared(self) -> bool:
        return [m.mode for m in self.modes] == ["blocking", "async"]

    @property
    def blocking(self) -> ModeFigures:
        return next(m for m in self.modes if m.mode == "blocking")

    @property
    def async_(self) -> ModeFigures:
        return next(m for m in self.modes if m.mode == "async")

    @property
    def ratio(self) -> float:
        return self.async_.steps_per_s / self.blocking.steps_per_s

    @property
    def sync_share_blocking(self) -> float:
        return self.blocking.stall_s / self.blocking.step_s

    @property
    def hidden_s(self) -> float:
        return self.blocking.step_s - self.async_.step_s

    @property
    def hideable_s(self) -> float:
        return self.blocking.stall_s

    def line(self) -> str:
        return (f"{self.regime}: async vs blocking {self.ratio:.2f}x the steps/s "
                f"({self.async_.steps_per_s:.2f} vs {self.blocking.steps_per_s:.2f}); a blocking sync is "
                f"{self.sync_share_blocking:.0%} of its step, async hid {self.hidden_s * 1e3:.0f} ms of the "
                f"{self.hideable_s * 1e3:.0f} ms a step it could hide; reward {self.blocking.reward_first:.2f} -> "
                f"{self.blocking.reward_last:.2f} blocking, {self.async_.reward_first:.2f} -> {self.async_.reward_last:.2f} async")

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"regime": self.regime, "modes": [dataclasses.asdict(m) for m in self.modes]}
        if self.compared:
            out.update(ratio=self.ratio, sync_share_blocking=self.sync_share_blocking, hidden_s=self.hidden_s,
                       hideable_s=self.hideable_s)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RegimeFigures:
        return cls(data["regime"], tuple(ModeFigures(**m) for m in data["modes"]))


MEANING = ("Async hides what a blocking sync holds the trainer for, so it pays in proportion to the sync's share "
           "of a step: large where every version crosses a link (as between hosts), small on one host, where "
           "shared memory makes a sync cheap and its background work shares the cores with training.")


def run_modes(cfg: GRPOConfig, regime: str, progress: bool, modes: Sequence[bool] = (False, True)) -> RegimeFigures:
    """The ``modes`` (async_weight_update values) in order, with the same seed and all else equal."""
    figures = []
    for is_async in modes:
        run_cfg = dataclasses.replace(cfg, weight_sync=cfg.weight_sync.replace(async_weight_update=is_async))
        figures.append(ModeFigures.of(run_grpo(run_cfg, progress=progress)))
    return RegimeFigures(regime, tuple(figures))


def compare(cfg: GRPOConfig, regimes: Sequence[str], progress: bool = True, overrides: Sequence[str] = (),
            config_path: str | None = None, modes: Sequence[bool] = (False, True)) -> list[RegimeFigures]:
    """Each regime's figures, in order (``overrides`` and ``config_path``: how ``cfg`` was loaded, for
    the run inside the link's namespace)."""
    unknown = [r for r in regimes if r not in REGIMES]
    if unknown:
        raise ValueError(f"unknown regime(s) {unknown}: expected some of {list(REGIMES)}")
    out = []
    for regime in regimes:
        if regime == "host":
            out.append(run_modes(cfg, "host", progress, modes))
        else:
            out.append(on_link(cfg, progress, overrides, config_path, modes))
    return out


def on_link(cfg: GRPOConfig, progress: bool, overrides: Sequence[str], config_path: str | None,
            modes: Sequence[bool] = (False, True)) -> RegimeFigures:
    """The link regime: this module run again inside a namespace shaped as ``cfg.link_gbit``, or on
    plain loopback (saying why) where none can be made; the collective transport either way."""
    from asyncsync import netns

    link = netns.Link(cfg.link_gbit)
    with tempfile.TemporaryDirectory(prefix="asyncsync-link-") as tmp:
        out = os.path.join(tmp, "figures.json")
        settings = [*overrides, f"link_gbit={link.gbit:g}", "weight_sync.transport=collective"]
        # In the namespace no host name resolves: torch's TCPStore would warn at every connection.
        cmd = ["env", "TORCH_CPP_LOG_LEVEL=ERROR", sys.executable, "-m", "asyncsync.grpo.compare", "--out", out,
               "--regime", f"link {link.gbit:g} gbit",
               "--modes", ",".join("async" if m else "blocking" for m in modes),
               *(["--config", config_path] if config_path else []), *([] if progress else ["--quiet"]), *settings]
        done = netns.run(link, cmd, timeout_s=LINK_RUN_TIMEOUT_S)
        if done.skipped is not None:
            log.warning("cannot emulate a %s link here (%s): the link regime runs on plain loopback",
                        link.describe(), done.skipped)
            on_cfg = dataclasses.replace(cfg, weight_sync=cfg.weight_sync.replace(transport="collective"))
            return run_modes(on_cfg, f"link (plain loopback: {done.skipped})", progress, modes)
        if done.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"the run on the emulated {link.describe()} link failed (exit code {done.returncode})")
        with open(out) as f:
            return RegimeFigures.from_dict(json.load(f))


def _inside(argv: Sequence[str] | None = None) -> int:
    """Inside the link's namespace: both modes, their figures written to ``--out``."""
    import argparse

    parser = argparse.ArgumentParser(description="the link regime of asyncsync grpo --compare (run by it)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--regime", required=True)
    parser.add_argument("--config")
    parser.add_argument("--modes", default="blocking,async")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = GRPOConfig.load(args.config, args.overrides)
    figures = run_modes(cfg, args.regime, not args.quiet, [m == "async" for m in args.modes.split(",")])
    with open(args.out, "w") as f:
        json.dump(figures.as_dict(), f)
    return 0


if __name__ == "__main__":
    sys.exit(_inside())
