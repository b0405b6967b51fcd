"""asyncsync.netns: commands run in a private network namespace whose loopback is a shaped link.

Where such a namespace cannot be made (no root and no user namespaces, no ``tc``, a kernel without
netem for the delay) the tests that need one are skipped with the helper's own reason; what the
helper does in that case (say why, run nothing, exit 0) is tested everywhere.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from asyncsync import netns
from asyncsync.netns import Link

STREAM_BYTES = 24 << 20
# Streams STREAM_BYTES over one TCP connection on 127.0.0.1 and prints the bytes/s it got.
STREAM = f"""
import socket, threading, time
n = {STREAM_BYTES}
srv = socket.create_server(("127.0.0.1", 0))
def sink():
    conn, _ = srv.accept()
    got = 0
    while got < n:
        got += len(conn.recv(1 << 20))
    conn.sendall(b"k")
threading.Thread(target=sink, daemon=True).start()
c = socket.create_connection(srv.getsockname())
chunk = bytes(1 << 20)
t0 = time.perf_counter()
for _ in range(n >> 20):
    c.sendall(chunk)
c.recv(1)
print(n / (time.perf_counter() - t0))
"""
# Median round trip of 1-byte ping-pongs on 127.0.0.1, in seconds.
PING = """
import socket, threading, time, statistics
srv = socket.create_server(("127.0.0.1", 0))
def echo():
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while (b := conn.recv(1)):
        conn.sendall(b)
threading.Thread(target=echo, daemon=True).start()
c = socket.create_connection(srv.getsockname())
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for _ in range(50):
    t0 = time.perf_counter(); c.sendall(b"x"); c.recv(1); rtts.append(time.perf_counter() - t0)
print(statistics.median(rtts))
"""


def run_inside(link: Link, code: str, tmp_path: Path) -> float:
    """Run ``code`` in a namespace shaped as ``link`` (skip if none can be made); the number it printed."""
    why = netns.unavailable(link)
    if why is not None:
        pytest.skip(f"cannot emulate a {link.describe()} link here: {why}")
    out = tmp_path / "out.txt"
    done = netns.run(link, ["sh", "-c", '"$0" -c "$1" > "$2"', sys.executable, code, str(out)], timeout_s=60)
    assert done.skipped is None and done.returncode == 0, done
    return float(out.read_text())


def test_a_shaped_link_limits_a_stream_to_its_rate(tmp_path):
    link = Link(gbit=1.0)
    shaped = run_inside(link, STREAM, tmp_path)
    plain = float(subprocess.run([sys.executable, "-c", STREAM], capture_output=True, text=True, timeout=60, check=True).stdout)
    assert shaped <= 1.1 * link.bytes_per_s, f"{shaped / 1e6:.0f} MB/s through a {link.describe()} link"
    assert shaped >= 0.5 * link.bytes_per_s, f"only {shaped / 1e6:.0f} MB/s through a {link.describe()} link"
    assert plain > 2 * shaped, f"plain loopback ({plain / 1e6:.0f} MB/s) should be far faster than the link"


def test_an_added_delay_lengthens_every_round_trip(tmp_path):
    link = Link(gbit=1.0, delay_us=500)
    rtt = run_inside(link, PING, tmp_path)
    assert rtt >= 2 * link.delay_us * 1e-6, f"median round trip {rtt * 1e6:.0f} us with {link.delay_us:g} us each way"


def test_the_command_runs_in_the_namespace_and_its_exit_code_comes_back():
    link = Link(gbit=2.0)
    why = netns.unavailable(link)
    if why is not None:
        pytest.skip(f"cannot emulate a {link.describe()} link here: {why}")
    code = "import socket, sys; sys.exit(3 if socket.if_nameindex() == [(1, 'lo')] else 1)"  # only lo in there
    assert netns.run(link, [sys.executable, "-c", code], timeout_s=60).returncode == 3


def test_without_the_tools_it_says_why_and_runs_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # no unshare, ip or tc
    marker = tmp_path / "ran"
    link = Link(gbit=8.0)
    assert "unshare, ip, tc not found" in netns.unavailable(link)
    assert netns.run(link, ["touch", str(marker)]).skipped is not None
    assert netns.main(["--link-gbit", "8", "--", "touch", str(marker)]) == 0
    assert "skipped: cannot emulate a 8 gbit/s link here" in capsys.readouterr().err
    assert not marker.exists()


def test_links_are_validated():
    with pytest.raises(ValueError, match="rate must be > 0"):
        Link(gbit=0)
    with pytest.raises(ValueError, match="delay must be >= 0"):
        Link(gbit=1, delay_us=-1)
