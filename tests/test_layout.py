"""The folder tree is the architecture (ARCHITECTURE.md): these read colo's own imports and check
that nothing imports upward, that no import circle exists, and that the daemon's parts use each
other's public interfaces, not each other's private fields."""
import ast
import functools
import re
from pathlib import Path

import colo

ROOT = Path(colo.__file__).resolve().parent
# what a layer may import besides itself: the shared core (colo/*.py) is everyone's
MAY = {
    "core": set(),
    "store": {"core"},  # the durable state (colo/store/): the only SQL
    "sched": {"core"},
    "node": {"core"},
    "runtimes": {"core", "node"},
    "daemon": {"core", "store", "sched", "node", "runtimes"},
    "tui": {"core"},  # renders what colo.client gives; never NVML, the store or the daemon
    "jupyter": {"core"},  # the kernel provisioner: a client of the daemon, as the TUI is
    "cli": {"core", "store", "sched", "node", "runtimes", "daemon", "tui", "jupyter"},  # the top: `colo daemon`, demo, doctor
}


def _modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = ["colo", *p.relative_to(ROOT).with_suffix("").parts]
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (p, is_pkg)
    return out


MODULES = _modules()


def _imports(name: str) -> set[str]:
    """Every colo module `name` imports, anywhere in it (functions and TYPE_CHECKING blocks too)."""
    path, is_pkg = MODULES[name]
    pkg = name if is_pkg else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:
                if f"{mod}.{a.name}" in MODULES:
                    out.add(f"{mod}.{a.name}")
                elif mod in MODULES:
                    out.add(mod)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in MODULES}
    out.discard(name)
    return out


GRAPH = {m: _imports(m) for m in MODULES}


def _layer(mod: str) -> str:
    if mod == "colo.__main__":  # `python -m colo`: the command
        return "cli"
    parts = mod.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and MODULES[mod][1]) else "core"


def test_the_module_names_are_read():
    assert {"colo.sched.policy", "colo.node.gpu", "colo.daemon.scheduler", "colo.cli.app"} <= set(MODULES)
    assert "colo.sched.interference" in GRAPH["colo.sched.assess"]
    assert _layer("colo.sched.policy") == "sched" and _layer("colo.store") == "store" and _layer("colo.tui") == "tui"


def test_nothing_imports_upward():
    wrong = [f"{m} -> {t}" for m, ts in GRAPH.items() for t in ts
             if _layer(t) != _layer(m) and _layer(t) not in MAY[_layer(m)]]
    assert wrong == []


def test_sql_is_only_in_the_store():
    """Only colo/store/ speaks to SQLite: every other part asks the store."""
    talks = sorted(m for m in MODULES if _layer(m) != "store" and re.search(
        r"^\s*(import sqlite3|from sqlite3 import)", MODULES[m][0].read_text(), re.M))
    assert talks == []
    assert "colo.store.base" in MODULES and re.search(r"^import sqlite3", MODULES["colo.store.base"][0].read_text(), re.M)


# the simulator (`colo sim`) and its world, what jobs really do (docs/sim.md)
SIMULATOR = {"colo.sched.sim", "colo.sched.workloads", "colo.sched.simnode", "colo.sched.simpolicies",
             "colo.sched.oracle", "colo.sched.simresult", "colo.sched.truth", "colo.sched.fitted"}


def _reach(mod: str) -> set[str]:
    """Every colo module `mod` imports, directly or through others."""
    reach, todo = set(), [mod]
    while todo:
        for t in GRAPH[todo.pop()] - reach:
            reach.add(t)
            todo.append(t)
    return reach


def test_the_policy_never_sees_the_simulators_truth():
    assert SIMULATOR <= set(MODULES)
    assert not _reach("colo.sched.policy") & SIMULATOR
    # what reaches the truth is the simulator's: no module beside it shares the truth with the policy
    assert sorted(m for m in MODULES if "colo.sched.truth" in _reach(m) and m not in SIMULATOR
                  and _layer(m) == "sched") == []


