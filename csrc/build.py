"""Compiler flags for csrc/pack_cpu.cpp, shared by setup.py (the install-time build) and the JIT
fallback in asyncsync/packing/native.py, so both builds are the same op."""

from __future__ import annotations

import platform
from typing import Any


def cpu_flags(torch: Any) -> tuple[list[str], list[str]]:
    """(compile flags, link flags): -O3, SSE4.2 for the crc32 instruction on x86, and OpenMP when torch
    uses it (without -fopenmp ATen's parallel_for would silently run on one thread)."""
    cflags = ["-O3", "-std=c++17"]
    if platform.machine().lower() in ("x86_64", "amd64"):
        cflags.append("-msse4.2")
    ldflags = []
    if torch._C.has_openmp:
        cflags.append("-fopenmp")
        ldflags.append("-fopenmp")
    return cflags, ldflags
