"""examples/trl_grpo.py stops the vLLM server it started when it is interrupted (Ctrl-C) mid-training.
Selected with ``-m vllm`` (scripts/test_vllm.sh)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "trl_grpo.py"


def answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url + "/health", timeout=2).close()
        return True
    except (urllib.error.URLError, OSError):
        return False


def default_ctrl_c() -> None:
    """In the child, before it runs: a process started from a shell's background job inherits
    SIGINT ignored, and Python then installs no KeyboardInterrupt handler; a terminal's Ctrl-C
    reaches the example with the default."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_stops_the_examples_vllm_server(tmp_path):
    pytest.importorskip("vllm", reason="vllm is not installed here: run scripts/test_vllm.sh")
    pytest.importorskip("trl", reason="TRL is not installed here: run scripts/test_vllm.sh (the trl extra)")
    log = tmp_path / "example.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, str(EXAMPLE), "--steps", "200"], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=default_ctrl_c)
    url = None
    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and proc.poll() is None:
            found = re.search(r"starting vLLM at (http://\S+)", log.read_text(errors="replace"))
            url = url or (found.group(1) if found else None)
            if url and "asyncsync/sync_s" in log.read_text(errors="replace"):  # training, synced at least once
                break
            time.sleep(1)
        assert proc.poll() is None and url and answers(url), log.read_text(errors="replace")[-3000:]
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in its terminal sends
        assert proc.wait(120) != 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    deadline = time.monotonic() + 30
    while url and answers(url) and time.monotonic() < deadline:
        time.sleep(1)
    assert url and not answers(url), "the example left its vLLM server running"
