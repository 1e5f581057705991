"""The suite's shared parts, used by the tests and the benches alike:

daemon.py  DaemonProc (a real daemon in a folder, driven through the real CLI and client), wait_for,
           gpu_node (simulated GPUs), burn (the load tool), as_user and local_user (real users' calls)
node.py    SimNode: a simulated GPU node other users reach, and the daemons started on it; shaped,
           one as a module's `node` marker asks (conftest's `node` and reachable_daemon are built on it)
users.py   real Unix users (made when missing) and code run as one of them (Peer, run_as)
probes.py  looks at a running daemon from outside: its memory, its database, how fast `ls` answers
ledger.py  a job that rewrites its budget ledger as an attacker would
interpose.py  the interposer's C test callers (tests/native_helpers), built and read; the `job` fixture's budget
terminal.py   a user at a terminal: the real CLI on a pty of its own, driven with pexpect (Term)

Fixtures are in tests/conftest.py, each defined once; no test module imports another, or conftest
(tests/test_layout.py checks both). The benches put tests/ on their path to import these; the tests
never import bench/, but test_reliability.py, which runs load_bench's and crash_trials' scenarios.
"""
