"""Malformed control requests get a 4xx with a message and the server keeps serving; auth is enforced."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp.test_utils import TestClient, TestServer

from asyncsync.models import build_model
from asyncsync.protocol.wire import MAX_ERROR_CHARS, PROTOCOL_VERSION
from asyncsync.receivers.reference.app import ReferenceServer

from conftest import TINY


@pytest.fixture(scope="module")
def model():
    return build_model(TINY)


async def client_for(model, token=None) -> TestClient:
    client = TestClient(TestServer(ReferenceServer(model, token).app()))
    await client.start_server()
    return client


async def test_generate_reports_version_and_is_deterministic(model):
    client = await client_for(model)
    try:
        body = {"prompt": [1, 2, 3], "max_new_tokens": 5, "n": 3, "temperature": 1.0, "seed": 7}
        first = await (await client.post("/generate", json=body)).json()
        second = await (await client.post("/generate", json=body)).json()
        assert first == second
        assert first["weight_version"] == 0
        assert len(first["completions"]) == 3 and all(len(c) == 5 for c in first["completions"])
        health = await (await client.get("/health")).json()
        assert health == {"status": "ok", "version": 0}
    finally:
        await client.close()


@pytest.mark.parametrize(
    "path, body",
    [
        ("/generate", {"prompt": []}),
        ("/generate", {"prompt": [1, 99999]}),
        ("/generate", {"prompt": [1], "max_new_tokens": -1}),
        ("/generate", {"prompt": [1], "n": 0}),
        ("/generate", {"prompt": [1], "temperature": "hot"}),
        ("/generate", {"prompt": [1], "seed": 1.5}),
        ("/init_group", {"rank_offset": 1}),
        ("/init_group", {"group": {"host": "127.0.0.1", "port": 0, "world_size": 2, "group_name": "g",
                                   "backend": "gloo", "timeout_s": 1}, "rank_offset": 1}),
        ("/init_group", {"group": {"host": "127.0.0.1", "port": 5000, "world_size": 2, "group_name": "g",
                                   "backend": "mpi", "timeout_s": 1}, "rank_offset": 1}),
        ("/init_group", {"group": {"host": "127.0.0.1", "port": 5000, "world_size": 2, "group_name": "g",
                                   "backend": "gloo", "timeout_s": 1}, "rank_offset": 2}),
        ("/init_group", {"group": {"host": "../../etc", "port": 5000, "world_size": 2, "group_name": "g",
                                   "backend": "gloo", "timeout_s": 1}, "rank_offset": 1}),  # was a 500: no IDNA name
        ("/begin", {}),
        ("/begin", {"version": -3}),
        ("/update", {"version": 1, "buckets": [], "checksum": True}),
        ("/update", {"version": 1, "checksum": True,
                     "buckets": [{"names": ["a"], "dtypes": ["float33"], "shapes": [[2]], "nbytes": 8}]}),
        ("/update", {"version": 1, "checksum": True,
                     "buckets": [{"names": ["a"], "dtypes": ["float32"], "shapes": [[2]], "nbytes": 9}]}),
        ("/update", {"version": 1, "checksum": True,
                     "buckets": [{"names": ["a", "b"], "dtypes": ["int8", "float32"], "shapes": [[1], [1]], "nbytes": 5}]}),
        ("/update", {"version": 1, "checksum": "yes",
                     "buckets": [{"names": ["a"], "dtypes": ["float32"], "shapes": [[2]], "nbytes": 8}]}),
        ("/end", {"version": "1"}),
        ("/generate", [1, 2, 3]),
        ("/update", {"version": 1, "checksum": True,
                     "buckets": [{"names": ["a"], "dtypes": ["float32"], "shapes": [[-2]], "nbytes": 8}]}),
        ("/update", {"version": 1, "checksum": True,
                     "buckets": [{"names": [7], "dtypes": ["float32"], "shapes": [[2]], "nbytes": 8}]}),
        ("/update", {"version": 1, "checksum": True, "buckets": "all of them"}),
    ],
)
async def test_malformed_requests_get_400_and_server_keeps_serving(model, path, body):
    client = await client_for(model)
    try:
        resp = await client.post(path, json=body)
        assert resp.status == 400, await resp.text()
        assert "error" in await resp.json()
        ok = await client.post("/generate", json={"prompt": [1], "max_new_tokens": 2})
        assert ok.status == 200
    finally:
        await client.close()


async def test_body_that_is_not_json_gets_400(model):
    client = await client_for(model)
    try:
        resp = await client.post("/begin", data=b"{not json", headers={"Content-Type": "application/json"})
        assert resp.status == 400
    finally:
        await client.close()


async def test_update_without_group_is_refused(model):
    client = await client_for(model)
    try:
        body = {"version": 1, "checksum": False,
                "buckets": [{"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[1]], "nbytes": 4}]}
        resp = await client.post("/update", json=body)
        assert resp.status == 409
        assert "init_group" in (await resp.json())["error"]
        resp = await client.post("/end", json={"version": 1})
        assert resp.status == 409
    finally:
        await client.close()


async def test_token_required_when_configured(model):
    client = await client_for(model, token="s3cret")
    try:
        assert (await client.get("/version")).status == 401
        bad = await client.get("/version", headers={"Authorization": "Bearer nope"})
        assert bad.status == 401
        good = await client.get("/version", headers={"Authorization": "Bearer s3cret"})
        assert good.status == 200 and (await good.json())["version"] == 0
    finally:
        await client.close()


BUCKET = b'{"names": ["a"], "dtypes": ["float32"], "shapes": [[1]], "nbytes": 4}'
GROUP = b'{"host": "127.0.0.1", "port": 5000, "world_size": 2, "group_name": %s, "backend": "gloo", "timeout_s": %s}'
SHM = b'{"segment": "asyncsync-1-ab-0", "offsets": [4], "crcs": [1], "host": {"boot_id": "b", "shm_dev": 1}}'


@pytest.mark.parametrize(
    "path, body, headers, says",
    [
        ("/begin", b"[" * 10000 + b"]" * 10000, {}, "not valid JSON"),
        ("/begin", b'{"version": 1}', {"Content-Type": "application/json; charset=klingon"}, "not valid JSON"),
        ("/begin", b'{"version": 1}', {"X-Asyncsync-Session": "a\tb"}, "X-Asyncsync-Session"),
        ("/init_group", b'{"rank_offset": 1, "protocol": %d, "group": %s}' % (PROTOCOL_VERSION, GROUP % (b'"g"', b"NaN")), {}, "timeout_s"),
        ("/init_group", b'{"rank_offset": 1, "protocol": %d, "group": %s}' % (PROTOCOL_VERSION, GROUP % (b'"g\\ud800"', b"1")), {},
         "group_name"),
        ("/update", b'{"version": 1, "checksum": false, "deadlines_s": [Infinity], "buckets": [%s]}' % BUCKET, {},
         "deadlines_s"),
        ("/update", b'{"version": 1, "checksum": true, "buckets": [%s], "shm": %s}' % (BUCKET, SHM), {}, "multiple of 64"),
        ("/update", b'{"version": 1, "checksum": false, "buckets": [{"names": ["a"], "dtypes": ["float32"], '
                    b'"shapes": [[4611686018427387904, 4611686018427387904]], "nbytes": 4}]}', {}, "nbytes"),
        ("/generate", b'{"prompt": [1], "temperature": 1e-300}', {}, "temperature"),
        ("/generate", b'{"prompt": [1], "temperature": NaN}', {}, "temperature"),
        ("/generate", b'{"prompt": [1], "seed": 18446744073709551616}', {}, "seed"),
        ("/generate", b'{"prompt": [' + b"1, " * 299_999 + b"1]}", {}, "prompt"),
        ("/generate", b'{"prompt": [1, 2], "max_new_tokens": 511}', {}, "max_new_tokens"),
    ],
    ids=["nested-10000-deep", "unknown-charset", "control-char-session", "nan-timeout", "lone-surrogate-group",
         "infinite-deadline", "misaligned-shm", "overflowing-shape", "temperature-1e-300", "temperature-nan",
         "seed-2**64", "prompt-300000-tokens", "past-the-context"],
)
async def test_the_issues_500s_are_400s_now(model, path, body, headers, says):
    """Each of these answered 500 (or tried to allocate 90 GB) before: now a 400 whose short message
    names the field, and the server keeps generating."""
    client = await client_for(model)
    try:
        resp = await client.post(path, data=body, headers={"Content-Type": "application/json", **headers})
        assert resp.status == 400, await resp.text()
        error = (await resp.json())["error"]
        assert says in error and len(error) <= MAX_ERROR_CHARS, error
        ok = await client.post("/generate", json={"prompt": [1], "max_new_tokens": 2})
        assert ok.status == 200
    finally:
        await client.close()


async def test_a_credential_that_is_not_utf8_is_a_401(model):
    client = await client_for(model, token="s3cret")
    try:
        host, port = client.server.host, client.server.port
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"GET /version HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer \xff\xfe\r\n\r\n")
        await writer.drain()
        answer = await reader.read()
        writer.close()
        assert answer.startswith(b"HTTP/1.1 401"), answer[:100]
    finally:
        await client.close()


async def test_a_50_mb_field_gets_a_short_answer(model):
    """/claim used to echo the whole input: a 50 MB session came back as a 50 MB answer."""
    client = await client_for(model)
    try:
        resp = await client.post("/claim", json={"session": "s" * 50_000_000})
        assert resp.status == 400 and len(await resp.read()) < 1000
    finally:
        await client.close()
