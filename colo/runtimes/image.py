"""A tiny local image for tests and `colo demo`, built from host files with `docker import`.

Images cannot be pulled here (nor on many lab servers), so colo assembles a root filesystem from
the host's own dash, a few coreutils and their shared libraries. Because the glibc inside is the
host's, colo's native files (interposer, simulated driver, load tool), bind-mounted read-only
from the host at run time, work inside too.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import docker.errors

CONTENT_LABEL = "colo.image.content"
PATH_ENV = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
TOOLS = ("sleep", "cat", "echo", "env", "true", "false", "ls", "id", "head")
NO_SHELL_TOOLS = ("sleep", "echo", "true")
# glibc parts a program may link or dlopen that the tools do not (native/ links -ldl -lpthread).
GLIBC_EXTRAS = ("libdl.so.2", "libpthread.so.0", "librt.so.1", "libm.so.6")

_PASSWD = (
    "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
)
_GROUP = "root:x:0:\nnogroup:x:65534:\n"


def _shared_libs(binary: Path) -> list[Path]:
    out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=False).stdout
    return [Path(m) for m in re.findall(r"(/\S+)\s+\(0x", out)]


class _RootFs:
    """Host paths as a deterministic tar, keeping the host's symlinks (/bin -> usr/bin)."""

    def __init__(self) -> None:
        self.entries: dict[str, tarfile.TarInfo] = {}
        self.data: dict[str, bytes] = {}

    def _info(self, name: str, type_: bytes, mode: int) -> tarfile.TarInfo:
        ti = tarfile.TarInfo(name)
        ti.type, ti.mode, ti.mtime, ti.uid, ti.gid, ti.uname, ti.gname = (
            type_,
            mode,
            0,
            0,
            0,
            "",
            "",
        )
        return ti

    def dir(self, path: str, mode: int = 0o755) -> None:
        name = path.strip("/")
        if name and name not in self.entries:
            self.entries[name] = self._info(name, tarfile.DIRTYPE, mode)

    def file(self, path: str, content: bytes, mode: int = 0o644) -> None:
        name = path.strip("/")
        ti = self._info(name, tarfile.REGTYPE, mode)
        ti.size = len(content)
        self.entries[name], self.data[name] = ti, content

    def host(self, path: Path, target: str | None = None) -> None:
        """Add a host file at its own path (or at `target`), with every symlink on the way."""
        if target is not None:
            real = path.resolve()
            self._parents(target)
            self.file(target, real.read_bytes(), real.stat().st_mode & 0o7777)
            return
        cur = Path("/")
        for part in path.parts[1:]:
            cur = cur / part
            name = str(cur).strip("/")
            if cur.is_symlink():
                link = os.readlink(cur)
                ti = self._info(name, tarfile.SYMTYPE, 0o777)
                ti.linkname = link
                self.entries[name] = ti
                # Follow the link: its target must be in the image too, then carry on from there.
                resolved = (cur.parent / link) if not os.path.isabs(link) else Path(link)
                self.host(Path(os.path.normpath(resolved / path.relative_to(cur))))
                return
            if cur.is_dir():
                self.dir(name)
            else:
                self.file(name, cur.read_bytes(), cur.stat().st_mode & 0o7777)

    def _parents(self, target: str) -> None:
        p = Path("/" + target.strip("/")).parent
        for anc in reversed([p, *p.parents]):
            entry = self.entries.get(str(anc).strip("/"))
            if entry is not None and entry.issym():
                raise ValueError(f"image path {target} goes through the symlink /{entry.name}")
            self.dir(str(anc))

    def tar(self) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tf:
            for name in sorted(self.entries):
                ti = self.entries[name]
                tf.addfile(ti, io.BytesIO(self.data[name]) if name in self.data else None)
        return buf.getvalue()


def rootfs_tar(with_shell: bool = True, extra_files: dict[str, Path] | None = None) -> bytes:
    """The image's root filesystem as a deterministic tar (same inputs -> same bytes)."""
    fs = _RootFs()
    tools = list(TOOLS if with_shell else NO_SHELL_TOOLS)
    binaries = []
    for t in tools:
        found = shutil.which(t, path="/usr/bin:/bin")
        if not found:
            raise RuntimeError(f"cannot build the local image: `{t}` is not installed on this host")
        binaries.append(Path(found))
    if with_shell:
        binaries.append(Path("/bin/sh"))
    libs: set[Path] = set()
    for b in binaries:
        fs.host(b)
        libs.update(_shared_libs(b))
    libc_dir = next((p.parent for p in libs if p.name.startswith("libc.so")), None)
    if libc_dir is not None:
        libs.update(libc_dir / n for n in GLIBC_EXTRAS if (libc_dir / n).exists())
    for lib in sorted(libs):
        fs.host(lib)
    for target, src in sorted((extra_files or {}).items()):
        fs.host(Path(src), target=target)
    fs.dir("etc")
    fs.file("etc/passwd", _PASSWD.encode())
    fs.file("etc/group", _GROUP.encode())
    fs.dir("tmp", 0o1777)
    fs.dir("root", 0o700)
    for d in ("proc", "sys", "dev", "work"):
        fs.dir(d)
    return fs.tar()


def build_local_image(
    client, tag: str, with_shell: bool = True, extra_files: dict[str, Path] | None = None,
    volumes: tuple[str, ...] = (),
) -> str:
    """Build (or reuse) a tiny image `tag` from host files with `docker import`; return the tag.

    Idempotent: an image of that tag with the same content hash is reused as it is.
    `with_shell=False` gives an image with no /bin/sh (only sleep, echo, true) for bad-input tests.
    `extra_files` maps a path in the image to a host file to copy there (under real
    directories: /usr/bin/x or /opt/x, not /bin/x, which is a symlink in the image).
    `volumes`: folders the image declares as VOLUME (each container gets an anonymous volume there).
    """
    changes = [f"ENV PATH={PATH_ENV}", "WORKDIR /", *(f"VOLUME {v}" for v in volumes)]
    return _import(client, tag, rootfs_tar(with_shell, extra_files), changes)


def build_image_of(client, tag: str, files: dict[str, Path]) -> str:
    """An image of these host files alone (path in the image -> host file), nothing of the host's
    C library unless named: e.g. a program of another C library with its own loader."""
    fs = _RootFs()
    for target, src in sorted(files.items()):
        fs.host(Path(src), target=target)
    fs.dir("tmp", 0o1777)
    return _import(client, tag, fs.tar(), [f"ENV PATH={PATH_ENV}", "WORKDIR /"])


def _import(client, tag: str, data: bytes, changes: list[str]) -> str:
    """`docker import` of a root filesystem tar as `tag`, reused when its content is there already."""
    digest = hashlib.sha256(data + "\n".join(changes).encode()).hexdigest()
    try:
        img = client.api.inspect_image(tag)
        if ((img.get("Config") or {}).get("Labels") or {}).get(CONTENT_LABEL) == digest:
            return tag
    except docker.errors.ImageNotFound:
        pass
    repo, _, version = tag.rpartition(":") if ":" in tag.rsplit("/", 1)[-1] else (tag, "", "latest")
    client.api.import_image_from_data(
        data,
        repository=repo,
        tag=version,
        changes=[f"LABEL {CONTENT_LABEL}={digest}", *changes],
    )
    img = client.api.inspect_image(tag)  # raises if the import did not produce it
    if ((img.get("Config") or {}).get("Labels") or {}).get(CONTENT_LABEL) != digest:
        raise RuntimeError(f"docker import of {tag} did not produce the expected image")
    return tag
