"""Where the compiled pack paths come from: the checkout's ``csrc/`` sources, their build flags, and
the CUDA compiler. Shared by the CPU op's loader (``native``) and the CUDA kernel's (``cuda``), which
otherwise know nothing of each other."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from types import ModuleType

CSRC = Path(__file__).resolve().parents[2] / "csrc"  # present in a source checkout only
CPU_SOURCE = CSRC / "pack_cpu.cpp"
CUDA_SOURCE = CSRC / "pack_cuda.cu"
HEADERS = (CSRC / "crc32c.h", CSRC / "delta.h")  # included by both sources


def build_helpers() -> ModuleType:
    """csrc/build.py: the compiler flags setup.py uses too."""
    spec = importlib.util.spec_from_file_location("asyncsync_csrc_build", CSRC / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def nvcc_path() -> str | None:
    """The CUDA compiler: ``$CUDA_HOME/bin/nvcc`` as torch finds it, else ``nvcc`` on the PATH."""
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME and (Path(CUDA_HOME) / "bin" / "nvcc").exists():
        return str(Path(CUDA_HOME) / "bin" / "nvcc")
    return shutil.which("nvcc")
