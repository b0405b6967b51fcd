"""SGLang servers outlive trainers and refuse requests: a restarted trainer meets no group name or
update session of the one before, a refusal before the receive costs no collective deadline, and a
server setup SGLang cannot update is refused at connect. The servers are reference servers speaking
SGLang 0.5.23's API (tests/test_sglang_conformance.py runs the same against SGLang's own code)."""

from __future__ import annotations

import asyncio
import re
import time

import pytest
import torch
from aiohttp import web

from asyncsync import WeightSync, WeightSyncConfig
from asyncsync.engines.base import UnsupportedServer
from asyncsync.engines.sglang import data_plane_ranks
from asyncsync.models import build_model
from asyncsync.receivers.reference.app import ReferenceServer

from conftest import TINY, serve_every_path
from fakes import RefuseBeforeReceive
from helpers import ThreadedServer, Trainer, call, digest, live_version, sglang_config, weights

GROUP = re.compile(r"asyncsync\.(\d+)\.[0-9a-f]{16}")  # <group_name>.<epoch>.<random>


def test_a_restarted_trainer_meets_no_group_or_session_of_the_one_before():
    with ThreadedServer(ReferenceServer(build_model(TINY))) as server:
        groups = server.server.sglang.scheduler.groups  # SGLang's groups by name, as the server holds them
        model = build_model(TINY)
        first = Trainer(sglang_config(server.url))
        assert first.publish(weights(model, 1), 1) == {server.url: 1}
        (epoch1,) = groups
        assert GROUP.fullmatch(epoch1).group(1) == "1"
        first.fleet.epochs.rebuild()  # a new epoch destroys the group of the one before
        (epoch2,) = groups
        assert GROUP.fullmatch(epoch2).group(1) == "2" and epoch2 != epoch1

        # The first trainer dies in the middle of a version: its group and its session stay behind.
        assert call(server.url, "POST", "/begin_weight_update", {})[0] == 200
        first.fleet.epochs.drop()
        for engine in first.fleet.engines:
            first.control.run(engine.http.close())
        first.control.close()

        named = weights(model, 2)
        with WeightSync(sglang_config(server.url)) as second:
            second.connect(model)
            (mine,) = set(groups) - {epoch2}
            assert GROUP.fullmatch(mine).group(1) == "1" and mine != epoch1, "a new session, a new name"
            assert second.publish(named, 2).server_versions == {server.url: 2}
            assert server.server.receiver.digest() == (2, digest(named))
            assert live_version(server.url) == "2"
        assert set(groups) == {epoch2}, "a trainer that closes destroys its group; a dead one's stays"
        assert not server.server.sglang.session_open and not server.server.sglang.paused


def test_a_refusal_before_the_receive_costs_no_collective_deadline():
    """Two servers share one group; one refuses a version before receiving its first bucket. The
    trainer must not wait for the broadcast's deadline (at least 30 s here), and the next version
    must reach both, bit-exact."""
    with ThreadedServer(ReferenceServer(build_model(TINY))) as a, ThreadedServer(ReferenceServer(build_model(TINY))) as b:
        refusing = RefuseBeforeReceive(a.server.sglang.scheduler)
        a.server.sglang.scheduler = refusing
        cfg = WeightSyncConfig.from_dict({
            "servers": [{"url": a.url, "kind": "sglang"}, {"url": b.url, "kind": "sglang"}], "bucket_bytes": "16KiB",
            "deadlines": {"collective_s": 60, "broadcast_floor_s": 30, "rendezvous_s": 30, "http_s": 30},
        })
        model = build_model(TINY)
        with WeightSync(cfg) as sync:
            sync.connect(model)
            assert len(sync.plan.buckets) > 2
            refusing.arm()
            start = time.monotonic()
            result = sync.publish(weights(model, 1), 1)
            took = time.monotonic() - start
            assert took < 10, f"the refused version held the trainer {took:.1f}s (a broadcast may take 30 s)"
            assert "Failed to receive weights: Group asyncsync." in result.failures[a.url], result.failures
            assert ("refused", a.url) in [(e.kind, e.server) for e in sync.events]
            assert "evicted" not in [e.kind for e in sync.events], "a server that answered no is not evicted"

            named = weights(model, 2)
            assert sync.publish(named, 2).server_versions == {a.url: 2, b.url: 2}
        for server in (a, b):
            assert server.server.receiver.digest() == (2, digest(named))
            assert not server.server.sglang.session_open and not server.server.sglang.paused


@pytest.mark.parametrize("info, ranks", [
    ({"tp_size": 2, "pp_size": 1, "dp_size": 1, "attn_dp_size": 1}, 2),
    ({"tp_size": 4, "dp_size": 1, "attn_dp_size": 2, "enable_dp_attention": True}, 4),  # attention DP, 0.5.22+
    ({"tp_size": 4, "dp_size": 2, "enable_dp_attention": True}, 4),                    # the same, as 0.5.20-0.5.21 say it
], ids=["tp", "attention-dp", "attention-dp-0.5.21"])
def test_every_tp_rank_joins_the_group(info, ranks):
    assert data_plane_ranks("http://s", info) == ranks


@pytest.mark.parametrize("info, words", [
    ({"tp_size": 1, "dp_size": 2, "attn_dp_size": 1, "enable_dp_attention": False}, "dp_size=2 data-parallel replicas"),
    ({"tp_size": 2, "dp_size": 2, "attn_dp_size": 2, "enable_dp_attention": True}, "dp_size=2 data-parallel replicas"),
    ({"tp_size": 1, "dp_size": 2, "enable_dp_attention": False}, "dp_size=2 data-parallel replicas"),
    ({"tp_size": 1, "pp_size": 2, "dp_size": 1, "attn_dp_size": 1}, "pp_size=2 pipeline stages"),
], ids=["replicas", "replicas-of-attention-dp", "replicas-0.5.21", "pipeline"])
def test_setups_sglang_cannot_update_are_named(info, words):
    with pytest.raises(UnsupportedServer, match=words):
        data_plane_ranks("http://s", info)


async def test_connect_refuses_data_parallel_replicas():
    async def sglang(request: web.Request) -> web.Response:
        return web.json_response({"tp_size": 1, "pp_size": 1, "dp_size": 2, "attn_dp_size": 1, "enable_dp_attention": False})

    server = await serve_every_path(sglang)
    try:
        url = str(server.make_url("")).rstrip("/")
        sync = WeightSync(sglang_config(url))
        with pytest.raises(UnsupportedServer, match=f"{url}: runs dp_size=2 .* run one SGLang server per replica"):
            await asyncio.to_thread(sync.connect, torch.nn.Linear(2, 2))
        sync.close()
    finally:
        await server.close()
