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
    """A YAML file's mapping, or a JSON file's (``.json``: YAML 1.1 would read ``1e-05`` as a string)."""
    if not path:
        return {}
    with open(path) as f:
        return (json.load(f) if path.endswith(".json") else yaml.safe_load(f)) or {}


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

    from asyncsync.config import ConfigError, WeightSyncConfig
    from asyncsync.packing.native import status
    from asyncsync.protocol.device import CudaRuntime, HostRuntime

    print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
    print(f"data-plane backend (auto): {HostRuntime.wire_backend} for CPU weights, {CudaRuntime.wire_backend} for CUDA weights")
    for key, value in status().items():
        print(f"{key}: {value}")
    if not args.model_config:
        return 0
    try:
        data = _load_yaml(args.model_config)
        sync_data = _load_yaml(args.config)
        sync_cfg = WeightSyncConfig.from_dict({**sync_data.get("weight_sync", sync_data), "servers": ["http://unused"]})
        if "model_type" in data:  # a Hugging Face config.json: planned on meta tensors, nothing allocated
            from transformers import AutoConfig, AutoModelForCausalLM

            hf = AutoConfig.for_model(**data)
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(hf, dtype=getattr(torch, str(data.get("torch_dtype", data.get("dtype", "bfloat16")))))
        else:
            from asyncsync.models import ModelConfig, build_model

            model = build_model(ModelConfig.from_dict(data.get("policy", data.get("model", data))))
    except (ConfigError, OSError, ValueError, TypeError, AttributeError) as e:
        print(f"asyncsync doctor: bad configuration: {e}", file=sys.stderr)
        return 2
    model_bytes = sum(t.nbytes for t in model.state_dict().values())
    if model.device.type != "meta":
        _doctor_trainer(model, model_bytes, sync_cfg)
    _doctor_receivers(model_bytes, args.tp, sync_cfg.bucket_bytes, args.gpus_per_node)
    return 0


def _doctor_trainer(model: Any, model_bytes: int, sync_cfg: Any) -> None:
    from asyncsync.trainer.allocate import sync_memory

    print(f"sync memory for this model ({model_bytes / 1e6:.1f} MB of weights, bucket_bytes {sync_cfg.bucket_bytes}), "
          "one trainer process (a sharded trainer's rank: its local shards instead of the model, docs/sharded.md):")
    for mode, b in sync_memory(sync_cfg, model).items():
        print(f"  {mode:13s} {b['device'] / 1e6:9.1f} MB on the weights' device, {b['host'] / 1e6:9.1f} MB host, "
              f"{b['conversion'] / 1e6:.1f} MB at most for converting to the engines' layout")


GPU_GB = (80, 141)
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default


def _doctor_receivers(model_bytes: int, tp: int, bucket_bytes: int, gpus_per_node: int) -> None:
    """What each vLLM staging choice adds per GPU and per node, beside the weights each GPU holds and
    the room left for the KV cache on an 80 GB and a 141 GB GPU (docs/engines/vllm.md, "Memory")."""
    from asyncsync.protocol.arena import STAGINGS, StagingCost

    weights = model_bytes / tp
    print(f"vLLM receivers of this model ({model_bytes / 1e9:.1f} GB of weights), tensor parallel {tp}, "
          f"{gpus_per_node} GPUs per node, bucket_bytes {bucket_bytes / 2**20:.0f} MiB: staging adds "
          f"(weights per GPU {weights / 1e9:.1f} GB; KV-cache room is {GPU_MEMORY_UTILIZATION} x the GPU - weights - "
          "staging, before activations)")
    for staging in STAGINGS:
        cost = StagingCost.of(staging, model_bytes, tp, bucket_bytes, gpus_per_node)
        room = []
        for gb in GPU_GB:
            left = GPU_MEMORY_UTILIZATION * gb * 1e9 - weights - cost.device_per_gpu
            room.append(f"{left / 1e9:.1f} GB on {gb} GB" if left > 0 else f"does not fit {gb} GB")
        where = "on the stager's GPU (0 on the others)" if staging == "host" else "on every GPU"
        print(f"  {staging:7s} {cost.device_per_gpu / 1e9:8.2f} GB {where}, {cost.host_per_node / 1e9:6.1f} GB host per "
              f"node; KV room {', '.join(room)}")


def parser() -> argparse.ArgumentParser:
    """``asyncsync serve | grpo | doctor`` and their options."""
    top = argparse.ArgumentParser(prog="asyncsync", description=__doc__)
    top.add_argument("--log-level", default=os.environ.get("ASYNCSYNC_LOG_LEVEL", "INFO"))
    sub = top.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_grpo(sub)
    _add_doctor(sub)
    return top


def _add_serve(sub: Any) -> None:
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


def _add_grpo(sub: Any) -> None:
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


def _add_doctor(sub: Any) -> None:
    doctor = sub.add_parser("doctor", help="report which pack, checksum and data-plane paths are active, and the "
                                           "memory the sync allocates for a model")
    doctor.add_argument("--model-config", help="YAML with a model shape ('policy:' or 'model:' section, or the fields), "
                                               "or a Hugging Face config.json (built on meta tensors, nothing allocated): "
                                               "print the bytes the sync and its receivers need for it")
    doctor.add_argument("--config", help="YAML with the weight_sync settings (a 'weight_sync:' section or the fields)")
    doctor.add_argument("--tp", type=int, default=1, help="the servers' tensor parallelism, for their staging's memory")
    doctor.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per server node (host staging: a copy per engine)")
    doctor.set_defaults(fn=cmd_doctor)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
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
    if "asyncsync.launch.vllm" in sys.modules:
        sys.modules["asyncsync.launch.vllm"].kill_all()
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
