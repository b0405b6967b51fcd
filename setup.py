"""Builds asyncsync's compiled CPU pack op (csrc/pack_cpu.cpp) as ``asyncsync._pack_cpu`` at install time.

The build needs torch, so it happens only when torch is importable in the build environment: install
with ``pip install --no-build-isolation`` on top of an installed torch (scripts/setup.sh does), or
``pip wheel --no-build-isolation --no-deps .``. Under pip's default build isolation torch is absent and
this builds no extension (pip must not fetch a multi-GB CUDA torch just to build): asyncsync then
JIT-builds the op at first use from a source checkout, or packs with its pure-torch backend.
Everything else about the package is in pyproject.toml.
"""

import importlib.util
import sys
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent


def extensions():
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        print("asyncsync: torch is not importable while building (build isolation?); the C++ pack op is not "
              "built now and will be JIT-built at first use, or the pure-torch pack path is used", file=sys.stderr)
        return [], {}
    spec = importlib.util.spec_from_file_location("asyncsync_csrc_build", HERE / "csrc" / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    cflags, ldflags = build.cpu_flags(torch)
    ext = CppExtension(
        "asyncsync._pack_cpu", ["csrc/pack_cpu.cpp"], include_dirs=[str(HERE / "csrc")],
        extra_compile_args=[*cflags, "-DASYNCSYNC_PYTHON_MODULE"], extra_link_args=ldflags,
    )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