def test_no_import_circle():
    state: dict[str, int] = {}  # 1: on the path, 2: done
    circles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(GRAPH[m]):
            if state.get(t) == 1:
                circles.append(path[path.index(t):] + [t])
            elif t not in state:
                visit(t, path + [t])
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m, [m])
    assert circles == []


def test_daemon_parts_use_each_others_interfaces():
    """`self.part._field` reaches into another part's state; a part's own state is `self._field`."""
    reach = []
    for p in (ROOT / "daemon").glob("*.py"):
        tree = ast.parse(p.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                assert not any(isinstance(b, ast.Name) and b.id.endswith("Mixin") for b in node.bases), p.name
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and isinstance(node.value, ast.Attribute) and isinstance(node.value.value, ast.Name)
                    and node.value.value.id in ("self", "d")):
                reach.append(f"{p.name}:{node.lineno} {node.value.value.id}.{node.value.attr}.{node.attr}")
    assert reach == []


REPO = ROOT.parent
CITED = re.compile(r"\b[Ii]nvariants?[ _](\d+(?:(?:,| and|, and) \d+)*)")


def test_every_invariant_cited_is_in_docs_invariants():
    """colo's code, tests and docs cite "invariant N": docs/invariants.md must have each N, and
    ARCHITECTURE.md must lead there."""
    doc = (REPO / "docs" / "invariants.md").read_text()
    have = {int(n) for n in re.findall(r"^### (\d+)\. ", doc, re.M)}
    assert have == set(range(1, max(have) + 1)), sorted(have)
    assert "docs/invariants.md" in (REPO / "ARCHITECTURE.md").read_text()
    files = [p for d in ("colo", "tests", "docs", "bench", "profiles", "workloads", "packaging")
             for p in (REPO / d).rglob("*") if p.suffix in (".py", ".md", ".c", ".h", ".txt", ".sh")]
    files += [p for p in (REPO / "native").rglob("*") if p.suffix in (".c", ".h") and "build" not in p.parts]
    files += [REPO / "README.md", REPO / "ARCHITECTURE.md"]
    cited = {}
    for p in files:
        for m in CITED.finditer(p.read_text(errors="replace")):
            for n in re.findall(r"\d+", m.group(1)):
                cited.setdefault(int(n), f"{p.relative_to(REPO)}: {m.group(0)}")
    assert len(cited) >= 10  # the pattern finds what the tree cites
    assert {n: where for n, where in cited.items() if n not in have} == {}


# the daemon's parts as core.Daemon names them (and as a part names another it holds)
PARTS = {"d", "daemon", "table", "gpus", "engines", "learner", "launcher", "scheduler", "patrol", "sampler",
         "recovery", "retention", "metrics", "onend", "listing", "admission", "store", "cgroups", "external"}


def test_daemon_parts_write_only_their_own_state():
    """`self.part.field = ...` (or `gpus.field = ...` through a local name) writes another part's
    state: a part changes its own fields and others call its methods."""
    wrote = []
    for p in (ROOT / "daemon").glob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for t in targets:
                for x in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    while isinstance(x, ast.Subscript):  # gpus.unbudgeted[u] = ... writes it too
                        x = x.value
                    if not isinstance(x, ast.Attribute):
                        continue
                    owner = x.value
                    if ((isinstance(owner, ast.Attribute) and isinstance(owner.value, ast.Name)
                         and owner.value.id in ("self", "d") and owner.attr in PARTS)
                            or (isinstance(owner, ast.Name) and owner.id in PARTS)):
                        wrote.append(f"{p.name}:{node.lineno} {ast.unparse(x)}")
    assert wrote == []


