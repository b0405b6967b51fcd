"""Blocking HTTP for what runs outside the trainer's control loop (launchers, tests, benchmarks,
examples, a training loop's first health check): one call, and waiting for ``/health``."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from asyncsync.protocol.wire import SESSION_HEADER


def http_call(url: str, method: str, path: str, body: Any = None, token: str | None = None,
              session: str | None = None, timeout_s: float = 60.0, raw: bytes | None = None) -> tuple[int, Any]:
    """(status, decoded JSON body or None) of one call; 4xx/5xx are returned, not raised. ``raw``: the
    body's bytes as they are (a test's malformed JSON); otherwise ``body`` as JSON."""
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    if session:
        headers[SESSION_HEADER] = session
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url + path, data, headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            status, text = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read()
    try:
        return status, json.loads(text) if text else None
    except ValueError:
        return status, text.decode(errors="replace")


def wait_healthy(url: str, timeout_s: float, what: str, alive: Callable[[], str | None] | None = None,
                 poll_s: float = 0.5, token: str | None = None) -> float:
    """Seconds until ``GET url/health`` answered 200; ``TimeoutError`` naming ``what`` after
    ``timeout_s``. ``alive``: says why the server can no longer come up (its process exited), or None.
    A 401 or 403 raises at once (``PermissionError``): a server that refuses the token never becomes
    healthy to this caller, however long it waits."""
    start = time.monotonic()
    while True:
        gone = alive() if alive is not None else None
        if gone is not None:
            raise RuntimeError(f"{what} {gone}")
        try:
            status = http_call(url, "GET", "/health", token=token, timeout_s=min(2.0, timeout_s))[0]
        except (OSError, urllib.error.URLError):  # not listening yet
            status = None
        if status == 200:
            return time.monotonic() - start
        if status in (401, 403):
            raise PermissionError(f"{what} answered {status} to {url}/health: "
                                  f"{'the token given is wrong' if token else 'it wants a bearer token'}")
        if time.monotonic() - start >= timeout_s:
            raise TimeoutError(f"{what} did not answer {url}/health within {timeout_s:.0f}s")
        time.sleep(poll_s)
