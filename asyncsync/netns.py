"""Run a command inside a private network namespace whose loopback behaves like a network link.

    python -m asyncsync.netns --link-gbit 8 [--link-delay-us 25] -- python -m benchmarks.broadcast ...

On plain loopback a "transfer" is a kernel memcpy on the same cores that pack, checksum and verify,
so loopback figures measure CPU contention. Real clusters are bound by their links. Here the command
runs in a fresh network namespace (``unshare --net``) with only ``lo``, brought up and shaped:

* ``--link-gbit R``: a token bucket (tbf) on ``lo`` at R gbit/s. Every byte that crosses loopback in
  the namespace passes it, in both directions, so all processes there share one R gbit/s link (a
  trainer broadcasting to two receivers sends twice the bytes through it, as a trainer's NIC does).
  The burst is 1 ms worth of bytes (at least 256 KiB: lo's MTU is 64 KiB and segments may be that
  large), so a transfer after an idle pause is not noticeably faster than the rate.
* ``--link-delay-us D``: a netem qdisc holding every packet D microseconds, with the tbf under it
  (netem's documented way to combine delay and rate). Data and acknowledgements both cross ``lo``,
  so a round trip gets 2 D. Needs a kernel with netem (``CONFIG_NET_SCH_NETEM``).

All traffic stays on 127.0.0.1 inside the namespace; nothing outside it is reachable from there. The
command's child processes inherit the namespace, and the namespace vanishes with them.

It needs util-linux's ``unshare``, iproute2's ``ip`` and ``tc``, and either root or unprivileged user
namespaces (then it runs ``unshare --net --map-root-user``). When the link cannot be made the CLI
prints ``skipped: <why>`` on stderr and exits 0, without running the command; ``run()`` returns a
``LinkRun`` whose ``skipped`` says why. Otherwise the CLI exits with the command's exit code.
This module imports only the standard library: it is imported by benchmarks before torch is loaded.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

BURST_S = 1e-3            # tbf burst: this long at the link rate
MIN_BURST_BYTES = 256 << 10
QUEUE_LATENCY_MS = 100    # tbf queue: packets may wait this long before being dropped
NETEM_LIMIT_PACKETS = 100_000  # netem's default of 1000 packets would drop at high rate x delay
TOOLS = ("unshare", "ip", "tc")


@dataclass(frozen=True)
class Link:
    """An emulated link: ``gbit`` gigabits per second, plus ``delay_us`` microseconds one way."""

    gbit: float
    delay_us: float = 0.0

    def __post_init__(self) -> None:
        if not self.gbit > 0:
            raise ValueError(f"link rate must be > 0 gbit/s, got {self.gbit}")
        if self.delay_us < 0:
            raise ValueError(f"link delay must be >= 0 us, got {self.delay_us}")

    @property
    def bytes_per_s(self) -> float:
        return self.gbit * 1e9 / 8

    @property
    def burst_bytes(self) -> int:
        return max(MIN_BURST_BYTES, int(self.bytes_per_s * BURST_S))

    def describe(self) -> str:
        return f"{self.gbit:g} gbit/s" + (f", +{self.delay_us:g} us one way" if self.delay_us else "")

    def tc_commands(self) -> list[list[str]]:
        """The ``tc`` invocations that shape ``lo`` (run inside the namespace, after ``lo`` is up)."""
        tbf = ["tbf", "rate", f"{self.gbit:g}gbit", "burst", str(self.burst_bytes), "latency", f"{QUEUE_LATENCY_MS}ms"]
        if not self.delay_us:
            return [["tc", "qdisc", "add", "dev", "lo", "root", "handle", "1:", *tbf]]
        return [
            ["tc", "qdisc", "add", "dev", "lo", "root", "handle", "1:", "netem", "delay", f"{self.delay_us:g}us",
             "limit", str(NETEM_LIMIT_PACKETS)],
            ["tc", "qdisc", "add", "dev", "lo", "parent", "1:1", "handle", "10:", *tbf],
        ]

    def cli_args(self) -> list[str]:
        return ["--link-gbit", f"{self.gbit:g}", "--link-delay-us", f"{self.delay_us:g}"]


@dataclass(frozen=True)
class LinkRun:
    """What ``run`` did: ``skipped`` says why nothing ran; otherwise the command's exit code."""

    link: Link
    returncode: int | None = None
    skipped: str | None = None


