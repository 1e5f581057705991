"""One place that starts colo daemons on a simulated node: `SimNode(prefix, count, mem)` is a
folder every user reaches (MPS servers, other users' jobs, their clients) with `count` simulated
GPUs of `mem` each and a profiles folder; `daemon()` starts a daemon there; `close()` stops them
all and removes the folder. conftest's `node` fixture (through `shaped`, as each module's `node`
marker asks) and its reachable_daemon are built on it."""
from __future__ import annotations

import inspect
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from colo import profiles
from harness.daemon import DaemonProc, gpu_node

GiB = 1024**3


class SimNode:
    def __init__(self, prefix: str, count: int = 1, mem: int = 16 * GiB, state: Path | None = None):
        """`state`: the simulated GPUs of an existing fakegpu state file instead of new ones (and no
        profiles folder)."""
        if state is None:
            self.root, self.state, self.prof = gpu_node(prefix, count=count, mem=mem)
        else:
            self.root, self.state, self.prof = Path(tempfile.mkdtemp(prefix=prefix)), Path(state), None
            os.chmod(self.root, 0o755)
        self.daemons: list[DaemonProc] = []

    def parts(self) -> tuple[Path, Path, Path | None]:
        """(root, fakegpu state, profiles folder), as gpu_node gives them."""
        return self.root, self.state, self.prof

    def profile(self, name: str, sm: float, mem: int, membw: float, runtime: float, n: int = 20,
                cache_bound: bool = False) -> None:
        """A profile of `n` even samples saved in the profiles folder as NAME.profile."""
        p = profiles.from_samples(name, {"times": list(range(n)), "sm": [sm] * n, "mem": [mem] * n,
                                         "membw": [membw] * n}, runtime=runtime, cache_bound=cache_bound)
        profiles.save(p, self.prof / f"{name}.profile")

    def daemon(self, config: dict | None = None, home: str | None = "d", env: dict | None = None,
               start: bool = True, reachable: bool = True) -> DaemonProc:
        """A daemon on this node's GPUs in the folder `home` under the root (None: the root itself);
        started unless `start` is false (the test starts it), then its socket's folder opened to
        other users where `reachable`. Stopped by close()."""
        where = self.root
        if home is not None:
            where = self.root / home
            where.mkdir(mode=0o755)
        d = DaemonProc(where, self.state, config, env)
        self.daemons.append(d)
        if start:
            d.start()
            if reachable:
                os.chmod(d.socket.parent, 0o755)
        return d

    def close(self, go: bool = False) -> None:
        """Stop the daemons (newest first; `go`: first make the `go` file gated jobs wait for) and
        remove the folder."""
        for d in reversed(self.daemons):
            if go:
                (d.root / "go").touch()
            d.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> SimNode:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextmanager
def shaped(prefix: str, count: int = 1, mem: int = 16 * GiB, profiles: dict | None = None, then=None):
    """A SimNode(prefix, count, mem) with `profiles` saved in its folder ({name: SimNode.profile's
    keywords}), giving what then(node) returns, or the node itself without `then`. A `then` that is a
    generator gives its one yielded value, and the rest of it runs before the node closes."""
    with SimNode(prefix, count=count, mem=mem) as n:
        for name, kw in (profiles or {}).items():
            n.profile(name, **kw)
        got = n if then is None else then(n)
        if not inspect.isgenerator(got):
            yield got
            return
        yield next(got)
        for _ in got:
            raise RuntimeError(f"{then.__name__} yielded more than once")
