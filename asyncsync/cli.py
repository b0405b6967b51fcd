"""``asyncsync`` command line: ``serve`` the reference server, ``doctor`` for what this install can do."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

import yaml


def _load_yaml(path: str | None) -> dict[str, Any]:
    if not path:
        return {}
    with open(path) as f:
        return yaml.safe_load(f) or {}


def cmd_serve(args: argparse.Namespace) -> int:
    from asyncsync.models import ModelConfig, build_model
    from asyncsync.server.app import run_server

    data = _load_yaml(args.model_config)
    data = data.get("model", data)
    if args.seed is not None:
        data["seed"] = args.seed
    model = build_model(ModelConfig.from_dict(data))
    token = args.token or os.environ.get("ASYNCSYNC_TOKEN") or None
    logging.getLogger("asyncsync").info("serving on http://%s:%d (auth %s)", args.host, args.port, "on" if token else "off")
    run_server(model, args.host, args.port, token)
    return 0


def cmd_doctor(_args: argparse.Namespace) -> int:
    import torch

    from asyncsync.dataplane import resolve_backend
    from asyncsync.packing import get_backend

    print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
    print(f"data-plane backend (auto): {resolve_backend('auto')}")
    print(f"pack backend (auto, cpu): {get_backend('auto', 'cpu').name}")
    try:
        from asyncsync.csrc import status
    except ImportError as e:
        print(f"C++ extension: unavailable ({e})")
    else:
        for key, value in status().items():
            print(f"{key}: {value}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asyncsync", description=__doc__)
    parser.add_argument("--log-level", default=os.environ.get("ASYNCSYNC_LOG_LEVEL", "INFO"))
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the reference inference server")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--model-config", help="YAML with the model shape (a 'model:' section or the fields)")
    serve.add_argument("--seed", type=int, help="initial weights' seed (overrides the config)")
    serve.add_argument("--token", help="require 'Authorization: Bearer TOKEN' (or set ASYNCSYNC_TOKEN)")
    serve.set_defaults(fn=cmd_serve)

    doctor = sub.add_parser("doctor", help="report which pack, checksum and data-plane paths are active")
    doctor.set_defaults(fn=cmd_doctor)

    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
