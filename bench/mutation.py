"""Mutation testing of colo's pure modules: would a wrong line be noticed by that module's tests?

Each mutant is one small change to the module's syntax tree (a comparison moved off by one or
negated, a number off by one, `and`/`or`, `not` dropped, an arithmetic operator swapped, `min`/`max`
swapped, True/False, a regex's fullmatch() made match(), one entry of a constant table removed).
It is run against the module's own test files (`TESTS` below, or --tests) with `pytest -x -q`:
killed when a test fails (or the run hangs past a timeout), survived when they all pass.
Mutants come from the syntax tree, not the text: docstrings, annotations and the messages of
`raise` are not mutated (what is refused is behaviour, its wording is not); module-level tables
and limits are (mutmut 3 mutates function bodies only, and the tables are where the units and the
limits live).

The checkout is never written to: each mutant is compiled in memory and served to a forked child
by an import hook, and the child runs the tests in a temporary copy of tests/ (so hypothesis'
example database and pytest's caches stay there). Forking after pytest, numpy and hypothesis are
imported spares each run an interpreter's start and those imports (colo itself is imported in
each child, after the hook, so that every module that uses the mutated one gets the mutant).

    python bench/mutation.py                                  # every module in TESTS, every mutant
    python bench/mutation.py colo/sched/policy.py --sample 150 --seed 1
    python bench/mutation.py colo/units.py --tests tests/test_policy.py   # another test set
    python bench/mutation.py colo/units.py --list             # the mutants, not run
    python bench/mutation.py colo/units.py --index 17 40      # only these (#N, as a run prints them)

Prints per module: mutants, killed %, and each survivor (line, change, the line's text).
"""
from __future__ import annotations

import argparse
import ast
import importlib.abc
import importlib.util
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# module -> its own tests (pure: no daemon, no Docker), as pytest arguments
TESTS = {
    "colo/units.py": ["tests/test_units.py"],
    "colo/textsafe.py": ["tests/test_textsafe.py::test_safe_escapes_controls_and_keeps_plain_text",
                         "tests/test_textsafe_more.py"],
    "colo/sched/fairshare.py": ["tests/test_fairshare.py",
                                "tests/test_fairness.py::test_users_take_turns_least_recent_use_first_priority_within_a_user",
                                "tests/test_fairness.py::test_use_decays_with_the_half_life",
                                "tests/test_fairness.py::test_limits_say_which_one_in_a_line"],
    "colo/daemon/validate.py": ["tests/test_validate.py"],
    "colo/sched/policy.py": ["tests/test_policy.py", "tests/test_policy_pins.py"],
    "colo/sched/assess.py": ["tests/test_policy.py", "tests/test_policy_pins.py"],
    "colo/sched/learning.py": ["tests/test_policy.py", "tests/test_policy_pins.py"],
}

_CMP = {ast.Lt: (ast.LtE, ast.GtE), ast.LtE: (ast.Lt, ast.Gt), ast.Gt: (ast.GtE, ast.LtE),
        ast.GtE: (ast.Gt, ast.Lt), ast.Eq: (ast.NotEq,), ast.NotEq: (ast.Eq,), ast.In: (ast.NotIn,),
        ast.NotIn: (ast.In,), ast.Is: (ast.IsNot,), ast.IsNot: (ast.Is,)}
_BIN = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Mult,
        ast.Mod: ast.FloorDiv, ast.Pow: ast.Mult, ast.LShift: ast.RShift, ast.RShift: ast.LShift,
        ast.BitOr: ast.BitAnd, ast.BitAnd: ast.BitOr}
_SYM = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=", ast.In: "in",
        ast.NotIn: "not in", ast.Is: "is", ast.IsNot: "is not", ast.Add: "+", ast.Sub: "-", ast.Mult: "*",
        ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**", ast.LShift: "<<", ast.RShift: ">>",
        ast.BitOr: "|", ast.BitAnd: "&", ast.And: "and", ast.Or: "or"}


@dataclass(frozen=True)
class Mutant:
    index: int  # its place in the module's walk: the same source gives the same numbering
    line: int
    what: str


def _constant_valued(node: ast.AST) -> bool:
    """A table entry: a constant, or arithmetic/tuples of constants (1024**3, ("TiB", 1024**4))."""
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.UnaryOp):
        return _constant_valued(node.operand)
    if isinstance(node, ast.BinOp):
        return _constant_valued(node.left) and _constant_valued(node.right)
    if isinstance(node, ast.Tuple):
        return all(_constant_valued(e) for e in node.elts)
    return False


def _skipped(tree: ast.Module) -> set[int]:
    """ids of nodes not to mutate: docstrings, annotations, `raise` messages, __future__ imports."""
    out: set[int] = set()

    def drop(node: ast.AST | None) -> None:
        if node is not None:
            out.update(id(n) for n in ast.walk(node))

    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            drop(node.returns)
            for a in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs, node.args.vararg,
                      node.args.kwarg]:
                if a is not None:
                    drop(a.annotation)
        elif isinstance(node, ast.AnnAssign):
            drop(node.annotation)
        elif isinstance(node, ast.Raise):
            drop(node.exc)
        elif isinstance(node, ast.ImportFrom):
            drop(node)
    return out


