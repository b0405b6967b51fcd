"""asyncsync.cluster: hosts as network namespaces on one bridge, each with its own shaped link.

What distinguishes it from ``asyncsync.netns``'s one shaped loopback: two transfers between disjoint
pairs of hosts each get the full rate, while two transfers out of one host share its link. Where no
cluster can be made (not root, no ``ip``) the tests are skipped with the module's own reason.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from asyncsync import cluster
from asyncsync.cluster import Cluster
from asyncsync.netns import Link

RATE = Link(gbit=0.5)  # 62.5 MB/s: far below what 2 cores move through a bridge
NBYTES = 12 << 20      # 0.2 s at RATE
# A sink on (address, port) that reads until the sender closes, then answers its byte count.
SINK = """
import socket, sys
srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("listening", flush=True)
conn, _ = srv.accept()
got = 0
while (b := conn.recv(1 << 20)):
    got += len(b)
conn.sendall(str(got).encode())
"""
# Sends argv[3] bytes to (address, port), then prints the seconds until the sink answered.
SOURCE = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
t0 = time.perf_counter()
c.sendall(bytes(int(sys.argv[3])))
c.shutdown(socket.SHUT_WR)
assert c.recv(64) == sys.argv[3].encode()
print(time.perf_counter() - t0)
"""


@pytest.fixture(scope="module")
def four_hosts() -> Iterator[Cluster]:
    why = cluster.unavailable()
    if why is not None:
        pytest.skip(f"cannot emulate a cluster here: {why}")
    with Cluster({h: RATE for h in ("a", "b", "c", "d")}) as made:
        yield made


def transfers(c: Cluster, pairs: list[tuple[str, str]]) -> list[float]:
    """Seconds each (sender, receiver) transfer of NBYTES took, all started together."""
    ports = [str(9000 + i) for i in range(len(pairs))]  # two sinks may share a host
    sinks = [c.popen(dst, [sys.executable, "-c", SINK, c.address(dst), port], stdout=subprocess.PIPE, text=True)
             for (_, dst), port in zip(pairs, ports)]
    sources: list[subprocess.Popen[str]] = []
    try:
        for s in sinks:
            assert s.stdout is not None and s.stdout.readline().strip() == "listening"
        sources = [c.popen(src, [sys.executable, "-c", SOURCE, c.address(dst), port, str(NBYTES)],
                           stdout=subprocess.PIPE, text=True) for (src, dst), port in zip(pairs, ports)]
        out = [p.communicate(timeout=60)[0] for p in sources]
        assert all(p.returncode == 0 for p in sources), out
        return [float(x) for x in out]
    finally:
        for p in [*sources, *sinks]:
            p.kill()
            p.wait()


def test_each_host_has_its_own_link_and_shares_it_only_with_its_own_transfers(four_hosts):
    alone = transfers(four_hosts, [("a", "b")])[0]
    disjoint = transfers(four_hosts, [("a", "b"), ("c", "d")])
    one_uplink = transfers(four_hosts, [("a", "b"), ("a", "c")])
    one_downlink = transfers(four_hosts, [("a", "c"), ("b", "c")])
    ideal = NBYTES / RATE.bytes_per_s
    assert 0.8 * ideal <= alone <= 1.5 * ideal, (alone, ideal)
    assert max(disjoint) <= 1.35 * alone, f"disjoint pairs slowed each other: {disjoint} vs {alone} alone"
    assert max(one_uplink) >= 1.6 * alone, f"two transfers out of one host did not share its link: {one_uplink}"
    assert max(one_downlink) >= 1.6 * alone, f"two transfers into one host did not share its link: {one_downlink}"


def test_addresses_exist_only_inside_the_cluster(four_hosts):
    here = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, check=True).stdout
    assert four_hosts.address("a") not in here  # not on this machine's own interfaces
    inside = subprocess.run(four_hosts.command("a", ["ip", "-o", "addr"]), capture_output=True, text=True, check=True)
    assert four_hosts.address("a") in inside.stdout
    routes = subprocess.run(four_hosts.command("a", ["ip", "route"]), capture_output=True, text=True, check=True)
    assert "default" not in routes.stdout, "a host of the cluster must not route out of it"


def test_a_closed_cluster_leaves_no_namespace():
    why = cluster.unavailable()
    if why is not None:
        pytest.skip(f"cannot emulate a cluster here: {why}")
    made = Cluster({"x": RATE, "y": RATE})
    with made:
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
        assert made.namespace("x") in names
    deadline = time.monotonic() + 5
    while made.namespace("x") in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout:
        assert time.monotonic() < deadline, "the cluster's namespaces outlived it"
        time.sleep(0.1)


def test_bad_host_names_are_refused_before_anything_is_made():
    with pytest.raises(ValueError, match="host name 'a b'"):
        Cluster({"a b": RATE})
    with pytest.raises(ValueError, match="at least one host"):
        Cluster({})


# Connects to (address, port) within argv[3] seconds; prints "ok", or the error's name.
CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
    print("ok")
except OSError as e:
    print(type(e).__name__)
"""


def test_a_partition_silences_two_hosts_to_each_other_only_and_heals(four_hosts):
    sink = four_hosts.popen("a", [sys.executable, "-c", "import socket, sys, time\n"
                                  "s = socket.create_server((sys.argv[1], 9100), backlog=16)\nprint('listening', flush=True)\n"
                                  "while True:\n    s.accept()[0].close()", four_hosts.address("a")],
                            stdout=subprocess.PIPE, text=True)

    def connect(src: str) -> tuple[str, float]:
        t0 = time.monotonic()
        out = subprocess.run(four_hosts.command(src, [sys.executable, "-c", CONNECT, four_hosts.address("a"), "9100", "1.5"]),
                             capture_output=True, text=True, timeout=30).stdout.strip()
        return out, time.monotonic() - t0

    try:
        assert sink.stdout is not None and sink.stdout.readline().strip() == "listening"
        four_hosts.partition("a", "b")
        try:
            silent, waited = connect("b")
            assert silent == "TimeoutError" and waited >= 1.5, "dropped silently: no refusal, no reset"
            assert connect("c")[0] == "ok", "the others still reach a"
        finally:
            four_hosts.heal("a", "b")
        assert connect("b")[0] == "ok"
    finally:
        sink.kill()
        sink.wait()