@functools.cache
def _test_file(p: Path) -> tuple[list[tuple[int, str]], list[tuple[str, int]]]:
    """A file under tests/ as the checks below read it, parsed once a session (three checks read
    every file, and parsing was most of their time): the modules it imports by absolute name, with
    their lines, and the fixtures it defines (_fixtures). Only these are kept, not the tree: a
    session that held the trees made the garbage collector slower for every later test."""
    tree = ast.parse(p.read_text())
    imports = []
    for node in ast.walk(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        imports += [(node.lineno, n) for n in names]
    return imports, _fixtures(tree)


def test_tests_import_the_harness_not_bench():
    """What tests and benches share is tests/harness/: a test imports no bench/ module, but
    test_reliability.py, which runs load_bench's and crash_trials' scenarios themselves."""
    bench = {p.stem for p in (REPO / "bench").glob("*.py")}
    found = []
    for p in (REPO / "tests").rglob("*.py"):
        found += [f"{p.relative_to(REPO)}: {n}" for _, n in _test_file(p)[0] if n.split(".")[0] in bench]
    assert [f for f in found if not f.startswith("tests/test_reliability.py:")] == []
    assert any(f.startswith("tests/test_reliability.py:") for f in found)  # the check reads imports


def _fixtures(tree: ast.AST) -> list[tuple[str, int]]:
    """The fixtures a file defines: its functions decorated with pytest's `fixture` (called or not;
    under the name= it gives, where it gives one), with their lines."""
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for dec in node.decorator_list:
            call = dec if isinstance(dec, ast.Call) else None
            if ast.unparse(call.func if call else dec).split(".")[-1] != "fixture":
                continue
            named = [k.value.value for k in (call.keywords if call else ())
                     if k.arg == "name" and isinstance(k.value, ast.Constant)]
            out.append(((named or [node.name])[0], node.lineno))
    return out


def test_each_fixture_is_defined_in_one_file():
    """The test harness is not copied (issue 44): a fixture name is defined in one file under tests/
    (conftest.py is one). Where modules need it made otherwise, a marker of theirs says how
    (conftest's `node`, `users`, `shared`), or the fixture is theirs alone under a name of its own."""
    where: dict[str, set[str]] = {}
    for p in sorted((REPO / "tests").rglob("*.py")):
        for name, line in _test_file(p)[1]:
            where.setdefault(name, set()).add(f"{p.relative_to(REPO)}:{line}")
    twice = {n: sorted(w) for n, w in where.items() if len({x.rpartition(":")[0] for x in w}) > 1}
    assert twice == {}
    assert {"node", "users", "shared", "native_dir"} <= set(where)  # the check reads fixtures


def test_no_test_module_imports_another_or_conftest():
    """A test module, or conftest, is no library: what test modules share is in tests/harness/ (or
    is a fixture of conftest's), and no file under tests/ imports a test_* module or conftest."""
    found = []
    for p in sorted((REPO / "tests").rglob("*.py")):
        found += [f"{p.relative_to(REPO)}:{line}: {n}" for line, n in _test_file(p)[0]
                  if n.split(".")[0] == "conftest" or n.split(".")[0].startswith("test_")]
    assert found == []


def test_benches_reach_the_harness_through_bench_checkout():
    """bench/checkout.py is the one bench file that touches sys.path (tests/ for tests/harness/,
    the checkout for colo itself); a bench that imports the harness imports it through that."""
    touch, unreached = [], []
    for p in sorted((REPO / "bench").glob("*.py")):
        tree = ast.parse(p.read_text())
        imported = set()
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr == "path"
                    and isinstance(node.value, ast.Name) and node.value.id == "sys"):
                touch.append(f"{p.name}:{node.lineno}")
            elif isinstance(node, ast.ImportFrom) and node.module == "sys" and any(a.name == "path" for a in node.names):
                touch.append(f"{p.name}:{node.lineno}")
            elif isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module.split(".")[0])
        if "harness" in imported and "checkout" not in imported:
            unreached.append(p.name)
    assert [t for t in touch if not t.startswith("checkout.py:")] == []
    assert any(t.startswith("checkout.py:") for t in touch)  # the check reads sys.path
    assert unreached == []


def test_no_file_in_colo_is_over_700_lines():
    """A module says what it holds in its name; past 700 lines it holds more than one thing (issue 44:
    the longest were split by what they hold, as colo/sched/sim.py was)."""
    counts = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in ROOT.rglob("*.py")}
    assert {f: n for f, n in counts.items() if n > 700} == {}
    assert counts["sched/sim.py"] > 100  # the check reads the tree
