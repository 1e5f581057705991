"""A call that blocks for a job's whole life (waiting for its exit), run on a thread of its own
and awaited by the loop (the launcher's followers)."""
from __future__ import annotations

import asyncio
import threading


async def blocking(fn, *args):
    """Run a call that blocks for a job's whole life (waiting for its exit) on a thread of its
    own. The thread is a daemon thread, so stopping colo never waits for it: the job runs on and
    is found again at the next start. (The shared worker pool would hold shutdown until every
    job had ended, and cap the number of jobs that can run at once.)"""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(result, error) -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    def run() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting task
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:
            pass  # the loop is closed: colo stopped while the job ran

    threading.Thread(target=run, name=f"colo-wait-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    return await fut
