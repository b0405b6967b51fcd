"""The seams of the architecture: what a receiver imports, lazy registries that do what they say, the
pack backend chosen before any server is touched, and one layout policy for both modes."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from asyncsync import ConfigError, WeightSync, WeightSyncConfig
from asyncsync.engines import engine_class, make_engine, register_engine
from asyncsync.engines.reference import ReferenceEngine
from asyncsync.packing import PackBackendUnavailable
from asyncsync.trainer.source import LayoutChanged

from conftest import TINY

REPO = Path(__file__).resolve().parents[1]
TRAINER_STACK = ("aiohttp", "prometheus_client", "yaml", "transformers", "asyncsync.trainer", "asyncsync.transport",
                 "asyncsync.engines", "asyncsync.config", "asyncsync.packing")


def imported_after(code: str) -> list[str]:
    """The modules loaded in a fresh interpreter after running ``code``."""
    probe = f"import sys\n{code}\nimport json\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_the_receiver_side_imports_only_torch():
    loaded = imported_after(
        "import asyncsync.protocol.specs, asyncsync.protocol.wire, asyncsync.protocol.sglang, "
        "asyncsync.protocol.checksum, asyncsync.protocol.group, asyncsync.protocol.staging, asyncsync.protocol.shm, "
        "asyncsync.protocol.lora, asyncsync.protocol.stager, asyncsync.protocol.joined, asyncsync.protocol.intake, "
        "asyncsync.protocol.background\n"
        "import torch\n"
        "from asyncsync.protocol.checksum import crc32c_of\n"
        "assert crc32c_of(torch.arange(9, dtype=torch.uint8)) > 0"
    )
    heavy = [m for m in loaded if any(m == s or m.startswith(s + ".") for s in TRAINER_STACK)]
    assert heavy == [], f"the receiver side pulled in the trainer's stack: {heavy}"


def test_importing_asyncsync_loads_nothing():
    loaded = imported_after("import asyncsync")
    assert "torch" not in loaded and not [m for m in loaded if m.startswith("asyncsync.")]
    loaded = imported_after("import asyncsync.packing")
    assert "asyncsync.packing.native" not in loaded, "listing pack backends must not load (or compile) any"


def test_pack_backend_cpp_is_usable_by_name_in_a_fresh_process():
    loaded = imported_after(
        "import torch\n"
        "from asyncsync.config import WeightSyncConfig\n"
        "from asyncsync.packing import get_backend\n"
        "cfg = WeightSyncConfig(pack_backend='cpp')\n"
        "out = torch.zeros(8, dtype=torch.uint8)\n"
        "assert get_backend(cfg.pack_backend, 'cpu').pack([torch.ones(2, dtype=torch.int32)], [0], out, True) is not None"
    )
    assert "asyncsync.packing.native" in loaded


def test_names_are_checked_when_the_config_loads():
    with pytest.raises(ConfigError, match=r"^pack_backend: 'fastest' is not one of \['auto', 'cpp', 'cuda', 'torch'\]"):
        WeightSyncConfig.from_dict({"pack_backend": "fastest"})
    with pytest.raises(ConfigError, match=r"^servers\[1\]\.kind: 'tgi' is not a registered engine kind"):
        WeightSyncConfig.from_dict({"servers": ["http://127.0.0.1:1", {"url": "http://127.0.0.1:2", "kind": "tgi"}]})


class EchoEngine(ReferenceEngine):
    """A new engine kind: the reference server's protocol under another name."""


def test_a_registered_engine_kind_is_accepted_and_built(monkeypatch):
    from asyncsync.registry import ENGINES

    monkeypatch.setattr(ENGINES, "targets", dict(ENGINES.targets))
    register_engine("echo", f"{__name__}:EchoEngine")
    cfg = WeightSyncConfig.from_dict({"servers": [{"url": "http://127.0.0.1:1", "kind": "echo"}]})
    assert isinstance(make_engine(cfg.servers[0], 1.0), EchoEngine)
    register_engine("broken", "asyncsync.config:WeightSyncConfig")
    with pytest.raises(TypeError, match="not an EngineClient subclass"):
        engine_class("broken")


