"""Mount sources opened as their submitter and pinned, so that what was checked is what is mounted.

A check of a path that the user can change afterwards is not a check: a user who swaps a folder
for a symlink between the check and Docker's mount gets whatever the symlink points at. So the
daemon never hands Docker a user's path. `colo-pin` (native/tools/pin.c) becomes the user (uid,
gid, groups), walks the path from "/" one component at a time with O_NOFOLLOW (a symlink anywhere
is refused; the kernel checks the user's search and read permission), and passes the open file
back over a socket (SCM_RIGHTS). The daemon bind-mounts /proc/self/fd/N onto a staging folder
under state/mounts (root only) and gives Docker that. Once the container has started its mount
holds the object, and the staging mount is removed; what is left after a crash is removed when
the daemon starts.
"""
from __future__ import annotations

import ctypes
import errno
import logging
import os
import socket
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..jobs import Mount
from .validate import Caller, Forbidden, Invalid, forbidden_source

log = logging.getLogger("colo")
HELPER = "colo-pin"
TIMEOUT = 10.0  # a source on a hung network or FUSE file system is refused, not waited for

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC = 32, 4096, 16384
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
MNT_DETACH = 2
# statvfs f_flag bits -> the mount flags a bind remount must repeat (or it would clear them)
_KEEP = {os.ST_NOEXEC: MS_NOEXEC, os.ST_NOATIME: MS_NOATIME, os.ST_NODIRATIME: MS_NODIRATIME,
         os.ST_RELATIME: MS_RELATIME}

_libc = ctypes.CDLL(None, use_errno=True)


@dataclass
class Pinned:
    fd: int  # read-only, opened by the user
    is_dir: bool
    path: str  # where the kernel says it is


def _why(kind: str, source: str, parts: list[str], depth: int, err: int, uid: int) -> Exception:
    at = "/" + "/".join(parts[:depth])
    if kind == "symlink":
        return Forbidden(f"mount source {source}: {at} is a symbolic link; symbolic links are not allowed in "
                         "mount sources (name the real folder)")
    if kind == "fuse":
        return Invalid(f"mount source {source} is on a FUSE file system, which colo does not mount "
                       "(the daemon would wait on its owner's FUSE process)")
    if kind == "type":
        return Invalid(f"mount source {source} is neither a folder nor a regular file")
    if kind == "drop":
        return Invalid(f"mount source {source}: cannot act as uid {uid} to open it ({os.strerror(err)})")
    if kind == "bad":
        return Invalid(f"mount source {source} must be an absolute path without '.' or '..'")
    if err in (errno.EACCES, errno.EPERM):
        return Forbidden(f"you cannot read {source}, so you cannot mount it")
    if err == errno.ENOENT:
        return Invalid(f"mount source {source} does not exist")
    if err == errno.ENOTDIR:
        return Invalid(f"mount source {source}: {at} is not a folder")
    return Invalid(f"mount source {source}: {os.strerror(err) if err else kind}")


def open_as(source: str, caller: Caller, helper: Path, protected: list[Path]) -> Pinned:
    """Open `source` as the caller (no symlinks followed); Invalid/Forbidden with one line if not."""
    groups = sorted(caller.groups()) if caller.uid != 0 else []
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        try:
            proc = subprocess.Popen(
                [str(helper), str(child.fileno()), str(caller.uid), str(caller.gid),
                 ",".join(map(str, groups)) or "-", source],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                pass_fds=(child.fileno(),), cwd="/")
        except OSError as e:
            raise Invalid(f"mount source {source}: cannot run {helper.name} ({e.strerror})") from None
        child.close()
        parent.settimeout(TIMEOUT)
        try:
            msg, fds, _, _ = socket.recv_fds(parent, 256, 1, socket.MSG_CMSG_CLOEXEC)
        except (socket.timeout, OSError):
            msg, fds = b"", []
        finally:
            try:
                proc.wait(timeout=1 if msg else 0.1)
            except subprocess.TimeoutExpired:
                proc.kill()
                try:
                    proc.wait(timeout=1)
                except subprocess.TimeoutExpired:
                    pass  # stuck in the kernel; reaped when it leaves
        text = msg.decode(errors="replace").split()
        if not text and proc.returncode is None:
            raise Invalid(f"mount source {source} did not open within {TIMEOUT:.0f} s")
        if not text:
            raise Invalid(f"mount source {source} could not be opened ({helper.name} exit {proc.returncode})")
        if text[0] != "ok" or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            nums = [int(x) for x in text[1:] if x.isdigit()]
            err, depth = (nums + [0, 0])[:2] if text[0] in ("errno", "drop") else (0, (nums + [0])[0])
            raise _why(text[0], source, [p for p in source.split("/") if p], depth, err, caller.uid)
        fd = fds[0]
    finally:
        parent.close()
        child.close()
    try:
        path = os.readlink(f"/proc/self/fd/{fd}")
        # the kernel's own name for what was opened (a bind mount may show the same files elsewhere)
        bad = forbidden_source(path, caller, protected) if path.startswith("/") else "an unnamed file"
        if bad is not None:
            raise Forbidden(f"mounting {source} is not allowed (it holds {bad})")
        return Pinned(fd, text[1] == "dir", path)
    except BaseException:
        os.close(fd)
        raise


