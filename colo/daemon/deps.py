"""A submit's dependencies as its submitter wrote them (`--after 7`, `--after 12_3`, `--after prep`),
made job ids from the store, as Slurm's afterok reads them: an array's id means all its tasks.

Read strictly: digits are a job id, digits_digits a task of an array (never job 31 for 3_1), a
name the caller's own jobs of that name (the open ones; if none, the newest, and its whole array
when it was a task of one). A task `colo requeue` ran again counts as its newest copy.
"""
from __future__ import annotations

from typing import Callable

from ..jobs import TERMINAL, Job, State
from ..store import Store
from .validate import NAME, Invalid

MAX_REFS = 64  # references one --after (and each of --after-any, --after-fail) may hold
OPEN = frozenset({"queued", "starting", "running"})


def _newest_per_task(rows: list[tuple]) -> list[int]:
    """(id, array ref) rows of one array, oldest first: the newest job of each index."""
    by_index = {}
    for i, ref in rows:
        by_index[ref] = i
    return sorted(by_index.values())


def resolve(store: Store, ref, user: str, flag: str) -> list[int]:
    """The job ids one reference names (Invalid: malformed, or a name or task that is not there)."""
    if isinstance(ref, int) and not isinstance(ref, bool):
        return [ref]  # a client of before names: checked as an id by validate.check_spec
    if not isinstance(ref, str) or not ref:
        raise Invalid(f"{flag} takes job ids, ARRAY_INDEX (12_3) or names, not {ref!r}"[:200])
    a, sep, b = ref.partition("_")
    if ref.isascii() and ref.isdigit():
        i = int(ref)
        rows = store.listing(["id", "array_job", "array"], list(State), refs=[ref])
        tasks = [(j, arr) for j, head, arr in rows if head == i]
        return _newest_per_task(tasks) if tasks else [i]
    if sep and a.isascii() and a.isdigit() and b.isascii() and b.isdigit():
        rows = store.listing(["id", "array"], list(State), refs=[ref])
        hit = [j for j, arr in rows if arr == f"{int(a)}_{int(b)}"]
        if not hit:
            raise Invalid(f"{flag} {ref}: no such task (array {a} has no index {b})")
        return [hit[-1]]
    if not NAME.fullmatch(ref):
        raise Invalid(f"{flag} {ref[:80]!r}: give a job id (7), ARRAY_INDEX (12_3) or a job's name")
    rows = store.listing(["id", "state", "array_job"], list(State), users=[user], names=[ref])
    if not rows:
        raise Invalid(f"{flag} {ref}: no job of yours is named {ref!r}")
    open_ = [j for j, st, _ in rows if st in OPEN]
    if open_:
        return open_
    newest, _, head = rows[-1]
    if head is None:
        return [newest]
    tasks = store.listing(["id", "array"], list(State), refs=[str(head)])
    return _newest_per_task([(j, arr) for j, arr in tasks if arr and arr.startswith(f"{head}_")])


def resolved(store: Store, raw: dict, user: str) -> dict:
    """`raw` (a submit's spec as sent) with its dependencies as job ids."""
    out = dict(raw)
    for key in ("after", "after_any", "after_fail"):
        refs = raw.get(key)
        if not isinstance(refs, list):
            continue  # absent, or not a list: validate.check_spec says so
        flag = "--" + key.replace("_", "-")
        if len(refs) > MAX_REFS:
            raise Invalid(f"{flag} takes up to {MAX_REFS} references (ids, ARRAY_INDEX or names)")
        out[key] = list(dict.fromkeys(i for r in refs for i in resolve(store, r, user, flag)))
    return out


def unmet(j: Job, state_of: Callable[[int], State | None]) -> tuple[str | None, bool]:
    """(why it waits, or None; True if it never can): --after needs success, --after-any an
    end, --after-fail an end without success (Slurm's afterok, afterany, afternotok)."""
    pending = None
    for key, want, ok in (("after", "succeed", (State.SUCCEEDED,)), ("after_any", "end", TERMINAL),
                          ("after_fail", "fail", TERMINAL - {State.SUCCEEDED})):
        for a in getattr(j.spec, key):
            st = state_of(a)
            if st is None or (st in TERMINAL and st not in ok):  # one that never can: said at once
                what = "failed" if key == "after" else f"not met (--{key.replace('_', '-')})"
                return f"dependency {what}: job {a} {st or 'does not exist'}", True
            if st not in ok and pending is None:
                pending = f"waiting for job {a} to {want}"
    return pending, False
