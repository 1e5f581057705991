"""Real Unix users for the suite and the benches: made when missing, and code run as one of them
in a forked child (Peer, run_as)."""
from __future__ import annotations

import os
import pickle
import pwd
import subprocess
import tempfile
from pathlib import Path


def ensure_users(n: int, prefix: str = "colotest") -> list[pwd.struct_passwd]:
    """n local users (created when missing; needs root). Without root: the caller's own entry n times."""
    if os.geteuid() != 0:
        return [pwd.getpwuid(os.geteuid())] * n
    out = []
    for i in range(1, n + 1):
        name = f"{prefix}{i}"
        try:
            out.append(pwd.getpwnam(name))
        except KeyError:
            subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/sh", name], check=True,
                           capture_output=True)
            out.append(pwd.getpwnam(name))
    return out


def shared_root(prefix: str) -> Path:
    """A temp dir other users can traverse (they must reach the socket)."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    os.chmod(root, 0o755)
    return root


class Peer:
    """A forked child running `fn()` as another user once released; its result comes back pickled."""

    def __init__(self, pw: pwd.struct_passwd | None, fn):
        self._go_r, self._go_w = os.pipe()
        self._res_r, res_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # pragma: no cover - child
            code = 0
            try:
                os.close(self._go_w)
                os.close(self._res_r)
                if pw is not None and os.geteuid() == 0 and pw.pw_uid != 0:
                    os.setgroups([])
                    os.setgid(pw.pw_gid)
                    os.setuid(pw.pw_uid)
                os.read(self._go_r, 1)  # wait for the start signal
                res = ("ok", fn())
            except BaseException as e:  # noqa: BLE001
                import traceback
                res = ("err", "".join(traceback.format_exception(e))[-4000:])
                code = 1
            with os.fdopen(res_w, "wb") as f:
                f.write(pickle.dumps(res))
            os._exit(code)
        os.close(self._go_r)
        os.close(res_w)

    def go(self) -> None:
        os.write(self._go_w, b"x")
        os.close(self._go_w)

    def result(self):
        with os.fdopen(self._res_r, "rb") as f:
            data = f.read()
        os.waitpid(self.pid, 0)
        kind, value = pickle.loads(data)
        if kind != "ok":
            raise RuntimeError(f"peer {self.pid} failed: {value}")
        return value


def run_as(pw, fn):
    p = Peer(pw, fn)
    p.go()
    return p.result()


def spread(users: list, total: int, client_fn) -> list[Peer]:
    """`total` shared as evenly as can be among len(users) clients: a Peer a user, not yet released,
    running client_fn(k, its share) for the k-th."""
    per = [total // len(users) + (1 if i < total % len(users) else 0) for i in range(len(users))]
    return [Peer(pw, client_fn(k, n)) for k, (pw, n) in enumerate(zip(users, per))]


def become(pw, cwd: str) -> None:
    """This (forked) process as user `pw` (its groups none, its gid and uid), in folder `cwd`."""
    os.setgroups([])
    os.setgid(pw.pw_gid)
    os.setuid(pw.pw_uid)
    os.chdir(cwd)


def user_env(socket_path, **more: str) -> dict:
    """What a user's `colo` runs with in these tests: a plain PATH and HOME, the daemon's socket."""
    return {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "COLO_SOCKET": str(socket_path), **more}


def cli_main(pw, args, env: dict, cwd: str = "/tmp", main=None) -> None:
    """In a forked child: `colo ARGS` as user `pw` with environment `env` on this process's
    descriptors 0-2, by the CLI already loaded (`main`: colo.cli.app's by default; this
    interpreter's files may be under /root, which other uids cannot execute); exits with its code,
    never returns (a Ctrl-C of the suite included)."""
    import sys
    import traceback

    import colo.cli.app

    code = 99
    try:
        become(pw, cwd)
        os.environ.clear()
        os.environ.update(env)
        sys.stdout, sys.stderr = os.fdopen(1, "w", buffering=1), os.fdopen(2, "w", buffering=1)  # (not pytest's)
        try:
            sys.stdin = os.fdopen(0, "r")
        except OSError:  # (none: the CLI reads none)
            pass
        sys.argv = ["colo", *args]
        try:
            (main or colo.cli.app.main)()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


class Cli:
    """`colo ARGS` as user `pw` in a forked child whose stdin, stdout and stderr are pipes (no
    terminal, as in a script): `feed` writes its input, `output` reads both outputs to their end."""

    def __init__(self, socket_path, pw, *args: str):
        import colo.cli.app  # noqa: F401 - loaded here, for the child (cli_main)

        ends = [os.pipe() for _ in range(3)]
        self.pid = os.fork()
        if self.pid == 0:  # pragma: no cover - the client
            for i, (r, w) in enumerate(ends):
                os.dup2(r if i == 0 else w, i)
            for fd in {fd for pair in ends for fd in pair}:
                if fd > 2:
                    os.close(fd)
            cli_main(pw, args, user_env(socket_path))
        self.stdin, self.stdout, self.stderr = ends[0][1], ends[1][0], ends[2][0]
        for fd in (ends[0][0], ends[1][1], ends[2][1]):
            os.close(fd)
        self.status: int | None = None

    def feed(self, data: bytes, end: bool = True) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.stdin, view):]
        if end:
            os.close(self.stdin)
            self.stdin = -1

    def read_until(self, fd: int, want: bytes, timeout: float = 120) -> bytes:
        """What `fd` (stdout or stderr) gave, up to and with `want`."""
        import select

        got = b""
        while want not in got:
            r, _, _ = select.select([fd], [], [], timeout)
            chunk = os.read(fd, 1 << 16) if r else b""
            if not chunk:
                raise AssertionError(f"no {want!r} from the client (it gave {got[-2000:]!r})")
            got += chunk
        return got

    def output(self, timeout: float = 240) -> tuple[bytes, bytes, int]:
        """(stdout, stderr, exit code), both read to their end and the child waited for."""
        import select
        import time

        out = {self.stdout: b"", self.stderr: b""}
        open_ = set(out)
        deadline = time.monotonic() + timeout  # a backstop only: the end of the outputs is the event
        while open_:
            r, _, _ = select.select(list(open_), [], [], max(0.0, deadline - time.monotonic()))
            if not r:
                raise AssertionError(f"the client did not end its output: {out}")
            for fd in r:
                chunk = os.read(fd, 1 << 16)
                out[fd] += chunk
                if not chunk:
                    open_.discard(fd)
        _, st = os.waitpid(self.pid, 0)
        self.status = os.waitstatus_to_exitcode(st)
        return out[self.stdout], out[self.stderr], self.status

    def close(self) -> None:
        for fd in (self.stdin, self.stdout, self.stderr):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        if self.status is None:
            try:
                os.kill(self.pid, 9)
                os.waitpid(self.pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
