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