async def test_a_pack_backend_that_cannot_load_fails_before_any_server_is_contacted(recording_server):
    cfg = WeightSyncConfig.from_dict({"servers": [recording_server.url], "pack_backend": "cuda"})
    sync = WeightSync(cfg)
    with pytest.raises(PackBackendUnavailable, match="needs a CUDA device|packs cuda buffers"):
        sync.connect(torch.nn.Linear(2, 2))  # CPU weights: the CUDA backend cannot pack them
    assert recording_server.calls == [], "no server may be asked to join before the pack backend is known to work"
    assert sync.server_versions == {}


@pytest.mark.parametrize("async_weight_update", [False, True], ids=["blocking", "async"])
def test_a_changed_layout_is_refused_the_same_way_in_both_modes(two_servers, async_weight_update):
    from asyncsync.testing import mixed_dtype_model

    model = mixed_dtype_model(TINY)  # what the servers serve
    start = max(s.get("/version")["version"] for s in two_servers)
    cfg = WeightSyncConfig.from_dict({"servers": [s.url for s in two_servers], "async_weight_update": async_weight_update})
    with WeightSync(cfg) as sync:
        sync.connect(model)
        grown = {**model.state_dict(), "extra.weight": torch.zeros(3)}
        if async_weight_update:
            sync.publish(grown, start + 1)
            sync.wait_snapshot()
            sync.close()
            assert len(sync.errors) == 1 and "the weights changed since connect(): tensor 'extra.weight'" in sync.errors[0]
        else:
            with pytest.raises(LayoutChanged, match="tensor 'extra.weight' was not in the plan; servers only accept"):
                sync.publish(grown, start + 1)
    assert sync.metrics.sent == 0
    assert {s.get("/version")["version"] for s in two_servers} == {start}, "nothing reached the servers"


# -- the layer order docs/design.md states, read from the source (ast), in milliseconds ---------------

PACKAGE = REPO / "asyncsync"


