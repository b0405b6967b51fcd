"""What every benchmark shares: the results folder, machine facts, JSON output, timing."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = RESULTS.parents[1]


def machine() -> dict[str, Any]:
    """Where the figures came from: they mean little without it."""
    return {
        "cpu_count": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
        "torch_threads": torch.get_num_threads(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def write_json(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2) + "\n")
    return path


def save(name: str, results: dict[str, Any], plot: Any) -> None:
    """``results`` as benchmarks/results/NAME.json and ``plot(results, path)`` as NAME.png; says where."""
    write_json(name, results)
    plot(results, str(RESULTS / f"{name}.png"))
    print(f"wrote {RESULTS / f'{name}.json'} and {RESULTS / f'{name}.png'}")


def vllm_python(given: str | None) -> tuple[str | None, str]:
    """The interpreter to run vLLM with (``given``, else ``$ASYNCSYNC_VLLM_PYTHON``, else the
    repository's ``.venv-vllm`` that scripts/test_vllm.sh builds), or None and why not."""
    python = given or os.environ.get("ASYNCSYNC_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
    if not Path(python).exists():
        return None, (f"vLLM rows skipped: no interpreter at {python} (build one with scripts/test_vllm.sh, or pass "
                      "--vllm-python / set ASYNCSYNC_VLLM_PYTHON)")
    check = subprocess.run([python, "-c", "import vllm"], capture_output=True, text=True, timeout=300)
    if check.returncode != 0:
        return None, f"vLLM rows skipped: vllm does not import with {python}: {check.stderr.strip()[-300:]}"
    return python, ""
