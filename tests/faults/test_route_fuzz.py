"""Thousands of generated bad requests, 200 in flight at a time, across every route of a live
reference server, then a rogue trainer on its data plane (``asyncsync/testing/fuzz.py`` has the
campaign and its checks; ``python -m benchmarks.fuzz`` runs a longer one and writes the figures in
docs/faults.md). ``--fuzz-requests N`` runs N requests here instead of the default."""

from __future__ import annotations

import pytest

from asyncsync.protocol.schema import Message
from asyncsync.protocol.shm import HostIdentity
from asyncsync.testing import mixed_dtype_model
from asyncsync.testing.fuzz import MODEL, campaign, served_routes
from asyncsync.testing.probes import GET_ROUTES, POST_ROUTES, ROUTES, TAKES, Context


def test_the_fuzz_covers_exactly_the_routes_the_server_serves():
    """A route added to the reference server (its app's router) without a template here fails."""
    fuzzed = {("GET", r) for r in GET_ROUTES} | {("POST", r) for r in POST_ROUTES}
    served = served_routes()
    assert len(fuzzed) == len(ROUTES), "a route listed twice"
    assert fuzzed == served, {"not fuzzed": sorted(served - fuzzed), "not served": sorted(fuzzed - served)}
    host = HostIdentity("0b8c4f52-7a1c-4e55-9d1e-2f3b4a5c6d7e", 27).to_json()
    ctx = Context(mixed_dtype_model(MODEL).state_dict(), MODEL.vocab_size, 1, 2, host, "asyncsync-1-ab-0")
    assert set(ctx.templates) == set(POST_ROUTES)
    for path, template in ctx.templates.items():  # each template is a body its route takes
        takes = TAKES[path]
        if isinstance(takes, type) and issubclass(takes, Message):
            assert takes.from_json(template).to_json() == template, path


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bad_requests_get_4xx_and_leave_the_server_serving_unchanged_and_leaking_nothing(request):
    requests = request.config.getoption("--fuzz-requests")
    results = campaign(requests, seed=request.config.getoption("--fuzz-seed"))
    assert results["problems"] == [], results["problems"]
    # The checks themselves (asyncsync.testing.fuzz._judge) said nothing: what they saw, in case they went blind.
    assert results["requests"] >= requests and results["routes"] == len(served_routes()) == 36
    assert sum(n for status, n in results["status"].items() if status.startswith("4")) > requests // 2
    assert results["server_errors"]["undocumented_5xx"] == 0 and not results["crashed"]
    assert results["health"]["probes"] > 0 and results["tokens_unchanged"] and results["weights_unchanged"]
    assert results["valid_version_after"] == {"applied": True, "failures": {}, "bit_exact": True,
                                              "tokens_match_trainer": True}
    assert {lie: r["status"] for lie, r in results["data_plane_lies"].items()} == {
        "wrong_checksum": 409, "stale_version": 409, "bucket_longer_than_announced": 409,
        "frames_of_another_plan": 409, "a_tensor_the_model_lacks": 409, "a_petabyte": 409,
        "silent_trainer": 503, "stops_half_way": 503, "trainer_of_another_protocol": 400,
    }