def design_layers() -> list[tuple[int, list[str]]]:
    """The ```layers table of docs/design.md: (layer, module prefixes under ``asyncsync.``)."""
    text = (REPO / "docs" / "design.md").read_text()
    block = text.split("```layers\n", 1)[1].split("```", 1)[0]
    rows = []
    for line in block.splitlines()[1:]:  # the header row names the columns
        columns = re.split(r"\s{2,}", line.strip())  # columns are separated by two spaces or more
        rows.append((int(columns[0]), columns[1].split()))
    return rows


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Every asyncsync module -> the asyncsync modules it imports anywhere (module level, inside
    functions, under TYPE_CHECKING); ``from package import submodule`` counts as the submodule."""
    modules = {module_name(p): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.split(".")[0] == "asyncsync")
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                if base.split(".")[0] != "asyncsync":
                    continue
                subs = {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules}
                deps.update(subs or {base})
                if len(subs) < len(node.names):
                    deps.add(base)
        graph[name] = deps - {name}
    return graph


def layer_of(module: str, layers: list[tuple[int, list[str]]]) -> int | None:
    """The layer of the longest prefix in the table that ``module`` falls under."""
    best: tuple[int, int] | None = None
    for number, prefixes in layers:
        for prefix in prefixes:
            full = "asyncsync" if prefix == "__init__" else f"asyncsync.{prefix}"
            exact = prefix == "__init__"
            if module == full or (not exact and module.startswith(full + ".")):
                if best is None or len(full) > best[0]:
                    best = (len(full), number)
    return best[1] if best else None


def layering_problems(graph: dict[str, set[str]], layers: list[tuple[int, list[str]]]) -> list[str]:
    """Modules the table does not place, imports that go up a layer, and import cycles."""
    problems = [f"{m} is in no layer of docs/design.md" for m in graph if layer_of(m, layers) is None]
    for module, deps in graph.items():
        mine = layer_of(module, layers)
        for dep in deps:
            theirs = layer_of(dep, layers)
            if mine is not None and theirs is not None and theirs > mine:
                problems.append(f"{module} (layer {mine}) imports {dep} (layer {theirs})")
    problems += [f"import cycle: {' -> '.join(c)}" for c in cycles(graph)]
    return problems


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_import_follows_the_layer_order_of_the_design_and_nothing_imports_in_a_circle():
    layers = design_layers()
    graph = import_graph()
    assert len(layers) >= 8 and len(graph) > 50, "the table or the package was not read"
    assert "asyncsync.transport.send" in graph["asyncsync.trainer.roles"], "imports inside the package were not seen"
    assert layering_problems(graph, layers) == []


def folder_problems(graph: dict[str, set[str]], layers: list[tuple[int, list[str]]]) -> list[str]:
    """The folders (asyncsync's subpackages) as the table's layers: each folder's modules are of one
    layer, and no folder imports a folder of a higher layer or is part of a cycle of folders."""
    def folder(module: str) -> str:
        parts = module.split(".")
        return ".".join(parts[:2]) if len(parts) > 2 else module

    spans: dict[str, set[int]] = {}
    for module in graph:
        layer = layer_of(module, layers)
        if layer is not None and folder(module) != module:
            spans.setdefault(folder(module), set()).add(layer)
    problems = [f"{f} holds modules of layers {sorted(ls)}" for f, ls in spans.items() if len(ls) > 1]
    folders: dict[str, set[str]] = {}
    for module, deps in graph.items():
        folders.setdefault(folder(module), set()).update(folder(d) for d in deps if folder(d) != folder(module))
    return problems + layering_problems(folders, layers)


def test_every_folder_is_one_layer_and_no_folder_imports_a_higher_one():
    assert folder_problems(import_graph(), design_layers()) == []


def test_the_folder_check_sees_a_folder_across_layers_and_a_folder_cycle():
    """Negative control: a folder with a module placed in a lower layer than the folder, and two folders
    that import each other through modules that, one by one, follow the layers."""
    layers = [(1, ["protocol"]), (2, ["transport.control", "engines"]), (3, ["transport"])]
    graph = {"asyncsync.transport.control": set(), "asyncsync.engines.a": {"asyncsync.transport.control"},
             "asyncsync.transport.send": {"asyncsync.engines.a"}}
    problems = folder_problems(graph, layers)
    assert "asyncsync.transport holds modules of layers [2, 3]" in problems
    assert "import cycle: asyncsync.engines -> asyncsync.transport" in problems


def test_the_trainer_side_below_the_trainer_never_imports_it():
    graph = import_graph()
    below = [m for m in graph if m.split(".")[1:2] in (["transport"], ["packing"], ["protocol"])]
    assert len(below) > 20
    assert {m: sorted(d for d in graph[m] if d.startswith("asyncsync.trainer")) for m in below
            if any(d.startswith("asyncsync.trainer") for d in graph[m])} == {}


def test_receivers_build_on_the_protocol_not_on_the_trainer_side():
    graph = import_graph()
    # checkpoint: the reference server loads a checkpoint-layout version into its transformers module
    allowed = ("asyncsync.protocol", "asyncsync.receivers", "asyncsync.models", "asyncsync.control",
               "asyncsync.checkpoint")
    wrong = {m: sorted(d for d in deps if not d.startswith(allowed))
             for m, deps in graph.items() if m.startswith("asyncsync.receivers")}
    assert {m: d for m, d in wrong.items() if d} == {}


def test_the_layer_check_sees_a_cycle_an_upward_import_and_an_unplaced_module():
    """Negative control: the checker itself reports each kind of problem."""
    layers = [(1, ["protocol"]), (2, ["packing"]), (3, ["trainer"])]
    graph = {"asyncsync.packing.a": {"asyncsync.packing.b"}, "asyncsync.packing.b": {"asyncsync.packing.a"},
             "asyncsync.protocol.x": {"asyncsync.trainer.y"}, "asyncsync.trainer.y": set(), "asyncsync.elsewhere": set()}
    problems = layering_problems(graph, layers)
    assert "import cycle: asyncsync.packing.a -> asyncsync.packing.b" in problems
    assert "asyncsync.protocol.x (layer 1) imports asyncsync.trainer.y (layer 3)" in problems
    assert "asyncsync.elsewhere is in no layer of docs/design.md" in problems


MAX_CLASS_LINES, MAX_FUNCTION_LINES = 300, 60  # what a reader holds at once (docs/design.md, "Sizes")
MARGIN = 0.05  # a limit is a floor of hygiene, not a target to fill: nothing ends within 5% of it


def size_problems(sources: dict[str, str], margin: float = 0.0) -> list[str]:
    """Classes over ``MAX_CLASS_LINES`` and functions (methods included) over ``MAX_FUNCTION_LINES``,
    docstrings counted, in ``sources`` (module name -> its code); with ``margin``, those within that
    fraction of the limit too."""
    problems = []
    for module, code in sources.items():
        for node in ast.walk(ast.parse(code)):
            limit = {ast.ClassDef: MAX_CLASS_LINES, ast.FunctionDef: MAX_FUNCTION_LINES,
                     ast.AsyncFunctionDef: MAX_FUNCTION_LINES}.get(type(node))
            allowed = int(limit * (1 - margin)) if limit is not None else 0
            if limit is not None and node.end_lineno - node.lineno + 1 > allowed:
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                problems.append(f"{module}: {kind} {node.name} is {node.end_lineno - node.lineno + 1} lines "
                                f"(at most {allowed})")
    return problems


def test_no_class_or_function_of_the_package_is_longer_than_a_reader_can_hold():
    sources = {module_name(p): p.read_text() for p in PACKAGE.rglob("*.py")}
    assert len(sources) > 50, "the package was not read"
    assert size_problems(sources, MARGIN) == []


def test_the_size_check_sees_a_long_class_and_a_long_method():
    """Negative control: a class one line over, holding a method one line over."""
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    padding = "\n".join(f"    y{i} = {i}" for i in range(MAX_CLASS_LINES - MAX_FUNCTION_LINES - 1))
    code = f"class Long:\n    def method(self):\n{body}\n{padding}\n"
    assert size_problems({"asyncsync.long": code}) == [
        f"asyncsync.long: class Long is {MAX_CLASS_LINES + 1} lines (at most {MAX_CLASS_LINES})",
        f"asyncsync.long: function method is {MAX_FUNCTION_LINES + 1} lines (at most {MAX_FUNCTION_LINES})"]
    near = int(MAX_FUNCTION_LINES * (1 - MARGIN)) + 1  # within 5% of the limit, under it
    code = "def near():\n" + "\n".join(f"    x{i} = {i}" for i in range(near - 1)) + "\n"
    assert size_problems({"asyncsync.near": code}) == []
    assert size_problems({"asyncsync.near": code}, MARGIN) == [
        f"asyncsync.near: function near is {near} lines (at most {near - 1})"]


def redefinitions(sources: dict[str, str]) -> list[str]:
    """Top-level functions and classes defined twice in one module of ``sources``: the later one
    silently replaces the first, which is then dead code nobody reads as such."""
    problems = []
    for module, code in sources.items():
        seen = Counter(n.name for n in ast.parse(code).body
                       if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))
        problems += [f"{module}: {name} is defined {k} times" for name, k in seen.items() if k > 1]
    return problems


def test_no_module_of_the_package_defines_a_function_or_class_twice():
    sources = {module_name(p): p.read_text() for p in PACKAGE.rglob("*.py")}
    assert redefinitions(sources) == []
    assert redefinitions({"asyncsync.twice": "def f():\n    pass\n\n\ndef f():\n    pass\n"}) == [
        "asyncsync.twice: f is defined 2 times"]  # the check sees one


# -- a server's state: written by the book's transitions only ------------------------------------

BOOK = "asyncsync.transport.book"


def state_writers(sources: dict[str, str]) -> list[str]:
    """Places outside the book that could write a server's state: a ``ServerRecord`` made or replaced,
    the book's records reached past its transitions, or a frozen record's attribute forced
    (``object.__setattr__`` on a record: a value's own ``__post_init__`` and the messages' decoder
    set their own fields so, and are not records)."""
    problems = []
    for module, code in sources.items():
        if module == BOOK:
            continue
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.Attribute) and node.attr == "_records":
                problems.append(f"{module}:{node.lineno} reaches the book's records")
            elif isinstance(node, ast.Call):
                called = ast.unparse(node.func)
                if called.split(".")[-1] == "ServerRecord":
                    problems.append(f"{module}:{node.lineno} makes a ServerRecord")
                elif called.split(".")[-1] == "replace" and any("record" in ast.unparse(a).lower() for a in node.args):
                    problems.append(f"{module}:{node.lineno} replaces a ServerRecord")
                elif called == "object.__setattr__" and "record" in ast.unparse(node.args[0]).lower():
                    problems.append(f"{module}:{node.lineno} forces an attribute of a frozen value")
    return sorted(problems, key=lambda p: int(p.split(":")[1].split()[0]))


def test_no_module_outside_the_server_book_writes_a_servers_state():
    """What the trainer knows of each server (its version, delta baseline, refusal, lease, eviction)
    lives in ``transport/book.py``'s records and changes only through the book's named transitions."""
    from asyncsync.metrics import SyncMetrics
    from asyncsync.transport.book import ServerBook, ServerRecord

    sources = {module_name(p): p.read_text() for p in PACKAGE.rglob("*.py")}
    assert BOOK in sources and state_writers(sources) == []
    record = ServerRecord("http://a")
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.version = 3  # type: ignore[misc]
    book = ServerBook(["http://a"], SyncMetrics())
    book.versions()["http://a"] = 9  # a read is a copy: writing it changes nothing
    book.baselines()["http://a"] = 9
    assert book.record("http://a") == record
    public = {n for n in vars(ServerBook) if not n.startswith("_")}
    reads = {"record", "versions", "baselines", "refusing", "evicted", "evicted_since", "shared", "ranks", "leased",
             "lease_from", "owing_check"}
    transitions = {"claimed", "reported", "took", "wrote", "loaded", "refused", "missed", "unreachable", "distrusted",
                   "probed", "expelled", "take_expelled", "rejoined", "verified"}
    assert public == reads | transitions, "every public method of the book is a read or a named transition"


def test_the_state_check_sees_each_way_around_the_book():
    """Negative control: each kind of write from outside the book is reported."""
    code = ("from asyncsync.transport.book import ServerRecord\n"
            "import dataclasses\n"
            "def lie(book, record):\n"
            "    book._records['u'] = ServerRecord('u', version=9)\n"
            "    dataclasses.replace(record, baseline=3)\n"
            "    object.__setattr__(record, 'version', 4)\n")
    assert state_writers({"asyncsync.trainer.liar": code}) == [
        "asyncsync.trainer.liar:4 makes a ServerRecord", "asyncsync.trainer.liar:4 reaches the book's records",
        "asyncsync.trainer.liar:5 replaces a ServerRecord", "asyncsync.trainer.liar:6 forces an attribute of a frozen value"]
    assert state_writers({BOOK: code}) == [], "the book itself may"


def benchmark_imports(sources: dict[str, str]) -> list[str]:
    """Imports of the ``benchmarks`` package (anywhere in a module: inside functions too) in
    ``sources`` (file name -> its code): what tests share with benchmarks lives in the package
    (``asyncsync.testing``), so a test never runs a benchmark's code."""
    problems = []
    for name, code in sources.items():
        for node in ast.walk(ast.parse(code)):
            modules = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                       [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            problems += [f"{name}:{node.lineno} imports {m}" for m in modules if m.split(".")[0] == "benchmarks"]
    return problems


def test_no_test_imports_a_benchmark():
    sources = {str(p.relative_to(REPO)): p.read_text() for p in (REPO / "tests").rglob("*.py")}
    assert len(sources) > 50, "the tests were not read"
    assert benchmark_imports(sources) == []
    assert benchmark_imports({"t.py": "import os\n\ndef f():\n    from benchmarks.fuzz import campaign\n",
                              "u.py": "import benchmarks.common as c\nfrom asyncsync import benchmarks_like\n"}) == [
        "t.py:4 imports benchmarks.fuzz", "u.py:1 imports benchmarks.common"]  # the check sees both forms