def _sites(tree: ast.Module):
    """(node, mutation) pairs in a fixed order; a mutation is (label, function that changes the node
    in place, or returns the node that replaces it)."""
    skip = _skipped(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Compare):
            for i, op in enumerate(node.ops):
                for new in _CMP.get(type(op), ()):
                    yield node, (f"{_SYM[type(op)]} -> {_SYM[new]}",
                                 lambda n, i=i, new=new: n.ops.__setitem__(i, new()))
        elif isinstance(node, ast.BoolOp):
            new = ast.Or if isinstance(node.op, ast.And) else ast.And
            yield node, (f"{_SYM[type(node.op)]} -> {_SYM[new]}", lambda n, new=new: setattr(n, "op", new()))
        elif isinstance(node, (ast.BinOp, ast.AugAssign)) and type(node.op) in _BIN:
            new = _BIN[type(node.op)]
            yield node, (f"{_SYM[type(node.op)]} -> {_SYM[new]}", lambda n, new=new: setattr(n, "op", new()))
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
            label = "not x -> x" if isinstance(node.op, ast.Not) else "-x -> x"
            yield node, (label, lambda n: n.operand)  # the node is replaced by its operand
        elif isinstance(node, ast.Constant) and type(node.value) in (int, float, bool):
            v = node.value
            if isinstance(v, bool):
                yield node, (f"{v} -> {not v}", lambda n: setattr(n, "value", not n.value))
            elif isinstance(v, int):
                for new in (v + 1, v - 1):
                    yield node, (f"{v} -> {new}", lambda n, new=new: setattr(n, "value", new))
            else:
                for new in ((v * 2, v / 2) if v else (1.0,)):
                    yield node, (f"{v!r} -> {new!r}", lambda n, new=new: setattr(n, "value", new))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("min", "max"):
            new = "max" if node.func.id == "min" else "min"
            yield node, (f"{node.func.id}() -> {new}()", lambda n, new=new: setattr(n.func, "id", new))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "fullmatch":
            # a pattern's $ also matches before a final newline: "A100\n" passes .match(^...$)
            yield node, (".fullmatch() -> .match()", lambda n: setattr(n.func, "attr", "match"))
        elif isinstance(node, (ast.List, ast.Tuple, ast.Set)) and not isinstance(getattr(node, "ctx", None), ast.Store) \
                and len(node.elts) >= 2 and all(_constant_valued(e) for e in node.elts):
            for i, e in enumerate(node.elts):
                yield node, (f"table entry {ast.unparse(e)} removed", lambda n, i=i: n.elts.pop(i))
        elif isinstance(node, ast.Dict) and len(node.keys) >= 2 and all(
                k is not None and _constant_valued(k) for k in node.keys):
            for i, k in enumerate(node.keys):
                yield node, (f"table entry {ast.unparse(k)}: ... removed",
                             lambda n, i=i: (n.keys.pop(i), n.values.pop(i)))


def mutants(source: str) -> list[Mutant]:
    tree = ast.parse(source)
    return [Mutant(i, getattr(node, "lineno", 0), label) for i, (node, (label, _)) in enumerate(_sites(tree))]


def mutated_code(source: str, path: str, index: int):
    tree = ast.parse(source)
    for i, (node, (_, apply)) in enumerate(_sites(tree)):
        if i == index:
            new = apply(node)
            if isinstance(new, ast.AST):
                _replace(tree, node, new)
            break
    else:
        raise IndexError(index)
    return compile(ast.fix_missing_locations(tree), path, "exec")


def _replace(tree: ast.AST, old: ast.AST, new: ast.AST) -> None:
    for parent in ast.walk(tree):
        for field, value in ast.iter_fields(parent):
            if value is old:
                setattr(parent, field, new)
                return
            if isinstance(value, list) and any(v is old for v in value):
                value[next(i for i, v in enumerate(value) if v is old)] = new
                return
    raise LookupError("node not in tree")


