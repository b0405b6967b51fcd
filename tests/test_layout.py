"""The engines' layout from what a trainer holds (trainer/layout.py, checkpoint.py), checked against
the libraries that define it: the names and bytes ``save_pretrained`` writes (transformers' own
conversion), ``merge_and_unload`` (PEFT's own merge), and unwrapped modules. No server is involved."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file

from asyncsync.checkpoint import CheckpointStage
from asyncsync.trainer.layout import LayoutView, WeightLayout
from asyncsync.trainer.source import all_tensors

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, max_position_embeddings=128)


def family(name: str) -> torch.nn.Module:
    """A tiny random model of one MoE family that transformers 5 fuses in memory, built from a config."""
    import transformers as tf

    torch.manual_seed(0)
    if name == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                shared_expert_intermediate_size=32)
        return tf.Qwen2MoeForCausalLM(cfg)
    if name == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=32)
        return tf.Qwen3MoeForCausalLM(cfg)
    if name == "mixtral":
        return tf.MixtralForCausalLM(tf.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2))
    if name == "deepseek_v3":
        cfg = tf.DeepseekV3Config(**COMMON, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                  n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24,
                                  qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_group=1, topk_group=1)
        return tf.DeepseekV3ForCausalLM(cfg)
    raise ValueError(name)


FAMILIES = ["qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3"]


def saved(model: torch.nn.Module, tmp_path) -> dict[str, torch.Tensor]:
    model.save_pretrained(tmp_path)
    out: dict[str, torch.Tensor] = {}
    for path in sorted(tmp_path.glob("*.safetensors")):
        out.update(load_file(path))
    return out


def sent(model: torch.nn.Module, **kwargs) -> dict[str, torch.Tensor]:
    named = all_tensors(model)
    layout = WeightLayout.of(model, named, **kwargs)
    return {name: t.clone() for name, t in layout.view(named).items()}


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want), (sorted(set(got) - set(want))[:3], sorted(set(want) - set(got))[:3])
    different = [n for n in want if got[n].dtype != want[n].dtype or not torch.equal(got[n], want[n])]
    assert not different, different[:3]


@pytest.mark.parametrize("name", FAMILIES)
def test_the_sent_layout_is_what_save_pretrained_writes(name, tmp_path):
    """Built from a config and loaded with ``from_pretrained`` (which records the conversions it
    applied): either way every name and byte equals the checkpoint."""
    import transformers as tf

    model = family(name)
    checkpoint = saved(model, tmp_path)
    loaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path)
    for m in (model, loaded):
        assert_same(sent(m), checkpoint)
    fused = [n for n in all_tensors(model) if n.endswith("experts.gate_up_proj")]
    assert fused, "transformers 5 holds this family's experts fused: the case this layout exists for"


@pytest.mark.parametrize("name", ["qwen2_moe", "mixtral"])
def test_negative_control_the_trainers_own_names_are_not_the_checkpoint(name, tmp_path):
    """``layout: trainer`` (no conversion) sends the fused names: the comparison above would fail."""
    model = family(name)
    checkpoint = saved(model, tmp_path)
    got = sent(model, convert_layout=False)
    assert any(n.endswith("experts.gate_up_proj") for n in got) and not set(got) <= set(checkpoint)
    with pytest.raises(AssertionError):
        assert_same(got, checkpoint)


def allocated(layout: WeightLayout, group, named: dict[str, torch.Tensor]) -> int:
    """Bytes a real conversion of ``group`` allocates: its targets whose memory is not the source's."""
    source = named[group.sources[0]].untyped_storage().data_ptr()
    made = layout.produce(group, named).values()
    fresh = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in made}
    return sum(n for ptr, n in fresh.items() if ptr != source)


