"""Shared fixtures: the built native parts, a simulated GPU node, and Docker when present.

Only the NVIDIA driver is replaced (by native/fakegpu); everything else is real. Every fixture of the
suite is here, once (tests/test_layout.py checks): where modules need it made differently, a marker
of theirs says how (`node`, `users`, `shared`: pyproject.toml lists them). What the tests share that
is not a fixture is in tests/harness/; no test module imports another, or this file.
"""
from __future__ import annotations

import os
import random
import shutil
import signal
import uuid
from pathlib import Path

import pytest

from colo.node import native
from harness.interpose import JOB_BUDGET, build_probe
from harness.node import shaped
from harness.users import ensure_users


GiB = 1024**3
REQUIRE_DOCKER = os.environ.get("COLO_REQUIRE_DOCKER") == "1"

# A suite started in the background by a non-interactive shell (`cmd &`, as some runners do)
# inherits SIGINT ignored, and so would every client the tests start: their Ctrl-C would do
# nothing. The tests type Ctrl-C as a user at a terminal does, where it is never ignored.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def native_dir():
    return native.ensure_built()


@pytest.fixture(scope="session")
def probe(native_dir, tmp_path_factory):
    """The interposer's C test caller (tests/native_helpers/interpose_probe.c), linked directly
    against the simulated libcuda (test_interposer*.py)."""
    return build_probe(native_dir, tmp_path_factory.mktemp("probe"))


@pytest.fixture
def fakegpu(tmp_path, native_dir):
    """Two simulated 16 GiB GPUs in a private state file; .env is what a process needs to use them."""
    from colo.node import fakegpu as fg

    state = tmp_path / "fakegpu.state"
    fg.create(state, count=2, mem=16 * GiB)
    return fg.FakeNode(state)


@pytest.fixture
def job(tmp_path, fakegpu):
    """A fresh ledger with a JOB_BUDGET budget and the environment of a job that uses it:
    (env, ledger path)."""
    from colo.node import interposer

    ledger = tmp_path / "ledger"
    interposer.create_ledger(ledger, JOB_BUDGET)
    env = {**os.environ, **fakegpu.env,
           **interposer.job_env(JOB_BUDGET, str(ledger), str(interposer.library_path()))}
    return env, ledger


def _docker_or_none():
    try:
        import docker

        c = docker.from_env(timeout=10)
        c.ping()
        return c
    except Exception as e:  # noqa: BLE001 - any failure means "no engine here"
        return e


@pytest.fixture(scope="session")
def docker_client():
    c = _docker_or_none()
    if isinstance(c, Exception):
        if REQUIRE_DOCKER:
            pytest.fail(f"COLO_REQUIRE_DOCKER=1 but no Docker engine answers: {c}")
        pytest.skip(f"no Docker engine: {c}")
    return c


@pytest.fixture(scope="session")
def session_image(docker_client):
    """The sessions' test image (dash, coreutils) with stty: a window size to read
    (test_sessions.py, test_sessions_held.py)."""
    from colo.runtimes.image import build_local_image
    return build_local_image(docker_client, "colo-test/session:1", extra_files={"/usr/bin/stty": Path("/usr/bin/stty")})


@pytest.fixture(scope="session")
def built(tmp_path_factory):
    """The package, built once a session by packaging/build-deb.sh from a clean clone of HEAD
    (tests/test_package.py, tests/test_systemd.py): (the .deb, the wheel)."""
    from debian_util import build_package

    return build_package(tmp_path_factory.mktemp("pkg"))


@pytest.fixture(scope="session")
def test_image(docker_client):
    """A tiny local image (docker import, no registry) with a shell and coreutils."""
    from colo.runtimes.image import build_local_image

    return build_local_image(docker_client, "colo-test/base:1", with_shell=True)


DOCKER_RUN = uuid.uuid4().hex[:12]  # labels every container the `rt` fixture's runtime starts in this run


@pytest.fixture
def rt(docker_client):
    """A DockerRuntime on the real engine; what it started is removed afterwards (with its volumes)."""
    from colo.runtimes.docker import DockerRuntime

    r = DockerRuntime(docker_client)
    yield r
    r.close()
    for c in docker_client.api.containers(all=True, filters={"label": f"colo.test.run={DOCKER_RUN}"}):
        docker_client.api.remove_container(c["Id"], force=True, v=True)


