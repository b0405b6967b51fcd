"""Tied weights (``lm_head.weight`` tied to ``model.embed_tokens.weight``): which names the trainer
sends, decided from the model's ties and the names the servers expect, so that a tied model may be
published as the module or as a detached copy of its state dict."""

from __future__ import annotations

import dataclasses
import json
import urllib.request

import pytest
import torch

from asyncsync import WeightSync
from asyncsync.config import ConfigError
from asyncsync.models import build_model, generate
from asyncsync.receivers.reference.app import ReferenceServer
from asyncsync.trainer.source import LayoutChanged, TiedNames

from conftest import TINY
from helpers import ThreadedServer, digest

TIED = dataclasses.replace(TINY, family="llama", tie_word_embeddings=True)
ALIAS = {"lm_head.weight": "model.embed_tokens.weight"}
PROMPT = [3, 14, 15, 92, 65]


def detached(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the state dict that shares no storage: a tied weight appears under both names."""
    return {name: t.clone() for name, t in model.state_dict().items()}


def perturb(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5)


def test_tied_names_come_from_the_model_and_the_servers():
    model = build_model(TIED)
    assert TiedNames.decide(model, None).unsent == ALIAS
    assert TiedNames.decide(model, {"model.embed_tokens.weight"}).unsent == ALIAS
    assert TiedNames.decide(model, {"lm_head.weight"}).unsent == {}, "a server that expects the name gets it"
    wrapped = torch.nn.Module()
    wrapped.policy = model
    assert TiedNames.decide(wrapped, None).unsent == {"policy.lm_head.weight": "policy.model.embed_tokens.weight"}
    # A detached copy shares no storage and declares nothing: only the module's declaration knows the tie.
    assert TiedNames.decide(detached(model), None).unsent == {}
    assert TiedNames.decide(build_model(dataclasses.replace(TIED, tie_word_embeddings=False)), None).unsent == {}
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # declared, not shared
    assert TiedNames.decide(model, None).unsent == ALIAS

    ties = TiedNames(ALIAS)
    assert set(detached(model)) - set(ties.drop(detached(model))) == {"lm_head.weight"}
    reshaped = {**detached(model), "lm_head.weight": torch.zeros(3)}
    assert "lm_head.weight" in ties.drop(reshaped), "a name that is no longer that tie is kept, never dropped"


@pytest.mark.parametrize("async_weight_update", [False, True], ids=["blocking", "async"])
def test_a_tied_model_is_published_as_the_module_or_as_a_detached_state_dict(async_weight_update):
    trainer = build_model(TIED)
    with ThreadedServer(ReferenceServer(build_model(TIED))) as server:
        names = json.load(urllib.request.urlopen(server.url + "/weights/names", timeout=10))["names"]
        assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
        cfg = {"servers": [server.url], "bucket_bytes": "16KiB", "async_weight_update": async_weight_update,
               "max_staleness": 0}
        with WeightSync.from_config(cfg) as sync:
            sync.connect(trainer)
            assert "lm_head.weight" not in {s.name for s in sync.plan.specs}
            for version, publish_as in ((1, lambda m: m), (2, detached), (3, lambda m: m.state_dict())):
                perturb(trainer, version)
                sync.wait_snapshot()
                sync.publish(publish_as(trainer), version)
                assert sync.wait_for_fresh_servers(version, timeout=60)
                assert sync.server_versions == {server.url: version}, sync.events
                assert server.server.receiver.digest()[1] == {n: d for n, d in digest(trainer).items() if n in names}
                served = server.server.receiver.version, generate(server.server.model, PROMPT, 12)
                assert served == (version, generate(trainer, PROMPT, 12))
        assert sync.errors == [] and sync.metrics.sent == 3


def test_a_tensor_no_server_expects_is_still_refused_by_the_server():
    trainer = build_model(TIED)
    with ThreadedServer(ReferenceServer(build_model(TIED))) as server:
        cfg = {"servers": [server.url]}
        with WeightSync.from_config(cfg) as sync:
            sync.connect(trainer)
            with pytest.raises(LayoutChanged, match="'lm_head.weight' was not in the plan"):
                sync.publish({**detached(trainer), "lm_head.weight": torch.zeros(3)}, 1)
        # Connected with a mapping that names an unknown tensor: the server says at connect it would
        # refuse every version, naming both (a mapping declares no tie, so lm_head is sent too).
        unknown = {**detached(trainer), "model.no_such.weight": torch.zeros(4)}
        with WeightSync.from_config(cfg) as sync:
            with pytest.raises(ConfigError, match="would refuse every version") as refused:
                sync.connect(unknown)
        assert "2 tensor(s) sent that it does not load, e.g. 'lm_head.weight', 'model.no_such.weight'" in str(refused.value)
        assert server.server.receiver.version == 0


def test_a_server_that_expects_the_tied_name_gets_it():
    """A server whose checkpoint stores the head separately (an untied model) expects
    ``lm_head.weight``: the tied trainer sends it, and the server then decodes as the trainer does."""
    trainer = build_model(TIED)
    with ThreadedServer(ReferenceServer(build_model(dataclasses.replace(TIED, tie_word_embeddings=False)))) as server:
        with WeightSync.from_config({"servers": [server.url]}) as sync:
            sync.connect(trainer)
            assert {"lm_head.weight", "model.embed_tokens.weight"} <= {s.name for s in sync.plan.specs}
            perturb(trainer, 1)
            assert sync.publish(trainer, 1).server_versions == {server.url: 1}
        assert generate(server.server.model, PROMPT, 12) == generate(trainer, PROMPT, 12)
