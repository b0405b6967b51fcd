"""The SGLang client end to end against the reference server's SGLang API, and that API answering
as SGLang 0.5.23 does (routes, methods, bodies, status codes; SGLang 0.5.20 with sessions=False)."""

from __future__ import annotations

import pytest
import torch

from asyncsync.models import build_model
from asyncsync.protocol.sglang import NO_SESSION, SESSION_OPEN
from asyncsync.receivers.reference.app import ReferenceServer
from asyncsync.testing import mixed_dtype_model

from conftest import TINY
from helpers import ThreadedServer, Trainer, call, digest, live_version, sglang_config, weights


@pytest.mark.parametrize("sessions", [True, False], ids=["sglang>=0.5.21", "sglang-0.5.20-404"])
def test_sglang_client_syncs_versions_bit_exactly(sessions):
    with ThreadedServer(ReferenceServer(build_model(TINY), sglang_sessions=sessions)) as server:
        trainer = Trainer(sglang_config(server.url))
        try:
            assert live_version(server.url) == "default"
            model = build_model(TINY)
            for version in (1, 2, 3):
                named = weights(model, version)
                assert trainer.publish(named, version) == {server.url: version}
                assert server.server.receiver.digest() == (version, digest(named))
                assert live_version(server.url) == str(version)
                assert call(server.url, "GET", "/ready") == (200, None), "generation resumed"
            assert trainer.groups == [("sglang", 2)]
            assert call(server.url, "GET", "/server_info")[1]["weight_version"] == "default", "the start-up version"
        finally:
            trainer.close()


VALID = {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[TINY.vocab_size, TINY.hidden_size]],
         "group_name": "g", "load_format": "flattened_bucket"}


def test_routes_answer_as_sglang_0_5_23():
    with ThreadedServer(ReferenceServer(build_model(TINY))) as server:
        url = server.url
        assert call(url, "GET", "/get_weight_version") == (404, {"detail": "Not Found"})
        assert call(url, "GET", "/weight_version") == (404, {"detail": "Not Found"})
        assert call(url, "GET", "/update_weights_from_distributed") == (405, {"detail": "Method Not Allowed"})
        assert call(url, "POST", "/model_info", {}) == (405, {"detail": "Method Not Allowed"})

        status, info = call(url, "GET", "/model_info")
        assert status == 200 and info["weight_version"] == "default" and info["is_generation"] is True
        assert call(url, "GET", "/get_model_info") == (200, info)
        status, args = call(url, "GET", "/server_info")
        assert status == 200 and (args["tp_size"], args["dp_size"], args["attn_dp_size"]) == (1, 1, 1)

        for bad in (None, {"names": ["a"], "dtypes": ["float32"]}, {**VALID, "selector": "nope"},
                    {**VALID, "weight_version": 5}, {**VALID, "shapes": [["x"]]}):
            status, body = call(url, "POST", "/update_weights_from_distributed", bad)
            assert status == 400 and body["object"] == "error" and body["code"] == 400 and body["type"] == "Bad Request"
            assert "validation error" in body["message"], body
        status, body = call(url, "POST", "/update_weights_from_distributed", raw=b"{not json")
        assert status == 400 and body["object"] == "error"

        # Refused before anything is received, with SGLang's words.
        assert call(url, "POST", "/update_weights_from_distributed", VALID) == (400, {"success": False, "message": NO_SESSION})
        assert call(url, "POST", "/end_weight_update", {}) == (
            400, {"success": False, "message": "no weight-update session is open; call begin_weight_update() first"})
        assert call(url, "POST", "/end_weight_update")[0] == 400, "SGLang requires a body, even {}"
        assert call(url, "POST", "/begin_weight_update", {}) == (200, {"success": True, "message": "Success"})
        assert call(url, "POST", "/begin_weight_update", {}) == (400, {"success": False, "message": SESSION_OPEN})
        assert call(url, "POST", "/update_weights_from_distributed", VALID) == (400, {
            "success": False, "message": "Failed to receive weights: Group g not in []. Please call "
                                         "`init_weights_update_group` first."})
        assert call(url, "POST", "/end_weight_update", {}) == (200, {"success": True, "message": "Success"})
        assert call(url, "POST", "/destroy_weights_update_group", {"group_name": "g"}) == (
            400, {"success": False, "message": "The group to be destroyed does not exist."})

        assert call(url, "POST", "/pause_generation", {"mode": "retract"}) == (
            200, {"message": "Generation paused successfully.", "status": "ok"})
        assert call(url, "GET", "/ready") == (503, None)
        assert call(url, "POST", "/pause_generation", {"mode": "later"})[0] == 400
        assert call(url, "POST", "/continue_generation", {}) == (
            200, {"message": "Generation continued successfully.", "status": "ok"})
        assert call(url, "GET", "/ready") == (200, None)


def test_sessionless_server_answers_as_sglang_0_5_20():
    with ThreadedServer(ReferenceServer(build_model(TINY), sglang_sessions=False)) as server:
        url = server.url
        assert call(url, "POST", "/begin_weight_update", {}) == (404, {"detail": "Not Found"})
        status, body = call(url, "GET", "/get_weight_version")
        assert status == 404 and body["code"] == 404 and "Please use '/model_info' instead" in body["message"]
        status, body = call(url, "POST", "/update_weights_from_distributed", VALID)  # no session needed
        assert status == 400 and body["message"].startswith("Failed to receive weights: Group g not in")
        assert "disaggregation_mode" not in call(url, "GET", "/model_info")[1]


def test_refused_versions_leave_the_old_weights_serving():
    """Refusals leave the served weights and version alone: a tensor the model does not have before
    its broadcast (nothing is allocated for it), a wrong shape after it. A bucket mixing bf16 and fp32
    is no refusal: SGLang 0.5.20+ reads flattened buckets as bytes (asyncsync still sends one dtype
    per bucket, which every release reads)."""
    with ThreadedServer(ReferenceServer(mixed_dtype_model(TINY))) as server:
        trainer = Trainer(sglang_config(server.url, bucket_bytes=1))
        try:
            model = mixed_dtype_model(TINY)
            good = weights(model, 1)
            assert trainer.publish(good, 1) == {server.url: 1}
            served = server.server.receiver.digest()
            assert served == (1, digest(good))

            unknown = {**weights(model, 3), "no.such.tensor": torch.zeros(3)}
            result = trainer.publish(unknown, 3)[server.url]
            assert "1 tensor(s) sent that it does not load, e.g. 'no.such.tensor'" in str(result)
            assert "Failed to receive weights" in str(result)
            reshaped = {**weights(model, 4), "lm_head.weight": torch.zeros(3, 5)}
            result = trainer.publish(reshaped, 4)[server.url]
            assert "'lm_head.weight': got torch.float32 (3, 5)" in str(result)

            assert server.server.receiver.digest() == served, "refused versions must not touch the weights"
            assert live_version(server.url) == "1"
            assert call(server.url, "GET", "/ready") == (200, None), "a failed update resumes generation"
            assert not server.server.sglang.session_open

            mixed = weights(model, 5)
            assert trainer.publish(mixed, 5, bucket_bytes=64 * 1024, single_dtype=False) == {server.url: 5}
            assert server.server.receiver.digest() == (5, digest(mixed))
        finally:
            trainer.close()