@pytest.fixture
def launch(tmp_path, test_image):
    """launch(argv, **Launch fields): a Launch of the test image as uid 1234, its log in tmp_path."""
    from colo.runtimes.base import Launch

    def make(argv, **kw):
        job_id = random.randrange(10**8, 10**9)  # other suites' jobs share this engine: avoid their ids
        kw.setdefault("image", test_image)
        kw.setdefault("uid", 1234)
        kw.setdefault("gid", 1234)
        labels = {"colo.test.run": DOCKER_RUN, **kw.pop("labels", {})}
        return Launch(job_id=job_id, argv=argv, log_path=tmp_path / f"{job_id}.log", run_dir=tmp_path,
                      labels=labels, **kw)

    return make


@pytest.fixture(scope="session")
def other_user():
    """A second local user (created when missing) for the permission tests; needs root."""
    import pwd
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("needs root to create a second user")
    name = "colotest2"
    try:
        return pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/sh", name], check=True)
        return pwd.getpwnam(name)


@pytest.fixture(scope="module")
def users(request):
    """Real local users (created when missing) for the tests of what one user can do to another: by
    default two, alice and bob (colotest1, colotest2), and the test is skipped without root. A
    module's `users` marker (in its pytestmark) asks for others: users(n, prefix="colotest",
    root=True); with root=False and without root, the caller's own entry n times (ensure_users)."""
    mark = request.node.get_closest_marker("users")
    n, prefix, root = 2, "colotest", True
    if mark is not None:
        n, prefix, root = _users_args(*mark.args, **mark.kwargs)
    if root and os.geteuid() != 0:
        pytest.skip("needs root to create other users")
    return ensure_users(n, prefix=prefix)


def _users_args(n: int = 2, prefix: str = "colotest", root: bool = True):
    return n, prefix, root


# What makes a test not pure (mark `daemon`, set here): a fixture that builds native parts, reaches
# Docker or makes Unix users (the daemon, fakegpu and the rest depend on one of them), or code of
# the test, of its fixtures or of its module's functions (followed by name) that starts processes
# or calls the helpers that start daemons, Slurm or Debian containers.
NOT_PURE_FIXTURES = {"native_dir", "built", "docker_client", "users", "other_user", "make_dockerd"}
NOT_PURE_NAMES = {"subprocess", "Popen", "fork", "forkpty", "execv", "ensure_built"}
NOT_PURE_HELPERS = {"harness.daemon", "harness.node", "harness.users", "harness.probes", "harness.interpose",
                    "harness.terminal", "slurm_util", "debian_util", "load_bench"}
SLOW_FIXTURES = {"mix_results"}  # pure but long (mark `slow`; others carry the mark themselves)


def _starts_processes(item) -> bool:
    mod = getattr(item, "module", None)
    if mod is None:
        return False
    ns = vars(mod)
    bad = NOT_PURE_NAMES | {k for k, v in ns.items() if getattr(v, "__module__", getattr(v, "__name__", None))
                            in NOT_PURE_HELPERS}
    fixtures = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    todo = [item.function.__code__] + [d.func.__code__ for defs in fixtures.values() for d in defs
                                       if getattr(d.func, "__module__", None) == mod.__name__]
    seen = set()
    while todo:
        code = todo.pop()
        if code in seen:
            continue
        seen.add(code)
        if bad & set(code.co_names):
            return True
        todo += [c for c in code.co_consts if hasattr(c, "co_names")]
        todo += [ns[n].__code__ for n in code.co_names if callable(ns.get(n)) and hasattr(ns[n], "__code__")
                 and getattr(ns[n], "__module__", None) == mod.__name__]
    return False


