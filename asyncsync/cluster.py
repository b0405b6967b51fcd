"""An emulated cluster: one network namespace per host, each with its own shaped link.

    with Cluster({"trainer": Link(8), "s0": Link(8), "s1": Link(0.8)}) as cluster:
        cluster.address("s0")                                  # 10.88.0.3, reachable only from the hosts
        proc = cluster.popen("s0", [sys.executable, "-m", ...])  # a command inside s0's namespace
        cluster.partition("s0", "s1")                          # s0 and s1 no longer reach each other

``asyncsync.netns`` shapes the one loopback that every process of a run shares: right for "the
trainer's NIC", unable to show traffic between servers, which would cross the same shaped device.
Here every host is a network namespace of its own, joined to the others through a bridge by a veth
pair, and its link is shaped with ``tbf`` in both directions at its own rate (the host's end of the
pair: what it sends; the bridge's end: what it receives). A transfer between two hosts is bound by
the slower of their links and shares each only with that host's other transfers, as on a switched
network. The bridge lives in a namespace of its own too: no address exists outside the cluster's
namespaces, and nothing routes out of them.

It needs root (``ip netns``), iproute2's ``ip`` and ``tc``, and a kernel with veth, bridges and tbf.
``unavailable()`` says why a cluster cannot be made (tests and benchmarks skip, saying it); a
``Cluster`` that fails half-way removes what it made. Imports only the standard library.
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any

from asyncsync.netns import Link

SUBNET = ipaddress.ip_network("10.88.0.0/24")
NOWHERE = "02:00:00:00:00:00"  # a hardware address no host of a cluster has (theirs are random)
TOOLS = ("ip", "tc")
_made = itertools.count()  # clusters made by this process: each one's namespaces get names of their own


class ClusterUnavailable(RuntimeError):
    """The emulated cluster cannot be made here; the message says why (and what would be needed)."""


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise ClusterUnavailable(f"'{' '.join(argv)}' failed: {done.stderr.strip() or f'exit code {done.returncode}'}")


def _shape(namespace: str, device: str, link: Link) -> list[str]:
    return ["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device, "root", "tbf", "rate",
            f"{link.gbit:g}gbit", "burst", str(link.burst_bytes), "latency", "100ms"]


class Cluster:
    """Hosts (name -> the rate of its link) as network namespaces on one bridge; see the module.

    Contract: made on ``__enter__`` (or ``start``), every namespace removed on ``__exit__`` (or
    ``close``), also after a failed start; the processes started with ``popen`` are the caller's to
    end (a namespace's removal does not kill them). Host names are letters, digits and '-'."""

    def __init__(self, hosts: Mapping[str, Link]):
        if not hosts:
            raise ValueError("a cluster needs at least one host")
        if len(hosts) > SUBNET.num_addresses - 3:
            raise ValueError(f"at most {SUBNET.num_addresses - 3} hosts fit {SUBNET}")
        for name in hosts:
            if not name or not all(c.isalnum() or c == "-" for c in name) or len(name) > 12:
                raise ValueError(f"host name {name!r}: 1-12 letters, digits or '-'")
        self.hosts = dict(hosts)
        self.tag = f"as{os.getpid() % 100000}.{next(_made)}"
        self._made: list[str] = []
        addresses = list(SUBNET.hosts())[1:]  # .1 is left for the bridge's own side
        self._address = {name: str(addresses[i]) for i, name in enumerate(self.hosts)}

    def namespace(self, host: str) -> str:
        return f"{self.tag}-{host}"

    def address(self, host: str) -> str:
        """``host``'s address, reachable from every host of the cluster and from nowhere else."""
        return self._address[host]

    def start(self) -> Cluster:
        why = unavailable()
        if why is not None:
            raise ClusterUnavailable(why)
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def _make(self) -> None:
        bridge = f"{self.tag}-br"
        _run("ip", "netns", "add", bridge)
        self._made.append(bridge)
        _run("ip", "netns", "exec", bridge, "ip", "link", "add", "br0", "type", "bridge")
        _run("ip", "netns", "exec", bridge, "ip", "link", "set", "br0", "up")
        for i, (host, link) in enumerate(self.hosts.items()):
            ns, outer = self.namespace(host), f"v{i}"
            _run("ip", "netns", "add", ns)
            self._made.append(ns)
            _run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            _run("ip", "link", "add", outer, "netns", bridge, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _run("ip", "netns", "exec", bridge, "ip", "link", "set", outer, "master", "br0", "up")
            _run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{self.address(host)}/{SUBNET.prefixlen}", "dev", "eth0")
            _run("ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up")
            _run(*_shape(ns, "eth0", link))        # what the host sends
            _run(*_shape(bridge, outer, link))     # what it receives

    def env(self, host: str) -> dict[str, str]:
        """The environment a command on ``host`` needs besides its namespace: gloo and NCCL bind to the
        host's own interface (its hostname resolves to no address inside the cluster)."""
        return {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0"}

    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``host``'s namespace."""
        return ["ip", "netns", "exec", self.namespace(host), *argv]

    def popen(self, host: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` on ``host`` (``subprocess.Popen`` keywords pass through; ``env`` is added to
        the caller's environment and ``env(host)``)."""
        env = {**os.environ, **self.env(host), **kwargs.pop("env", {})}
        return subprocess.Popen(self.command(host, argv), env=env, **kwargs)

    def partition(self, a: str, b: str) -> None:
        """Drop every packet between hosts ``a`` and ``b``, both ways and silently (no refusal, no
        reset: a firewall that drops), while both still reach every other host. Each host resolves
        the other's address to ``NOWHERE``, so the bridge delivers their frames to no host; TCP
        connections already open between them go silent too. ``heal`` undoes it."""
        for here, there in ((a, b), (b, a)):
            _run(*self.command(here, ["ip", "neigh", "replace", self.address(there), "lladdr", NOWHERE, "dev", "eth0",
                                      "nud", "permanent"]))

    def heal(self, a: str, b: str) -> None:
        """Undo ``partition(a, b)``: each host resolves the other's address again."""
        for here, there in ((a, b), (b, a)):
            _run(*self.command(here, ["ip", "neigh", "del", self.address(there), "dev", "eth0"]))

    def close(self) -> None:
        """Remove every namespace made (their veth pairs go with them); never raises."""
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made = []

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def unavailable() -> str | None:
    """Why no cluster can be made here, or None (the tools and privileges are checked, nothing is made)."""
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"{', '.join(missing)} not found on PATH (install iproute2)"
    if os.geteuid() != 0:
        return "named network namespaces (ip netns) need root; run as root, or use asyncsync.netns's one shaped link"
    return None
