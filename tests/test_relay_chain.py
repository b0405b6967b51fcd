"""A chain of eight relaying servers on an emulated cluster, each host on a slow link (bucket-times of
~0.34 s): whole versions with no repair in steady state, a partition between two adjacent servers
that costs one version's repair (after it, and when it is there at connect, none), and a server
killed at the chain's middle that leaves the others served.

One cluster and eight ``asyncsync serve`` processes serve the module; each test runs its own trainer
process (``chain_trainer.py``, in the trainer's namespace, a scenario per run), answers the steps it
asks for (a partition, made with ``Cluster.partition``: the two hosts drop each other's packets
silently), and judges what it wrote: every server's bytes against the trainer's at every version,
versions, repairs, events, and time budgets (not exact times: two cores are shared here). Skipped
where no cluster can be made (not root, no ``ip``).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from asyncsync import cluster
from asyncsync.cluster import Cluster
from asyncsync.netns import Link

HERE = Path(__file__).parent
# Qwen2 in float32, ~10 MB: six buckets of 2 MiB; at the links' 50 Mbit/s a bucket takes ~0.34 s per hop.
MODEL = {"family": "qwen2", "vocab_size": 2048, "hidden_size": 256, "intermediate_size": 768, "num_layers": 2,
         "num_heads": 4, "num_kv_heads": 2, "seed": 7}
BUCKET = "2MiB"
LINK = Link(gbit=0.05)
SERVERS = 8
NAMES = [f"s{i}" for i in range(SERVERS)]
PORT = 8000
PAIR = ("s3", "s4")  # the adjacent servers a partition separates: the middle of the chain
# Each bucket's deadline 4x its measured time (the default is 8x): a hop here takes about one bucket-time,
# so the chain's last server gets its first frame ~7 bucket-times (~2.4 s) after it posted its receive,
# past one bucket's deadline (~2 s). With depth-blind deadlines it missed every whole version.
DEADLINES = {"broadcast_factor": 4.0}


@dataclass
class Chain:
    cluster: Cluster
    procs: dict[str, subprocess.Popen[Any]]
    model_yaml: Path

    def url(self, host: str) -> str:
        return f"http://{self.cluster.address(host)}:{PORT}"

    @property
    def urls(self) -> list[str]:
        return [self.url(h) for h in NAMES]

    def serve(self, host: str) -> None:
        self.procs[host] = self.cluster.popen(host, [
            sys.executable, "-m", "asyncsync.cli", "--log-level", "WARNING", "serve", "--host",
            self.cluster.address(host), "--port", str(PORT), "--model-config", str(self.model_yaml)])

    def run(self, scenario: str, out: Path, versions: int, timeout_s: float = 600, **extra: Any) -> dict[str, Any]:
        """One trainer process through ``scenario``, its steps answered; what it saw."""
        args = {"scenario": scenario, "urls": self.urls, "master_addr": self.cluster.address("trainer"),
                "model": MODEL, "bucket_bytes": BUCKET, "bucket_bytes_n": 2 << 20, "versions": versions,
                "dir": str(out), "deadlines": DEADLINES, **extra}
        trainer = self.cluster.popen("trainer", [sys.executable, str(HERE / "chain_trainer.py"), json.dumps(args)])
        partitioned = False
        try:
            give_up = time.monotonic() + timeout_s
            while trainer.poll() is None:
                assert time.monotonic() < give_up, f"the trainer side ran past {timeout_s} s"
                if (out / "want-partition").exists() and not partitioned:
                    self.cluster.partition(*PAIR)
                    partitioned = True
                    (out / "did-partition").write_text("")
                time.sleep(0.05)
            assert trainer.returncode == 0, f"the trainer side failed (exit code {trainer.returncode})"
        finally:
            trainer.kill()
            trainer.wait()
            if partitioned:
                self.cluster.heal(*PAIR)
        return json.loads((out / "seen.json").read_text())


@pytest.fixture(scope="module")
def chain() -> Iterator[Chain]:
    why = cluster.unavailable()
    if why is not None:
        pytest.skip(f"the chain needs an emulated cluster: {why}")
    with tempfile.TemporaryDirectory() as tmp, Cluster({"trainer": LINK, **{h: LINK for h in NAMES}}) as made:
        model_yaml = Path(tmp) / "model.yaml"
        model_yaml.write_text(yaml.safe_dump({"model": MODEL}))
        made_chain = Chain(made, {}, model_yaml)
        try:
            for host in NAMES:
                made_chain.serve(host)
            yield made_chain
        finally:
            for p in made_chain.procs.values():
                p.kill()
                p.wait()


def versions_of(seen: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {int(v): row for v, row in seen["versions"].items()}


def assert_served(rows: dict[int, dict[str, Any]], urls: list[str], versions: list[int]) -> None:
    """Every one of ``urls`` took each of the run's ``versions`` (rows) and serves exactly the trainer's
    bytes of it; the version numbers only grow."""
    for n in versions:
        row, v = rows[n], rows[n]["version"]
        assert row["failures"] == {}, (v, row["failures"])
        assert {u: row["servers"].get(u) for u in urls} == {u: v for u in urls}, v
        for url in urls:
            assert row["served"][url] == {"version": v, "same": True}, f"{url} at version {v}"
    numbers = [rows[n]["version"] for n in sorted(rows)]
    assert numbers == sorted(set(numbers)), numbers


def edges(tree: list[str]) -> set[frozenset[str]]:
    return {frozenset(pair) for pair in zip(tree, tree[1:])}


def figures(name: str, rows: dict[int, dict[str, Any]], seen: dict[str, Any]) -> None:
    print(f"{name}: " + "; ".join(f"v{v} {r['s']:.2f} s, repaired {len(r['repaired'])}" for v, r in sorted(rows.items()))
          + f"; first-bucket deadline {seen['first_deadline_s']:.2f} s")


@pytest.mark.slow
def test_a_chain_of_eight_takes_whole_versions_with_no_repair(chain, tmp_path):
    seen = chain.run("steady", tmp_path, versions=4)
    rows = versions_of(seen)
    figures("chain of 8, steady", rows, seen)
    assert seen["tree"] == chain.urls, "a chain in config order"
    assert_served(rows, chain.urls, [1, 2, 3, 4])
    assert [rows[v]["repaired"] for v in (2, 3, 4)] == [[], [], []], "a deep server missed its first frame"
    assert [e for e in seen["events"] if e[0] in ("evicted", "repair", "apart", "demoted", "direct")] == []
    steady = statistics.median(rows[v]["s"] for v in (2, 3, 4))
    assert max(rows[v]["s"] for v in (2, 3, 4)) <= 1.5 * steady, "a version took a repair's time"


@pytest.mark.slow
def test_a_partition_between_two_adjacent_servers_costs_one_versions_repair(chain, tmp_path):
    seen = chain.run("partition", tmp_path, versions=5)
    rows = versions_of(seen)
    figures("chain of 8, s3 and s4 partitioned before version 3", rows, seen)
    upper, lower = chain.url(PAIR[0]), chain.url(PAIR[1])
    assert_served(rows, chain.urls, [1, 2, 3, 4, 5])  # version 3 too: its repair brought it to every server
    below = set(chain.urls[NAMES.index(PAIR[1]):])
    assert set(rows[3]["repaired"]) <= below and lower in rows[3]["repaired"], "the servers below the cut, once"
    assert [rows[v]["repaired"] for v in (1, 2, 4, 5)] == [[], [], [], []], "not a repair per version"
    assert frozenset((upper, lower)) not in edges(rows[4]["tree"]) | edges(rows[5]["tree"])
    assert sorted(rows[5]["tree"]) == sorted(chain.urls), "both stay in the chain, apart"
    kinds = [(e[0], e[1]) for e in seen["events"]]
    assert ("apart", lower) in kinds and not [k for k in kinds if k[0] == "evicted"], "no server was evicted"
    steady = statistics.median(rows[v]["s"] for v in (1, 2, 4, 5))
    # The cut costs the servers below it their first frame's deadline (it grew with depth), then one whole version.
    budget = 2 * steady + (1 + NAMES.index(PAIR[1])) * seen["first_deadline_s"] + 5.0
    assert rows[3]["s"] <= budget, (rows[3]["s"], budget)
    assert max(rows[v]["s"] for v in (4, 5)) <= 1.5 * steady, "after the repair, versions are as before the cut"


@pytest.mark.slow
def test_a_partition_there_at_connect_evicts_no_one_and_costs_no_version(chain, tmp_path):
    collective_s = 15.0  # a relay edge that cannot form fails its rendezvous by this
    seen = chain.run("split", tmp_path, versions=3, deadlines={**DEADLINES, "collective_s": collective_s})
    rows = versions_of(seen)
    figures(f"chain of 8, s3 and s4 partitioned at connect ({seen['connect_s']:.1f} s)", rows, seen)
    upper, lower = chain.url(PAIR[0]), chain.url(PAIR[1])
    assert frozenset((upper, lower)) not in edges(seen["tree"]) and sorted(seen["tree"]) == sorted(chain.urls)
    assert_served(rows, chain.urls, [1, 2, 3])
    assert [rows[v]["repaired"] for v in (1, 2, 3)] == [[], [], []]
    kinds = [(e[0], e[1]) for e in seen["events"]]
    assert ("apart", lower) in kinds and not [k for k in kinds if k[0] == "evicted"], kinds
    assert seen["connect_s"] <= 2 * collective_s + 30, "one failed formation, then one around the cut"


@pytest.mark.slow
def test_a_server_killed_at_the_chains_middle_leaves_the_rest_served(chain, tmp_path):
    victim = chain.url(PAIR[0])
    pid = chain.procs[PAIR[0]].pid
    try:
        seen = chain.run("dead", tmp_path, versions=5, victim=victim, victim_pid=pid, kill_after=0.35)
    finally:
        chain.procs[PAIR[0]].kill()  # killed by the trainer side mid-version (then a no-op), or now
        chain.procs[PAIR[0]].wait()
        chain.serve(PAIR[0])  # the module's next test finds eight servers
    rows = versions_of(seen)
    figures("chain of 8, s3 killed during version 3", rows, seen)
    survivors = [u for u in chain.urls if u != victim]
    assert_served(rows, chain.urls, [1, 2])
    assert set(rows[3]["failures"]) == {victim}, "only the killed server misses version 3"
    assert set(rows[3]["repaired"]) == set(chain.urls[NAMES.index(PAIR[0]) + 1:]), "the servers below it, again"
    rows[3]["failures"] = {}
    assert_served(rows, survivors, [3, 4, 5])
    assert [rows[v]["repaired"] for v in (4, 5)] == [[], []]
    assert rows[5]["tree"] == survivors, "the chain closed over the dead server"
    assert ("evicted", victim) in [(e[0], e[1]) for e in seen["events"]]
    steady = statistics.median(rows[v]["s"] for v in (1, 2, 4, 5))
    assert rows[3]["s"] <= 2 * steady + 5.0, "the kill cost at most one whole version more"
