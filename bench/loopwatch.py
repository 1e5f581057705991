"""Runs `python -m colo ARGS...` (the daemon) with its event loop watched: how long the loop stays
away from its selector each time it wakes (what a request that has just arrived waits, at most).

    python bench/loopwatch.py OUT daemon --state-dir ... (what `python -m colo` takes)

SIGUSR1 starts the watch afresh; SIGUSR2 writes to OUT (JSON) the longest stall since then, in wall
time and in the loop thread's CPU time (a loaded machine's share not counted), how many wakes, and
how many stalls were over 5, 10 and 50 ms; the longest single callback and what it was; the
longest run of the cyclic collector on the loop's thread and its generation. Nothing of it is in colo: it wraps the selector
asyncio's loop uses, and works on any checkout's daemon (bench/queue_bench.py --before-daemon).
"""
from __future__ import annotations

import asyncio.events
import gc
import json
import os
import runpy
import selectors
import signal
import sys
import threading
import time

OUT = sys.argv[1]
_w = {"wall": 0.0, "cpu": 0.0, "n": 0, "over5": 0, "over10": 0, "over50": 0, "callback": 0.0, "which": "",
      "gc": 0.0, "gc_gen": -1}
_back = [None, None]  # (perf_counter, thread_time) when the last select returned


def _reset(*_):
    _w.update(wall=0.0, cpu=0.0, n=0, over5=0, over10=0, over50=0, callback=0.0, which="", gc=0.0, gc_gen=-1)
    _back[0] = None


def _dump(*_):
    tmp = OUT + ".tmp"
    with open(tmp, "w") as f:
        json.dump({k: (v * 1000 if k in ("wall", "cpu", "callback", "gc") else v) for k, v in _w.items()}, f)
    os.replace(tmp, OUT)


_select = selectors.EpollSelector.select
_MAIN = threading.get_ident()  # asyncio.run's loop runs on the main thread


def select(self, timeout=None):
    if threading.get_ident() != _MAIN:  # (a worker thread's own selector, if any: not the loop's)
        return _select(self, timeout)
    if _back[0] is not None:
        wall, cpu = time.perf_counter() - _back[0], time.thread_time() - _back[1]
        _w["n"] += 1
        _w["wall"] = max(_w["wall"], wall)
        _w["cpu"] = max(_w["cpu"], cpu)
        _w["over5"] += wall > 0.005
        _w["over10"] += wall > 0.010
        _w["over50"] += wall > 0.050
    try:
        return _select(self, timeout)
    finally:
        _back[0], _back[1] = time.perf_counter(), time.thread_time()


selectors.EpollSelector.select = select
_run = asyncio.events.Handle._run


def run(self):
    """One callback of the loop, timed: the longest and what it was (a task's step names its coroutine)."""
    if threading.get_ident() != _MAIN:
        return _run(self)
    t = time.perf_counter()
    try:
        return _run(self)
    finally:
        took = time.perf_counter() - t
        if took > _w["callback"]:
            _w["callback"], _w["which"] = took, repr(self)[:300]


_gc_at = [0.0]


def collected(phase, info):
    """The collector's runs on the loop's thread: the longest, and its generation."""
    if threading.get_ident() != _MAIN:
        return
    if phase == "start":
        _gc_at[0] = time.perf_counter()
    elif time.perf_counter() - _gc_at[0] > _w["gc"]:
        _w["gc"], _w["gc_gen"] = time.perf_counter() - _gc_at[0], info["generation"]


asyncio.events.Handle._run = run
gc.callbacks.append(collected)
signal.signal(signal.SIGUSR1, _reset)
signal.signal(signal.SIGUSR2, _dump)
sys.argv = ["colo", *sys.argv[2:]]
runpy.run_module("colo", run_name="__main__", alter_sys=True)
