"""The relay (``fanout``): servers forwarding versions down a tree the trainer plans.

The end-to-end test runs on an emulated cluster (``asyncsync.cluster``: a trainer host and four server
hosts, each on its own shaped link); where none can be made (not root) the same run goes over
loopback, and says so. The trainer runs in its own process (``relay_trainer.py``, inside the
trainer's namespace): blocking versions down a chain, one interior server killed with SIGKILL while
it relays, its return as a leaf, then async versions drained by close().
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from asyncsync import cluster
from asyncsync.cluster import Cluster
from asyncsync.config import ConfigError, WeightSyncConfig
from asyncsync.engines import make_engine
from asyncsync.netns import Link
from asyncsync.protocol.device import HostRuntime
from asyncsync.protocol.frames import FrameHeader, VersionFrames
from asyncsync.protocol.group import free_port
from asyncsync.protocol.keys import new_key
from asyncsync.protocol.wire import BucketMeta, GroupSpec, InitGroupRequest, UpdateRequest, WireError
from asyncsync.transport.relay import RelayTree
from asyncsync.transport.relay import slow_hops
from asyncsync.transport.topology import GroupLayout

HERE = Path(__file__).parent
# Qwen2 in float32, 27 MB: 14 buckets of 2 MiB, a version ~0.4 s per hop at the links' 0.5 gbit/s.
MODEL = {"family": "qwen2", "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 768, "num_layers": 6,
         "num_heads": 4, "num_kv_heads": 2, "seed": 5}
LINK = Link(gbit=0.5)
SERVERS = 4
DEAD_SERVER_BUDGET_S = 3.0  # a version whose interior server dies takes at most this much longer


# -- planning and messages --------------------------------------------------------------------------

def test_a_chain_and_a_tree_place_every_server_once_below_the_root():
    chain = RelayTree.plan(["a", "b", "c", "d"], 1)
    assert chain.edges() == [("a", "b"), ("b", "c"), ("c", "d")]
    assert chain.parent("a") is None and chain.parent("d") == "c" and chain.depth == 4
    assert chain.describe() == "trainer -> a -> b -> c -> d"
    tree = RelayTree.plan(list("abcdefgh"), 2)
    assert tree.below("a") == ("b", "c") and tree.below("d") == ("h",) and tree.below("h") == ()
    assert sorted(lower for _, lower in tree.edges()) == list("bcdefgh") and tree.depth == 4
    with pytest.raises(ValueError, match="twice"):
        RelayTree.plan(["a", "a"], 1)


def test_auto_picks_a_chain_unless_the_servers_far_outnumber_the_buckets():
    assert RelayTree.auto_fanout(8, 32) == 1       # (32 + 7) bucket-times beat 2 x (32 + 3)
    assert RelayTree.auto_fanout(4, 4) == 1
    assert RelayTree.auto_fanout(512, 32) == 2     # a chain's 543 bucket-times against 2 x (32 + 8)
    assert RelayTree.auto_fanout(64, 1) > 1


def test_init_group_carries_relay_edges_and_refuses_what_cannot_be_one():
    spec = GroupSpec("10.0.0.1", 29500, 2, "g", "gloo", 60.0, key=new_key())
    edge = GroupSpec("10.0.0.1", 29500, 2, "g.relay1.0", "stream", 60.0, key=new_key())
    req = InitGroupRequest(spec, 1, relay=(edge,))
    assert InitGroupRequest.from_json(json.loads(json.dumps(req.to_json()))) == req
    assert "relay" not in InitGroupRequest(spec, 1).to_json()  # a direct server's request is as before
    with pytest.raises(WireError, match="two ranks"):
        InitGroupRequest(spec, 1, relay=(GroupSpec("10.0.0.1", 29501, 3, "e", "gloo", 60.0, key=new_key()),))
    with pytest.raises(WireError, match="two ranks"):  # host weights go down a stream, never a gloo edge
        InitGroupRequest(spec, 1, relay=(GroupSpec("10.0.0.1", 29501, 2, "e", "gloo", 60.0, key=new_key()),))
    with pytest.raises(WireError, match="one rank"):
        InitGroupRequest(spec, 1, more_groups=(spec,), relay=(edge,))
    with pytest.raises(WireError, match=r"relay\[0\]\.key: data-plane protocol 3 keys every group"):
        InitGroupRequest(spec, 1, relay=(dataclasses.replace(edge, key=""),))


def test_fanout_is_checked_at_load():
    assert WeightSyncConfig.from_dict({"fanout": "auto"}).fanout == "auto"
    assert WeightSyncConfig.from_dict({"fanout": 2}).fanout == 2
    for bad in (0, "tree", True, 65):
        with pytest.raises(ConfigError, match="fanout"):
            WeightSyncConfig.from_dict({"fanout": bad})
    with pytest.raises(ConfigError, match="group_per_server"):
        WeightSyncConfig.from_dict({"fanout": 1, "group_per_server": True, "async_weight_update": True})


def test_the_trainers_group_holds_the_root_and_the_servers_that_cannot_relay():
    cfg = WeightSyncConfig.from_dict({"fanout": 1, "servers": [
        "http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000",
        {"url": "http://10.0.0.4:30000", "kind": "sglang"}, "http://10.0.0.5:8000"]})
    engines = [make_engine(s, 1.0) for s in cfg.servers]
    sizes = {e.url: 1 for e in engines} | {"http://10.0.0.5:8000": 2}  # an engine of two data-plane ranks
    layout = GroupLayout.of(cfg, engines, sizes, HostRuntime())
    (tree,) = layout.trees
    assert tree.order == ("http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000")
    assert [(p.name, specs[0].world_size) for p, specs in layout.groups] == [("asyncsync", 1 + 1 + 2), ("sglang", 2)]
    root, second, third, sglang, wide = (layout.membership(e) for e in engines)
    assert root[1] == 1 and wide[1] == 2 and root[2] == (second[0][0],) and second[2] == (third[0][0],)
    assert third[2] == () and sglang[2] == () and wide[2] == ()  # a leaf, SGLang and a wide engine relay nothing
    assert all(spec.world_size == 2 and spec.host == cfg.master_addr for spec in layout.edges)
    assert all(spec.backend == "stream" and spec.key for spec in layout.edges), "host weights relay down keyed streams"
    specs = [s for _, group in layout.groups for s in group] + layout.edges
    assert len({s.port for s in specs}) == 1, "every group and edge meets in the trainer's one store"
    assert len({s.key for s in specs if s.key}) == len(specs) - 1, "a key per group and edge (SGLang's has none)"
    back = GroupLayout.of(cfg, engines, sizes, HostRuntime(), seniority=["http://10.0.0.2:8000", "http://10.0.0.3:8000"])
    assert back.trees[0].order[-1] == "http://10.0.0.1:8000", "a server that came back is a leaf"


def test_a_hop_far_slower_than_the_others_is_found_but_not_a_slow_leaf_or_root():
    chain = (RelayTree.plan(["a", "b", "c", "d", "e"], 1),)
    assert slow_hops(chain, {"a": 1.0, "b": 1.05, "c": 1.1, "d": 1.15, "e": 1.2}) == {}
    found = slow_hops(chain, {"a": 1.0, "b": 5.0, "c": 5.05, "d": 5.1, "e": 5.15})
    assert list(found) == ["b"] and found["b"] > 50
    assert slow_hops(chain, {"a": 1.0, "b": 1.05, "c": 1.1, "d": 1.15, "e": 9.0}) == {}  # a leaf holds no one
    assert slow_hops(chain, {"a": 9.0, "b": 9.05, "c": 9.1, "d": 9.15, "e": 9.2}) == {}  # nor is the root judged


def test_a_lost_frame_is_refused_with_what_happened():
    request = UpdateRequest(3, (BucketMeta(("w",), ("float32",), ((4,),), 16),), checksum=True)
    frames = VersionFrames.of(request)
    why = frames.mismatch(FrameHeader.parse(frames.lost().tensor()), 1, 16)
    assert why is not None and "lost version 3" in why


# -- end to end -------------------------------------------------------------------------------------

class Hosts:
    """Where the trainer and the servers run: an emulated cluster's namespaces, or loopback."""

    def __init__(self, made: Cluster | None):
        self.cluster = made
        self.ports = {f"s{i}": 8000 if made else free_port() for i in range(SERVERS)}

    def address(self, host: str) -> str:
        return self.cluster.address(host) if self.cluster else "127.0.0.1"

    def url(self, host: str) -> str:
        return f"http://{self.address(host)}:{self.ports[host]}"

    def popen(self, host: str, argv: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
        return self.cluster.popen(host, argv, **kwargs) if self.cluster else subprocess.Popen(argv, **kwargs)


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    why = cluster.unavailable()
    if why is not None:
        print(f"no emulated cluster here ({why}): the relay runs over loopback")
        yield Hosts(None)
        return
    with Cluster({"trainer": LINK, **{f"s{i}": LINK for i in range(SERVERS)}}) as made:
        yield Hosts(made)


@pytest.mark.slow
def test_a_relayed_chain_serves_the_trainers_bytes_and_heals_around_a_killed_interior_server(hosts, tmp_path):
    model_yaml = tmp_path / "model.yaml"
    model_yaml.write_text(yaml.safe_dump({"model": MODEL}))

    def serve(host: str) -> subprocess.Popen[Any]:
        return hosts.popen(host, [sys.executable, "-m", "asyncsync.cli", "--log-level", "WARNING", "serve", "--host",
                                  hosts.address(host), "--port", str(hosts.ports[host]), "--model-config", str(model_yaml)])

    names = [f"s{i}" for i in range(SERVERS)]
    urls = [hosts.url(h) for h in names]
    procs = {h: serve(h) for h in names}
    trainer = None
    try:
        args = {"urls": urls, "master_addr": hosts.address("trainer") if hosts.cluster else "127.0.0.1",
                "model": MODEL, "victim": urls[1], "victim_pid": procs["s1"].pid, "kill_after": 0.35, "dir": str(tmp_path)}
        trainer = hosts.popen("trainer", [sys.executable, str(HERE / "relay_trainer.py"), json.dumps(args)])
        wait_for(lambda: (tmp_path / "killed").exists() or trainer.poll() is not None, 600)
        assert trainer.poll() is None, f"the trainer side failed (exit code {trainer.returncode})"
        procs["s1"].wait(10)  # killed by the trainer side, mid-version
        procs["s1"] = serve("s1")
        (tmp_path / "restarted").write_text("")
        assert trainer.wait(600) == 0
    finally:
        for p in [*procs.values(), *([trainer] if trainer else [])]:
            p.kill()
            p.wait()
    seen = json.loads((tmp_path / "seen.json").read_text())
    versions = {int(v): row for v, row in seen["versions"].items()}

    assert seen["tree"] == urls, "a chain in config order: trainer -> s0 -> s1 -> s2 -> s3"
    for v in (1, 2, 4, 5):  # every server serves exactly the trainer's bytes of every version
        row = versions[v]
        assert row["failures"] == {} and row["servers"] == {u: v for u in urls}
        for url, answer in row["served"].items():
            assert answer == {"version": v, "same": True}, f"{url} at version {v}"

    assert versions[2]["delta_buckets"] > 0, "version 2 went down the chain as deltas, rebuilt at every server"

    killed = versions[3]
    survivors = [u for u in urls if u != urls[1]]
    assert set(killed["failures"]) == {urls[1]}, "only the killed server misses version 3"
    assert set(killed["repaired"]) == set(urls[2:]), "the servers below it got version 3 again"
    assert killed["servers"] == {u: 3 for u in survivors}
    for url, answer in killed["served"].items():
        assert answer == {"version": 3, "same": True}, f"{url} serves a mix or another version"
    print(f"relay: version 1 {versions[1]['s']:.2f} s; version 3, s1 killed {seen['kill_s']:.2f} s in: "
          f"{killed['s']:.2f} s, {', '.join(killed['repaired'])} repaired")
    assert killed["s"] <= versions[1]["s"] + DEAD_SERVER_BUDGET_S, (killed["s"], versions[1]["s"])

    assert seen["tree_after"] == [*survivors, urls[1]], "the restarted server rejoined as the chain's leaf"

    done = seen["async"]
    assert done["errors"] == [] and done["failed"] == 0
    assert done["sent"][-1] == 9 and done["sent"] == sorted(done["sent"]), "close() drained the last version"
    for url, answer in done["served"].items():
        assert answer == {"version": 9, "same": True}, f"{url} after the async versions"


def wait_for(ready: Callable[[], bool], timeout_s: float) -> None:
    give_up = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < give_up, "timed out"
        time.sleep(0.1)


@pytest.mark.slow
def test_a_slow_hop_moves_to_a_leaf_and_holds_no_other_server(tmp_path):
    """s1's link is a tenth of the others': a version it relays is held by it, all the servers below
    it with it; it is then moved to the chain's leaf, and the others serve the next version without
    waiting for it."""
    why = cluster.unavailable()
    if why is not None:
        pytest.skip(f"a slow link needs an emulated cluster: {why}")
    model_yaml = tmp_path / "model.yaml"
    model_yaml.write_text(yaml.safe_dump({"model": MODEL}))
    links = {"trainer": LINK, **{f"s{i}": LINK for i in range(SERVERS)}, "s1": Link(gbit=LINK.gbit / 10)}
    with Cluster(links) as made:
        hosts = Hosts(made)
        names = [f"s{i}" for i in range(SERVERS)]
        urls = [hosts.url(h) for h in names]
        procs = [hosts.popen(h, [sys.executable, "-m", "asyncsync.cli", "--log-level", "WARNING", "serve", "--host",
                                 hosts.address(h), "--port", str(hosts.ports[h]), "--model-config", str(model_yaml)])
                 for h in names]
        try:
            args = {"scenario": "slow", "urls": urls, "master_addr": hosts.address("trainer"), "model": MODEL,
                    "dir": str(tmp_path)}
            trainer = hosts.popen("trainer", [sys.executable, str(HERE / "relay_trainer.py"), json.dumps(args)])
            procs.append(trainer)
            assert trainer.wait(600) == 0
        finally:
            for p in procs:
                p.kill()
                p.wait()
    seen = json.loads((tmp_path / "seen.json").read_text())
    rows = [seen[f"v{v}"] for v in (1, 2, 3)]
    print("slow hop: " + "; ".join(f"version {v} {r['s']:.2f} s, the others served it at {r['fast_s']:.2f} s"
                                   for v, r in enumerate(rows, 1)) + f"; events {seen['events']}")
    assert seen["tree"] == urls
    for row in rows:  # every server, the slow one too, serves the trainer's bytes
        assert row["failures"] == {} and all(a["same"] for a in row["served"].values())
    (demoted,) = [v for kind, url, v in seen["events"] if kind == "demoted" and url == urls[1]]
    assert demoted in (1, 2), "a hop that slow is found within two versions"
    held, freed = rows[demoted - 1], rows[demoted]
    assert held["fast_s"] > 0.5 * held["s"], "while it relayed, the slow hop held the servers below it"
    assert freed["fast_s"] < 0.4 * freed["s"], "as the leaf it holds no one: the others serve the version long before it"
    assert seen["tree_after"] == [urls[0], urls[2], urls[3], urls[1]], "the slow server is the chain's leaf"
