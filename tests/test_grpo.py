"""The GRPO demo: config loading and overrides, the mode toggle, server cleanup, and learning."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from asyncsync import ConfigError, WeightSync
from asyncsync.grpo import GRPOConfig, run_grpo
from asyncsync.testing import mixed_dtype_model

from conftest import TINY

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "configs" / "grpo_tiny.yaml"
FAST = ["steps=3", "prompts_per_step=4", "group_size=2", "simulate_step_s=0", "policy.family=qwen2",
        "policy.hidden_size=32", "policy.intermediate_size=64", "ppo_epochs=1"]


def test_demo_config_loads_and_overrides_apply():
    cfg = GRPOConfig.load(DEMO, ["steps=5", "weight_sync.async_weight_update=false", "policy.num_experts=4", "lr=1e-4"])
    assert cfg.steps == 5 and cfg.lr == 1e-4
    assert cfg.weight_sync.async_weight_update is False
    assert cfg.policy.num_experts == 4 and cfg.policy.family == "qwen2_moe"
    assert GRPOConfig.load(DEMO).weight_sync.async_weight_update is True


@pytest.mark.parametrize(
    "override, key",
    [
        ("stepz=3", "stepz"),
        ("steps=0", "steps"),
        ("group_size=1", "group_size"),
        ("temperature=0", "temperature"),
        ("lr=fast", "lr"),
        ("policy.vocab_size=10", "policy.vocab_size"),
        ("policy.family=gpt9", "policy.family"),
        ("policy.colour=red", "policy.colour"),
        ("weight_sync.async_weight_update=maybe", "weight_sync.async_weight_update"),
        ("weight_sync.bucket_bytes=huge", "weight_sync.bucket_bytes"),
        ("steps", "override 'steps'"),
    ],
)
def test_bad_configs_name_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        GRPOConfig.load(DEMO, [override])
    assert str(err.value).startswith(key), str(err.value)


@pytest.mark.parametrize("toggle", [True, False])
def test_yaml_toggle_alone_switches_modes(tmp_path, two_servers, toggle):
    """Only async_weight_update differs; async publish returns at once (None), blocking returns the result."""
    path = tmp_path / "trainer.yaml"
    urls = ", ".join(s.url for s in two_servers)
    path.write_text(f"weight_sync:\n  async_weight_update: {str(toggle).lower()}\n  servers: [{urls}]\n")
    sync = WeightSync.from_config(GRPOConfig.load(path).weight_sync)
    model = mixed_dtype_model(TINY)
    with sync:
        sync.connect(model)
        version = max(sync.server_versions.values()) + 1
        result = sync.publish(model, version)
        assert sync.is_async is toggle
        assert (result is None) is toggle
        if not toggle:
            assert set(result.server_versions.values()) == {version}
    assert set(sync.server_versions.values()) == {version}, "close() drained in async mode"


@pytest.mark.slow
def test_run_with_embedded_servers_tracks_versions():
    cfg = GRPOConfig.load(DEMO, FAST)
    summary = run_grpo(cfg)
    assert summary.steps == 3 and summary.mode == "async"
    assert summary.max_version_lag <= cfg.weight_sync.max_staleness
    assert summary.sync_metrics["published"] == 3
    assert summary.sync_metrics["sent"] + summary.sync_metrics["superseded"] == 3
    assert all(r.tokens == 4 * 2 * 3 for r in summary.records)


def _pids(text: str) -> list[int]:
    m = re.search(r"\(pids ([\d ]+)\)", text)
    assert m, f"no server pids in the output:\n{text}"
    return [int(p) for p in m.group(1).split()]


def _gone(pids: list[int], timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            return True
        time.sleep(0.2)
    return False


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "asyncsync.cli", "--log-level", "INFO", "grpo", "--config", str(DEMO), "--no-progress", *args]


@pytest.mark.slow
def test_cli_runs_and_stops_its_servers():
    out = subprocess.run(_cli(*FAST), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "[async] 3 steps" in out.stdout
    assert _gone(_pids(out.stderr))


@pytest.mark.slow
def test_cli_compares_in_both_regimes_and_says_what_the_figures_mean(tmp_path):
    """``--compare --regimes host,link``: one line per mode and one per regime; the link regime runs
    in a shaped namespace where this machine allows it (else says so and uses plain loopback), with
    the collective; ``--quiet`` prints figures only; ``--json`` holds the same figures."""
    import json

    out_json = tmp_path / "figures.json"
    out = subprocess.run([*_cli(*FAST, "link_gbit=8", "--compare", "--regimes", "host,link", "--quiet", "--json",
                                str(out_json))], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert any(line.startswith("host: async vs blocking ") for line in lines), out.stdout
    assert any(line.startswith("link") and ": async vs blocking " in line for line in lines), out.stdout
    assert "Loading weights" not in out.stderr and "FutureWarning" not in out.stderr, out.stderr[-2000:]
    figures = json.loads(out_json.read_text())["regimes"]
    assert [r["regime"].split()[0] for r in figures] == ["host", "link"]
    for regime in figures:
        assert [m["mode"] for m in regime["modes"]] == ["blocking", "async"]
        assert regime["ratio"] > 0 and 0 <= regime["sync_share_blocking"] < 1
        assert all(len(m["rewards"]) == 3 for m in regime["modes"])


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_vllm_servers_without_the_extra_say_how_to_install_it():
    out = subprocess.run(_cli(*FAST, "server_kind=vllm"), capture_output=True, text=True, timeout=120)
    assert out.returncode == 3, (out.returncode, out.stderr)
    assert "EXTRAS=vllm bash scripts/setup.sh" in out.stderr


def test_cli_bad_override_exits_2_with_the_key():
    out = subprocess.run(_cli("weight_sync.max_staleness=-1"), capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "weight_sync.max_staleness" in out.stderr


@pytest.mark.slow
def test_ctrl_c_stops_the_servers():
    proc = subprocess.Popen(_cli("steps=100000", *FAST[1:]), stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        lines = []
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            lines.append(line)
            if "embedded reference server" in line or not line:
                break
        pids = _pids("".join(lines))
        # Keep reading stderr: a child whose pipe fills up blocks in its next log line and never exits.
        rest: list[str] = []
        reader = threading.Thread(target=lambda: rest.extend(proc.stderr), daemon=True)
        reader.start()
        time.sleep(2)  # training is under way
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            pytest.fail("the demo did not exit within 60 s of a Ctrl-C; its last log lines:\n" + "".join(rest[-40:]))
        assert _gone(pids), "the embedded servers outlived a Ctrl-C"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.slow
def test_learning_raises_the_reward():
    """Fixed seed, dense tiny policy: the mean reward must rise clearly above where it starts."""
    cfg = GRPOConfig.load(DEMO, ["steps=40", "simulate_step_s=0", "policy.family=qwen2", "policy.hidden_size=64",
                                 "policy.intermediate_size=128"])
    summary = run_grpo(cfg)
    assert summary.reward_last > summary.reward_first + 0.2, [round(r.reward, 2) for r in summary.records]


@pytest.mark.slow
def test_the_demo_trains_on_two_fsdp_ranks():
    """trainer_ranks=2: the policy is fully_shard-ed over 2 spawned ranks, every rank publishes, and
    every version reaches the servers (published = sent + superseded) within max_staleness."""
    cfg = GRPOConfig.load(DEMO, FAST + ["trainer_ranks=2"])
    summary = run_grpo(cfg)
    assert summary.steps == 3 and summary.mode == "async"
    assert summary.max_version_lag <= cfg.weight_sync.max_staleness
    assert summary.sync_metrics["published"] == 3
    assert summary.sync_metrics["sent"] + summary.sync_metrics["superseded"] == 3
    assert summary.sync_metrics["failed"] == 0 and summary.sync_metrics["sent"] >= 1