def pytest_collection_modifyitems(config, items):
    have_gpu = shutil.which("nvidia-smi") is not None and os.path.exists("/dev/nvidiactl")
    skip_gpu = pytest.mark.skip(reason="needs a real NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords and not have_gpu:
            item.add_marker(skip_gpu)
        if NOT_PURE_FIXTURES & set(getattr(item, "fixturenames", ())) or _starts_processes(item):
            item.add_marker(pytest.mark.daemon)
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def daemon(tmp_path, fakegpu):
    """A real daemon on two simulated GPUs, private state dir and socket."""
    from harness.daemon import DaemonProc

    d = DaemonProc(tmp_path, fakegpu.state).start()
    yield d
    d.stop()


@pytest.fixture
def reachable_daemon(native_dir):
    """make(prefix, state, config=None, env=None): a started daemon in a temporary folder other
    users can traverse, its socket theirs to reach (pytest's tmp dirs are private). At the end the
    `go` file gated jobs wait for is made, the daemon stopped and its folder removed."""
    from harness.node import SimNode

    made: list[SimNode] = []

    def make(prefix: str, state, config: dict | None = None, env: dict | None = None):
        made.append(SimNode(prefix, state=state))
        return made[-1].daemon(config, home=None, env=env)

    yield make
    for n in reversed(made):
        n.close(go=True)


@pytest.fixture
def shared_daemon(fakegpu, reachable_daemon):
    """A daemon whose state dir and socket other users can reach, on two simulated GPUs."""
    return reachable_daemon("colo-shared-", fakegpu.state)


@pytest.fixture
def shared(request, fakegpu, reachable_daemon):
    """shared_daemon, or, where the test's `shared` marker says, its like made otherwise:
    shared(prefix="colo-shared-", config=None, env=None), reachable_daemon's arguments."""
    mark = request.node.get_closest_marker("shared")
    if mark is None:
        return request.getfixturevalue("shared_daemon")
    return reachable_daemon(*_shared_args(fakegpu.state, *mark.args, **mark.kwargs))


def _shared_args(state, prefix: str = "colo-shared-", config: dict | None = None, env: dict | None = None):
    return prefix, state, config, env


def _node_args(prefix: str, count: int = 1, mem: int = 16 * GiB, profiles: dict | None = None, then=None,
               per: str = "test", needs: tuple = ()):
    if per not in ("test", "module"):
        raise ValueError(f"node marker: per={per!r}: 'test' or 'module'")
    return dict(prefix=prefix, count=count, mem=mem, profiles=profiles, then=then), per, needs


@pytest.fixture
def node(request, native_dir):
    """A simulated GPU node (harness.node.SimNode, other users reach it), as the test's `node`
    marker (its own, its class's or its module's pytestmark) says:

        node(prefix, count=1, mem=16 GiB, profiles={name: SimNode.profile's keywords}, then=None,
             per="test", needs=())

    The test gets then(node) (harness.node.shaped: a generator's yield, its rest run at the end), or
    the SimNode itself. per="module" (a module's pytestmark): one for all the module's tests.
    `needs`: fixtures set up first (and so ended after it)."""
    mark = request.node.get_closest_marker("node")
    if mark is None:
        raise pytest.UsageError(f"{request.node.nodeid}: the `node` fixture needs a `node` marker")
    shape, per, needs = _node_args(*mark.args, **mark.kwargs)
    if per == "module":
        yield request.getfixturevalue("module_node")
        return
    for name in needs:
        request.getfixturevalue(name)
    with shaped(**shape) as got:
        yield got


@pytest.fixture(scope="module")
def module_node(request, native_dir):
    """The node of a module whose pytestmark's `node` marker says per="module" (see `node`)."""
    mark = request.node.get_closest_marker("node")
    if mark is None or _node_args(*mark.args, **mark.kwargs)[1] != "module":
        raise pytest.UsageError(f"{request.node.nodeid}: module_node is for a module's `node` marker with per='module'")
    shape, _, needs = _node_args(*mark.args, **mark.kwargs)
    for name in needs:
        request.getfixturevalue(name)
    with shaped(**shape) as got:
        yield got


@pytest.fixture
def make_dockerd():
    """make_dockerd(live_restore=False): a started private Docker engine (see PrivateDockerd)."""
    import subprocess

    from harness.daemon import PrivateDockerd

    made = []

    def make(live_restore: bool = False):
        try:
            e = PrivateDockerd(live_restore=live_restore)
        except (RuntimeError, subprocess.CalledProcessError) as ex:
            if REQUIRE_DOCKER:
                pytest.fail(f"COLO_REQUIRE_DOCKER=1 but no private Docker engine can run here: {ex}")
            pytest.skip(f"no private Docker engine: {ex}")
        made.append(e)
        return e.start()

    yield make
    for e in made:
        e.close()