def verify(mounts: list[Mount], caller: Caller, helper: Path, protected: list[Path]) -> None:
    """At submit: each source opens as the caller (the check is made again, and pinned, at start)."""
    for m in mounts:
        os.close(open_as(m.source, caller, helper, protected).fd)


def _mount(src: str | None, target: Path, flags: int) -> None:
    if _libc.mount(src.encode() if src else None, str(target).encode(), None, flags, None) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mount {target}: {os.strerror(e)}")


def _bind(p: Pinned, target: Path, read_only: bool) -> None:
    _mount(f"/proc/self/fd/{p.fd}", target, MS_BIND | MS_REC)  # exactly the file the user opened
    keep = os.statvfs(target).f_flag
    flags = MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV | (MS_RDONLY if read_only else 0)
    flags |= sum(v for k, v in _KEEP.items() if keep & k)
    if keep & os.ST_RDONLY:
        flags |= MS_RDONLY
    _mount(None, target, flags)


def stage(mounts: list[Mount], caller: Caller, helper: Path, protected: list[Path], root: Path,
          job_id: int) -> tuple[list[Mount], Callable[[], None] | None]:
    """The job's mounts as staging paths Docker can use, and what removes the staging once the
    container has started (or failed to). A daemon not run by root mounts nothing for others:
    the checked path is used as it is."""
    if not mounts:
        return [], None
    if os.geteuid() != 0:
        for m in mounts:
            os.close(open_as(m.source, caller, helper, protected).fd)
        return list(mounts), None
    root.mkdir(mode=0o700, exist_ok=True)
    os.chmod(root, 0o700)
    base = Path(tempfile.mkdtemp(prefix=f"{job_id}.", dir=root))
    staged: list[Mount] = []
    try:
        for k, m in enumerate(mounts):
            p = open_as(m.source, caller, helper, protected)
            try:
                target = base / str(k)
                if p.is_dir:
                    target.mkdir(mode=0o700)
                else:
                    os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
                _bind(p, target, m.read_only)
            finally:
                os.close(p.fd)
            staged.append(Mount(str(target), m.target, m.read_only))
    except BaseException:
        release(base)
        raise
    return staged, lambda: release(base)


def release(base: Path) -> None:
    """Unmount and remove one job's staging folder. Never a recursive delete: under a mount that
    failed to go lie the user's own files."""
    try:
        entries = list(os.scandir(base))
    except FileNotFoundError:
        return
    for e in entries:
        if _libc.umount2(e.path.encode(), MNT_DETACH) != 0 and ctypes.get_errno() not in (errno.EINVAL, errno.ENOENT):
            log.warning("staging mount %s: %s; left in place", e.path, os.strerror(ctypes.get_errno()))
            continue
        try:
            (os.rmdir if e.is_dir(follow_symlinks=False) else os.unlink)(e.path)
        except OSError as ex:
            log.warning("staging mount %s: %s; left in place", e.path, ex.strerror)
    try:
        os.rmdir(base)
    except OSError:
        pass


def sweep(root: Path) -> None:
    """At start-up: staging left by a daemon that stopped between a mount and its container's start."""
    try:
        bases = [Path(e.path) for e in os.scandir(root) if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return
    for b in bases:
        release(b)