class _Serve(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Import hook: module `name` is executed from `code` (the mutant), its __file__ the real one."""

    def __init__(self, name: str, path: str, code) -> None:
        self.name, self.path, self.code = name, path, code

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        return importlib.util.spec_from_file_location(fullname, self.path, loader=self)

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        exec(self.code, module.__dict__)


def run_tests(modname: str, path: str, code, tests: list[str], work: Path, timeout: float,
              verbose: bool) -> tuple[str, float]:
    """("passed" | "failed" | "timeout" | "error:N", seconds) for the tests with `code` as the module."""
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        rc = 99
        try:
            os.setpgid(0, 0)
            if not verbose:
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, 1)
                os.dup2(null, 2)
            os.chdir(work)
            if modname in sys.modules:  # imported before the hook: the tests would not see the mutant
                os._exit(98)
            sys.meta_path.insert(0, _Serve(modname, path, code))
            import pytest
            rc = int(pytest.main(["-x", "-q", "-p", "no:cacheprovider", *tests]))
        finally:
            os._exit(rc)
    deadline = t0 + timeout
    while True:
        got, status = os.waitpid(pid, os.WNOHANG)
        if got:
            break
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "timeout", time.monotonic() - t0
        time.sleep(0.02)
    dt = time.monotonic() - t0
    rc = os.waitstatus_to_exitcode(status)
    # 1: a test failed; 2: collection failed (the mutant broke the module's import): both noticed
    return ("passed" if rc == 0 else "failed" if rc in (1, 2) else f"error:{rc}"), dt


def module_name(rel: str) -> str:
    return rel[:-3].replace("/", ".")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("modules", nargs="*", help=f"module paths (default: {', '.join(TESTS)})")
    ap.add_argument("--tests", nargs="+", help="pytest arguments instead of the module's own tests (TESTS)")
    ap.add_argument("--sample", type=int, default=0, help="run N mutants per module, chosen by --seed (0: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--index", type=int, nargs="+", help="run only these mutants (the #N a run prints), e.g. "
                    "the survivors of an earlier run")
    ap.add_argument("--list", action="store_true", help="print the mutants, run nothing")
    ap.add_argument("--json-out", help="save the results (per module: counts and survivors) here")
    ap.add_argument("-v", "--verbose", action="store_true", help="show pytest's output")
    args = ap.parse_args()
    mods = args.modules or list(TESTS)
    for rel in mods:
        if rel not in TESTS and not args.tests:
            ap.error(f"{rel}: no tests known for it; give --tests")

    import checkout
    checkout.use_colo()
    import numpy  # noqa: F401  imported once here, not in every child
    import pytest  # noqa: F401
    for plugin in ("hypothesis", "pytest_asyncio", "pytest_timeout", "pytest_textual_snapshot"):
        try:
            __import__(plugin)
        except ImportError:
            pass

    results, failed = {}, False
    with tempfile.TemporaryDirectory(prefix="colo-mutation-") as tmp:
        work = Path(tmp)
        shutil.copytree(ROOT / "tests", work / "tests", ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(ROOT / "pyproject.toml", work / "pyproject.toml")
        for rel in mods:
            path = str(ROOT / rel)
            source = Path(path).read_text()
            tests = args.tests or TESTS[rel]
            every = mutants(source)
            chosen = every
            if args.index:
                chosen = [m for m in every if m.index in set(args.index)]
            elif args.sample and args.sample < len(every):
                chosen = sorted(random.Random(args.seed).sample(every, args.sample), key=lambda m: m.index)
            lines = source.splitlines()
            if args.list:
                for m in chosen:
                    print(f"{rel}:{m.line}: #{m.index} {m.what}    | {lines[m.line - 1].strip()[:90]}")
                continue
            name = module_name(rel)
            base, base_s = run_tests(name, path, compile(source, path, "exec"), tests, work, 600, args.verbose)
            if base != "passed":
                print(f"{rel}: its tests do not pass unmutated ({base}): {' '.join(tests)}", file=sys.stderr)
                failed = True
                continue
            timeout = 3 * base_s + 10
            counts = {"passed": 0, "failed": 0, "timeout": 0, "error": 0}
            survivors, errors = [], []
            t0 = time.monotonic()
            for k, m in enumerate(chosen, 1):
                outcome, _ = run_tests(name, path, mutated_code(source, path, m.index), tests, work, timeout,
                                       args.verbose)
                kind = outcome.split(":")[0]
                counts[kind] += 1
                if kind == "passed":
                    survivors.append(m)
                elif kind == "error":
                    errors.append((m, outcome))
                print(f"\r{rel}: {k}/{len(chosen)} run, {len(survivors)} survived", end="", file=sys.stderr,
                      flush=True)
            print(file=sys.stderr)
            ran = len(chosen) - counts["error"]
            killed = counts["failed"] + counts["timeout"]
            pct = 100.0 * killed / ran if ran else 0.0
            print(f"{rel}: {len(every)} mutants, {len(chosen)} run, {killed} killed ({pct:.1f} %: "
                  f"{counts['timeout']} by timeout), {len(survivors)} survived, {counts['error']} errors; "
                  f"tests: {' '.join(tests)}; {time.monotonic() - t0:.0f} s")
            for m in sorted(survivors, key=lambda m: m.line):
                print(f"  survived L{m.line} #{m.index}: {m.what}    | {lines[m.line - 1].strip()[:90]}")
            for m, outcome in errors:
                print(f"  error ({outcome}) L{m.line}: {m.what}")
            results[rel] = {"mutants": len(every), "run": len(chosen), "killed": killed, "killed_pct": round(pct, 1),
                            "survived": [{"line": m.line, "index": m.index, "what": m.what} for m in survivors],
                            "errors": len(errors), "tests": tests, "sample": args.sample, "seed": args.seed}
    if args.json_out and results:
        Path(args.json_out).write_text(json.dumps(results, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
