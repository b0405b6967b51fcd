"""Thousands of generated bad requests, 200 in flight at a time, across every route of a live
reference server, then a rogue trainer on its data plane (``benchmarks/fuzz.py`` has the campaign
and its checks; ``python -m benchmarks.fuzz`` runs a longer one and writes the figures in docs/faults.md).
``--fuzz-requests N`` runs N requests here instead of the default."""

from __future__ import annotations

import pytest

from benchmarks.fuzz import GET_ROUTES, POST_ROUTES, ROUTES, campaign, served_routes


def test_the_fuzz_covers_exactly_the_routes_the_server_serves():
    """A route added to the reference server (its app's router) without a template here fails."""
    fuzzed = {("GET", r) for r in GET_ROUTES} | {("POST", r) for r in POST_ROUTES}
    served = served_routes()
    assert len(fuzzed) == len(ROUTES), "a route listed twice"
    assert fuzzed == served, {"not fuzzed": sorted(served - fuzzed), "not served": sorted(fuzzed - served)}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bad_requests_get_4xx_and_leave_the_server_serving_unchanged_and_leaking_nothing(request):
    requests = request.config.getoption("--fuzz-requests")
    results = campaign(requests, seed=request.config.getoption("--fuzz-seed"))
    assert results["problems"] == [], results["problems"]
    # The checks themselves (benchmarks.fuzz._judge) said nothing: what they saw, in case they went blind.
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
