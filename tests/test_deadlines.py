"""One deadline per phase: servers slow but within their deadlines complete; one past a deadline is
evicted; nothing raises; no server is left paused or inside an update session.

Two reference servers speak SGLang's API here, because its policies have state a test can read: a
pause and an update session. With ``http_s`` = 1 s, every call to the first server is answered after
0.8 s, so each of its phases runs at 0.8x (or less) of its deadline (end: model_info, end and
continue, 3 calls = 2.4 of 3 s; begin: pause and session, 2 calls = 1.6 of 4 s, which leaves room for
closing a session left open). The second answers its bucket 1.5 s late.
"""

from __future__ import annotations

import time

import pytest
import torch

from asyncsync import WeightSync, WeightSyncConfig
from asyncsync.models import build_model
from asyncsync.receivers.reference.app import Faults, ReferenceServer

from conftest import TINY
from helpers import ThreadedServer, digest

SGLANG_ROUTES = ("/server_info", "/model_info", "/init_weights_update_group", "/pause_generation",
                 "/begin_weight_update", "/update_weights_from_distributed", "/end_weight_update", "/continue_generation")
SLOW = Faults(call_delay_s=tuple((route, 0.8) for route in SGLANG_ROUTES))
TOO_SLOW = Faults(call_delay_s=(("/update_weights_from_distributed", 1.5),))


@pytest.mark.slow
def test_phases_at_eight_tenths_of_their_deadlines_complete_and_one_past_it_is_evicted():
    with ThreadedServer(ReferenceServer(build_model(TINY), faults=SLOW)) as slow, \
            ThreadedServer(ReferenceServer(build_model(TINY), faults=TOO_SLOW)) as too_slow:
        cfg = WeightSyncConfig.from_dict({
            "servers": [{"url": slow.url, "kind": "sglang"}, {"url": too_slow.url, "kind": "sglang"}],
            "deadlines": {"http_s": 1.0, "rendezvous_s": 20, "collective_s": 20}, "bucket_bytes": "64MiB",
        })
        model = build_model(TINY)
        with WeightSync(cfg) as sync:
            sync.connect(model)
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(1.5)
            start = time.monotonic()
            result = sync.publish(model, 1)  # returns a result; never raises for a server's failure
            took = time.monotonic() - start
        assert result.server_versions == {slow.url: 1}
        assert slow.server.receiver.digest() == (1, digest(model))
        assert "update missed its deadline of 1.0s" in result.failures[too_slow.url] or \
               "got no answer within" in result.failures[too_slow.url], result.failures
        assert [(e.kind, e.server) for e in sync.events] == [("evicted", too_slow.url)]
        assert took < 10, f"the version took {took:.1f}s: a deadline was not enforced per phase"
        for server in (slow, too_slow):
            api = server.server.sglang
            assert api.paused is False, f"{server.url} was left paused"
            assert api.session_open is False, f"{server.url} was left inside an update session"
