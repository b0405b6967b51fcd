"""``asyncsync`` command line: ``grpo`` (the demo), ``serve`` (the reference server), ``doctor``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from typing import Any

import yaml


def _load_yaml(path: str | None) -> dict[str, Any]:
    if not path:
        return {}
    with open(path) as f:
        return yaml.safe_load(f) or {}


def cmd_serve(args: argparse.Namespace) -> int:
    from asyncsync.models import ModelConfig, build_model
    from asyncsync.receivers.reference.app import TRAINER_LEASE_S, run_server

    data = _load_yaml(args.model_config)
    data = data.get("model", data)
    if args.seed is not None:
        data["seed"] = args.seed
    model = build_model(ModelConfig.from_dict(data))
    token = args.token or os.environ.get("ASYNCSYNC_TOKEN") or None
    logging.getLogger("asyncsync").info("serving on http://%s:%d (auth %s)", args.host, args.port, "on" if token else "off")
    lease = TRAINER_LEASE_S if args.trainer_lease_s is None else args.trainer_lease_s
    run_server(model, args.host, args.port, token, trainer_lease_s=lease, max_version_bytes=args.max_version_bytes,
               layout=args.layout, staging=args.staging)
    return 0


def cmd_grpo(args: argparse.Namespace) -> int:
    from asyncsync.config import ConfigError
    from asyncsync.grpo import GRPOConfig
    from asyncsync.grpo.compare import MEANING, REGIMES, compare
    from asyncsync.grpo.loop import VllmMissing

    overrides = list(args.overrides) + ([f"link_gbit={args.link_gbit}"] if args.link_gbit else [])
    regimes = [r.strip() for r in args.regimes.split(",") if r.strip()]
    try:
        cfg = GRPOConfig.load(args.config, overrides)
        unknown = [r for r in regimes if r not in REGIMES]
        if unknown:
            raise ConfigError(f"--regimes: unknown regime(s) {unknown}: expected some of {list(REGIMES)}")
    except (ConfigError, OSError, ValueError) as e:
        print(f"asyncsync grpo: bad configuration: {e}", file=sys.stderr)
        return 2
    modes = (False, True) if args.compare else (cfg.weight_sync.async_weight_update,)
    try:  # what fails from here on is the run's own error, with its traceback
        figures = compare(cfg, regimes, not (args.quiet or args.no_progress), overrides, args.config, modes)
    except VllmMissing as e:
        print(f"asyncsync grpo: {e}", file=sys.stderr)
        return 3
    for regime in figures:
        for mode in regime.modes:
            print(f"{regime.regime} {mode.line()}")
    if args.compare:
        for regime in figures:
            print(regime.line())
        print(MEANING)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"regimes": [r.as_dict() for r in figures]}, f, indent=2)
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    import torch

    from asyncsync.packing.native import status
    from asyncsync.protocol.device import CudaRuntime, HostRuntime

    print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
    print(f"data-plane backend (auto): {HostRuntime.wire_backend} for CPU weights, {CudaRuntime.wire_backend} for CUDA weights")
    for key, value in status().items():
        print(f"{key}: {value}")
    if args.model_config:
        from asyncsync.config import ConfigError, WeightSyncConfig
        from asyncsync.models import ModelConfig, build_model
        from asyncsync.trainer.sync import WeightSync

        try:
            data = _load_yaml(args.model_config)
            model_cfg = ModelConfig.from_dict(data.get("policy", data.get("model", data)))
            sync_data = _load_yaml(args.config)
            sync_cfg = WeightSyncConfig.from_dict({**sync_data.get("weight_sync", sync_data), "servers": ["http://unused"]})
        except (ConfigError, OSError) as e:
            print(f"asyncsync doctor: bad configuration: {e}", file=sys.stderr)
            return 2
        model = build_model(model_cfg)
        model_bytes = sum(t.nbytes for t in model.state_dict().values())
        print(f"sync memory for this model ({model_bytes / 1e6:.1f} MB of weights, bucket_bytes {sync_cfg.bucket_bytes}), "
              "one trainer process (a sharded trainer's rank: its local shards instead of the model, docs/sharded.md):")
        for mode, b in WeightSync(sync_cfg).memory(model).items():
            print(f"  {mode:13s} {b['device'] / 1e6:9.1f} MB on the weights' device, {b['host'] / 1e6:9.1f} MB host, "
                  f"{b['conversion'] / 1e6:.1f} MB at most for converting to the engines' layout")
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
    serve.add_argument("--trainer-lease-s", type=float,
                       help="seconds without a call after which a trainer that still holds this server (hung) "
                            "loses it to another trainer's connect; a crashed or closed trainer loses it at once "
                            "(default 120)")
    serve.add_argument("--max-version-bytes", type=int,
                       help="the most bytes one announced version may make this server allocate to receive it; "
                            "larger announcements are refused before anything is allocated (default: the served "
                            "model's size, exactly what a valid version holds)")
    serve.add_argument("--layout", choices=["checkpoint", "trainer"], default="checkpoint",
                       help="the layout versions arrive in: checkpoint (what every engine loads: transformers' "
                            "checkpoint names, a MoE's experts one by one) or trainer (the model's own in-memory "
                            "names and layouts, for a trainer with layout: trainer; nothing is converted)")
    serve.add_argument("--staging", choices=["device", "host"], default="device",
                       help="where a version is held while it is received and verified: device (a second copy "
                            "beside the live weights, swapped in: generation is held only for pointer moves) or "
                            "host (one copy in host shared memory, copied into the live weights while generation "
                            "is held); docs/engines/reference.md")
    serve.set_defaults(fn=cmd_serve)

    grpo = sub.add_parser("grpo", help="run the GRPO demo (embedded reference servers unless servers are configured)",
                          description="GRPO on two-digit addition; rollouts from the inference servers, weights moved by asyncsync.")
    grpo.add_argument("--config", default=None, help="YAML file (e.g. configs/grpo_tiny.yaml); defaults apply without it")
    grpo.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                      help="override any setting, e.g. weight_sync.async_weight_update=false steps=20")
    grpo.add_argument("--compare", action="store_true", help="run blocking then async sync and compare throughput")
    grpo.add_argument("--regimes", default="host",
                      help="host (servers on this machine, as they are), link (as if on other hosts: every version "
                           "crosses an emulated link of link_gbit), or host,link (default: host)")
    grpo.add_argument("--link-gbit", type=float, help="the link regime's rate in gbit/s (overrides link_gbit)")
    grpo.add_argument("--no-progress", action="store_true", help="no progress bar")
    grpo.add_argument("--quiet", action="store_true", help="no progress bars and no log lines: only the figures")
    grpo.add_argument("--json", help="also write every regime's and mode's figures here")
    grpo.set_defaults(fn=cmd_grpo)

    doctor = sub.add_parser("doctor", help="report which pack, checksum and data-plane paths are active, and the "
                                           "memory the sync allocates for a model")
    doctor.add_argument("--model-config", help="YAML with a model shape ('policy:' or 'model:' section, or the fields): "
                                               "print the bytes the sync allocates for it in each mode")
    doctor.add_argument("--config", help="YAML with the weight_sync settings (a 'weight_sync:' section or the fields)")
    doctor.set_defaults(fn=cmd_doctor)

    args = parser.parse_args(argv)
    level = "WARNING" if getattr(args, "quiet", False) else args.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, _on_interrupt)
    try:
        return args.fn(args)
    except KeyboardInterrupt:
        print(f"asyncsync {args.command}: interrupted", file=sys.stderr)
        return 130


def _exit_now() -> None:
    """Kill the child processes (embedded servers, vLLM servers, trainer ranks) and exit without
    further clean-up."""
    import multiprocessing

    for child in multiprocessing.active_children():
        child.kill()
    if "asyncsync.receivers.vllm.launch" in sys.modules:
        sys.modules["asyncsync.receivers.vllm.launch"].kill_all()
    os._exit(130)


CLEANUP_S = 30.0
_interrupted = threading.Event()  # after a Ctrl-C, how long the clean-up (drain, servers stopped) may take before exiting anyway


def _on_interrupt(signum: int, frame: Any) -> None:
    """Ctrl-C: raise KeyboardInterrupt so everything is cleaned up (servers stopped, segments removed);
    if that clean-up is still running ``CLEANUP_S`` later, or on a second Ctrl-C, exit at once."""
    if _interrupted.is_set():
        _exit_now()
    _interrupted.set()
    timer = threading.Timer(CLEANUP_S, _exit_now)
    timer.daemon = True
    timer.start()
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