def test_a_converted_group_is_produced_when_packed_and_dropped_after_its_last_tensor():
    """Per version, the views and copies of a group exist only while its targets are being taken;
    the copies are counted (``scratch_bytes``, planned on meta tensors, equals what converting the
    real tensors allocates: the gate/up split copies each layer's experts where transformers makes
    the chunks contiguous (5.24) and is all views where it does not (5.10.4, verl's pin); down_proj
    slices are views), nothing is kept for the next version, and plain tensors are the parameters."""
    model = family("qwen2_moe")
    named = all_tensors(model)
    layout = WeightLayout.of(model, named)
    converted = [g for g in layout.groups if not g.renamed]
    assert {g.sources[0].rsplit(".", 1)[1] for g in converted} == {"gate_up_proj", "down_proj"}
    for g in converted:
        assert g.scratch_bytes == allocated(layout, g, named), g
        if g.sources[0].endswith("down_proj"):
            assert g.scratch_bytes == 0, g
        else:  # all of the source, or nothing
            assert g.scratch_bytes in (0, named[g.sources[0]].nbytes), g
    view = layout.view(named)
    assert isinstance(view, LayoutView)
    assert view["model.embed_tokens.weight"] is named["model.embed_tokens.weight"]
    gate_up = next(g for g in converted if g.sources[0].endswith("gate_up_proj"))
    first, *rest = gate_up.target_names
    expert0 = view[first].clone()  # a view of the live tensor where the split makes no copy
    assert view._made, "the group is held while its targets are taken"
    for name in rest:
        view[name]
    assert not view._made, "and dropped once the last one was"
    with torch.no_grad():
        named[gate_up.sources[0]].add_(1.0)
    assert not torch.equal(layout.view(named)[first], expert0), "the next version reads the live tensor again"


def test_groups_are_planned_whole_and_the_plan_holds_checkpoint_names():
    from asyncsync.protocol.specs import BucketPlan

    model = family("qwen2_moe")
    layout = WeightLayout.of(model, all_tensors(model))
    group_bytes = max(sum(t.nbytes for t in g.targets) for g in layout.groups)
    plan = BucketPlan.from_groups(layout.target_groups(), bucket_bytes=group_bytes + 1000)
    where = {s.name: b.index for b in plan.buckets for s in b.specs}
    for g in layout.groups:
        assert len({where[n] for n in g.target_names}) == 1, f"{g.sources} split across buckets"
    assert not any("gate_up_proj" in n for n in where)
    in_bucket: dict[int, int] = {}
    for g in layout.groups:
        in_bucket[where[g.target_names[0]]] = in_bucket.get(where[g.target_names[0]], 0) + g.scratch_bytes
    assert layout.scratch_bytes(plan) == max(in_bucket.values()), "the most any one bucket's groups allocate"


def lora(model: torch.nn.Module, **kwargs) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, **kwargs))


def dense() -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    return tf.Qwen2ForCausalLM(tf.Qwen2Config(**COMMON))


def test_a_peft_model_sends_merge_and_unload_s_weights_and_stays_unmerged(tmp_path):
    """The merged weights under the base model's names, equal to PEFT's own ``merge_and_unload``
    (modules_to_save included); the trainer's module is neither merged nor changed."""
    pytest.importorskip("peft")
    model = lora(dense(), modules_to_save=["lm_head"])
    with torch.no_grad():
        model.base_model.model.lm_head.modules_to_save.default.weight.mul_(2)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    got = sent(model)
    assert_same(got, copy.deepcopy(model).merge_and_unload().state_dict())
    assert not any(layer.merged for layer in model.modules() if hasattr(layer, "merged"))
    assert all(torch.equal(t, before[n]) for n, t in model.state_dict().items())
    base_names = set(saved(dense(), tmp_path))
    assert set(got) == base_names, "the base checkpoint's names"


def test_a_merged_adapter_is_not_added_twice():
    pytest.importorskip("peft")
    model = lora(dense())
    want = copy.deepcopy(model).merge_and_unload().state_dict()
    model.merge_adapter()  # as TRL does around its own sync
    assert_same(sent(model), want)


def test_dora_is_refused_with_what_to_do():
    pytest.importorskip("peft")
    from asyncsync.checkpoint import LayoutError

    model = lora(dense(), use_dora=True)
    with pytest.raises(LayoutError, match="does not merge"):
        WeightLayout.of(model, all_tensors(model))


