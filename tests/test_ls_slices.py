"""A long listing holds no other client (issue 41): `ls` of 50,000 queued jobs took the daemon's
loop for 0.2 s (`colo ls`) to 2 s (`ls --json`), every other request waiting behind it. Now it
is made in slices with the loop free between them, from the jobs as they were when it was asked
for (listing.Listing.ls, colo/daemon/slices.py). A real daemon over a store of 50,000 held jobs,
real clients on its socket; the order of replies is what is checked, never a time.

The tests send the listing and the small request back to back (two sends microseconds apart); the
first looks at the listing's socket at once when the small request's answer has come. What they
assume is only that the test process is not kept off the CPU for the rest of the listing's making
(most of a second, spread over slices) between two system calls.
"""
from __future__ import annotations

import socket

import pytest

from colo import protocol
from colo.jobs import JobSpec
from colo.node import fakegpu
from colo.store import Store
from colo.client import Client
from harness.daemon import DaemonProc

N = 50_000
GiB = 1 << 30


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """A daemon whose store holds N queued jobs, held (nothing starts; the listing is what is
    measured, not the scheduler)."""
    root = tmp_path_factory.mktemp("lsslices")
    state = root / "gpus"
    fakegpu.create(state, count=2, mem=16 * GiB)
    (root / "state").mkdir(mode=0o711)
    s = Store(root / "state" / "colo.db")
    with s.tx():
        for i in range(N):
            s.add_job(JobSpec(argv=["true", str(i)], gpu_mem=(1 + i % 8) * GiB, workdir="/tmp", name=f"q{i}"),
                      0, 0, "root", held_by="root")
    s.close()
    d = DaemonProc(root, state).start()
    yield d
    d.proc.terminate()
    d.proc.wait(120)


def _send(d: DaemonProc, line: bytes) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.connect(str(d.socket))
    s.sendall(line)
    return s


def _reply(s: socket.socket) -> dict:
    parts = [b""]
    while not parts[-1].endswith(b"\n"):
        parts.append(s.recv(1 << 20))
        assert parts[-1], "the daemon closed the connection mid-reply"
    s.close()
    return protocol.loads(b"".join(parts))


def _whole_line_waiting(s: socket.socket) -> bool:
    """Whether `s` holds a whole reply line, unread (looked at without waiting or taking it)."""
    try:
        data = s.recv(1 << 20, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return False
    return data.endswith(b"\n")


def _back_to_back(d: DaemonProc, first: bytes, second: bytes) -> tuple[socket.socket, socket.socket]:
    """Both connections open and both requests sent but for their last byte; then the first's, then
    the second's: the daemon has the whole first request no later than the second."""
    a, b = _send(d, first[:-1]), _send(d, second[:-1])
    a.sendall(b"\n")
    b.sendall(b"\n")
    return a, b


def test_hello_is_answered_while_a_long_listing_is_made(big):
    """A terminal's `colo ls` of a kind of listing not asked for before (a `cut` of its own: every
    row made afresh, its reply a few rows): `hello`, asked just after it, is answered before the
    listing's reply is there (before: the listing held the loop to the end, and its reply was
    whole in its socket before the `hello` was read)."""
    fields = ["id", "name", "user", "state", "gpus", "mode", "budget", "submitted_at", "reason"]
    a, b = _back_to_back(big, protocol.request("ls", fields=fields, all=False, cut=57, head=20),
                         protocol.request("hello"))
    hello = _reply(b)
    listing_done_first = _whole_line_waiting(a)
    got = _reply(a)
    assert hello["ok"] and got["ok"]
    assert [r[0] for r in got["result"]["rows"]] == list(range(1, 21))  # the front of the queue
    assert got["result"]["left"] == {"queued": N - 20}
    assert not listing_done_first, "the listing's whole reply was there before `hello` was answered"


def test_a_listing_is_the_queue_as_it_was_when_asked_for(big):
    """`ls --json` of every queued job, and a cancel of the last one asked just after it: the cancel
    is answered while the listing is made, and the listing still shows that job queued, as it was
    (no row made from the job as it is now, none torn); the next listing shows it gone."""
    last = N
    a, b = _back_to_back(big, protocol.request("ls", all=False), protocol.request("cancel", id=last))
    cancel = _reply(b)
    got = _reply(a)
    assert cancel["ok"], cancel
    rows = got["result"]
    assert len(rows) == N and [r["id"] for r in rows] == list(range(1, N + 1))
    assert rows[-1]["state"] == "queued" and rows[-1]["name"] == f"q{last - 1}"
    after = _reply(_send(big, protocol.request("ls", all=False, names=[f"q{last - 1}"])))["result"]
    assert after == []


def test_top_shows_the_front_of_a_long_queue(big):
    """`colo top`'s reply, made in slices as `ls` is: the first 500 queued jobs in the queue's order
    (here their ids: one priority, submitted in order), whole summaries."""

    got = Client(big.socket, timeout=120).top()
    queued = [j for j in got["jobs"] if j["state"] == "queued"]
    assert [j["id"] for j in queued] == list(range(1, 501))
    assert all(j["name"] == f"q{j['id'] - 1}" for j in queued)


def test_a_kept_listing_follows_the_queue(big):
    """`colo ls` asked again with nothing changed is sent from the rows kept at the first (the
    queue and its decisions are then not copied: listing.Listing.ls), and is the same listing; a
    job cancelled after it is gone from the next one, the others as before."""
    fields = ["id", "name", "user", "state", "gpus", "mode", "budget", "submitted_at", "reason"]
    ask = protocol.request("ls", fields=fields, all=False, cut=60, tasks=False)
    first = _reply(_send(big, ask))["result"]
    again = _reply(_send(big, ask))["result"]
    assert again == first and len(first["rows"]) >= N - 1
    gone = first["rows"][-2][0]
    assert _reply(_send(big, protocol.request("cancel", id=gone)))["ok"]
    after = _reply(_send(big, ask))["result"]
    assert [r for r in first["rows"] if r[0] != gone] == after["rows"]
    only = _reply(_send(big, protocol.request("ls", fields=fields, all=False, cut=60, states=["queued"],
                                              refs=[str(gone)])))["result"]
    assert only["rows"] == []