class LinkUnavailable(RuntimeError):
    """The emulated link cannot be made here; the message says why (and what would be needed)."""


def _unshare_prefix() -> list[str]:
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        raise LinkUnavailable(f"{', '.join(missing)} not found on PATH (install util-linux and iproute2)")
    prefix = ["unshare", "--net"]
    if os.geteuid() != 0:
        prefix.append("--map-root-user")  # unprivileged user namespaces: root inside, the caller outside
    return prefix


def _inner(link: Link, argv: Sequence[str]) -> list[str]:
    return [*_unshare_prefix(), "--", sys.executable, os.path.abspath(__file__), "--inside", *link.cli_args(), "--", *argv]


def unavailable(link: Link, timeout_s: float = 30.0) -> str | None:
    """Why ``link`` cannot be made here, or None when it can (makes one and throws it away)."""
    try:
        cmd = _inner(link, ["true"])
    except LinkUnavailable as e:
        return str(e)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"making the namespace took over {timeout_s:.0f}s"
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        if "unshare failed" in why:
            why += " (needs root, or unprivileged user namespaces: sysctl kernel.unprivileged_userns_clone=1)"
        return why
    return None


def run(link: Link, argv: Sequence[str], timeout_s: float | None = None) -> LinkRun:
    """Run ``argv`` inside a namespace shaped as ``link``; skip (and say why) when it cannot be made.

    The command runs in its own session; when it ends (also when it was killed, say by the kernel's
    OOM killer), on timeout (``subprocess.TimeoutExpired`` is raised) or on an interrupt, whatever is
    left of its process group is killed, so no server it started outlives it."""
    why = unavailable(link)
    if why is not None:
        return LinkRun(link, skipped=why)
    proc = subprocess.Popen(_inner(link, argv), start_new_session=True)
    try:
        return LinkRun(link, returncode=proc.wait(timeout_s))
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # the group is gone: nothing was left behind
            pass
        proc.wait()


def shape(link: Link) -> None:
    """Inside the namespace: bring ``lo`` up and shape it; ``LinkUnavailable`` names the step that failed."""
    steps = [["ip", "link", "set", "lo", "up"], *link.tc_commands()]
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True)
        if done.returncode != 0:
            err = done.stderr.strip() or f"exit code {done.returncode}"
            if "netem" in step and "unknown" in err.lower():
                raise LinkUnavailable(f"this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM is off), which "
                                      f"--link-delay-us needs (tc: {err})")
            raise LinkUnavailable(f"'{' '.join(step)}' failed: {err}")


def rerun_on_link(module: str, link_gbit: float | None, on_link: bool) -> None:
    """A benchmark's ``--link-gbit`` option: outside a link, run ``python -m module`` again with the
    same arguments plus ``--on-link`` inside one, and exit with its code (exit 0 after printing
    ``skipped: ...`` when no link can be made); inside one, or without ``--link-gbit``, return."""
    if not link_gbit or on_link:
        return
    link = Link(link_gbit)
    done = run(link, [sys.executable, "-m", module, *sys.argv[1:], "--on-link"])
    if done.skipped is not None:
        print(f"skipped: cannot emulate a {link.describe()} link here: {done.skipped}")
        sys.exit(0)
    sys.exit(done.returncode)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--link-gbit", type=float, required=True, help="link rate, gigabits per second")
    parser.add_argument("--link-delay-us", type=float, default=0.0, help="added one-way delay, microseconds (netem)")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)  # we are in the namespace
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the command and its arguments")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    link = Link(args.link_gbit, args.link_delay_us)
    if args.inside:
        try:
            shape(link)
        except LinkUnavailable as e:
            print(e, file=sys.stderr)
            return 1
        os.execvp(command[0], command)
    result = run(link, command)
    if result.skipped is not None:
        print(f"skipped: cannot emulate a {link.describe()} link here: {result.skipped}", file=sys.stderr)
        return 0
    assert result.returncode is not None
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