def test_wrappers_are_stripped_the_same_way(tmp_path):
    """torch.compile's ``_orig_mod.``, activation checkpointing's ``_checkpoint_wrapped_module.`` and
    DDP's ``module.``: the names are the checkpoint's, the bytes the model's."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = family("qwen2_moe")
    checkpoint = saved(model, tmp_path)
    compiled = torch.compile(model)
    assert any(n.startswith("_orig_mod.") for n in all_tensors(compiled))
    assert_same(sent(compiled), checkpoint)
    wrapped = copy.deepcopy(model)
    for i, layer in enumerate(wrapped.model.layers):
        wrapped.model.layers[i] = checkpoint_wrapper(layer)
    assert any("_checkpoint_wrapped_module" in n for n in all_tensors(wrapped))
    assert_same(sent(wrapped), checkpoint)
    assert_same(sent(ddp(model)), checkpoint)


def ddp(model: torch.nn.Module) -> torch.nn.Module:
    """``DistributedDataParallel`` over a world of one (a gloo group of this process alone)."""
    import torch.distributed as dist

    from asyncsync.protocol.group import free_port

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    wrapped = torch.nn.parallel.DistributedDataParallel(model)
    assert any(n.startswith("module.") for n in all_tensors(wrapped))
    return wrapped


def test_the_reference_server_loads_the_checkpoint_layout_as_transformers_does(tmp_path):
    """The reference server's receiver turns a version in the checkpoint layout back into the fused
    tensors its module holds, with transformers' own load conversion (the reverse of its reverse)."""
    from asyncsync.checkpoint import to_memory

    model = family("mixtral")
    checkpoint = saved(model, tmp_path)
    memory = to_memory(model, checkpoint)
    assert_same(memory, {n: t for n, t in model.state_dict().items()})
    assert CheckpointStage(model)(memory).keys() == checkpoint.keys()


def test_a_reference_server_started_for_the_trainer_layout_takes_it_without_conversion():
    """``asyncsync serve --layout trainer`` (what the GRPO demo starts for ``layout: trainer``): a
    transformers-5 MoE's fused experts arrive as the trainer holds them and are swapped in as they
    are (no conversion group), bit-exact; a trainer sending the checkpoint layout to it is refused
    at connect, and a server expecting the checkpoint layout refuses the trainer's."""
    from asyncsync import WeightSync
    from asyncsync.config import ConfigError
    from asyncsync.models import ModelConfig, build_model
    from asyncsync.receivers.reference.app import ReferenceServer

    from helpers import ThreadedServer, digest, weights

    cfg = ModelConfig(family="qwen2_moe", vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=1,
                      num_heads=2, num_kv_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    trainer = build_model(cfg)
    assert any(n.endswith("experts.gate_up_proj") for n in trainer.state_dict()), "fused in memory"
    sync_cfg = {"bucket_bytes": "64KiB", "transport": "collective"}
    server = ReferenceServer(build_model(cfg), layout="trainer")
    assert all(g.renamed for g in server.receiver.groups), "nothing is converted"
    with ThreadedServer(server) as served:
        with WeightSync.from_config({**sync_cfg, "servers": [{"url": served.url}], "layout": "trainer"}) as sync:
            sync.connect(trainer)
            want = weights(trainer, seed=3)
            assert sync.publish(trainer, 1).server_versions == {served.url: 1}
        assert server.receiver.version == 1
        assert digest(server.model) == digest(want)
        with WeightSync.from_config({**sync_cfg, "servers": [{"url": served.url}]}) as sync:
            with pytest.raises(ConfigError, match="would refuse every version"):
                sync.connect(trainer)
    with ThreadedServer(ReferenceServer(build_model(cfg))) as served:
        with WeightSync.from_config({**sync_cfg, "servers": [{"url": served.url}], "layout": "trainer"}) as sync:
            with pytest.raises(ConfigError, match="experts.gate_up_proj"):
                sync.connect(trainer)
