"""Who may reach an MPS pipe directory (a POSIX ACL on each GPU's), and the pipe directory with no
daemon behind it that time-sliced jobs get."""
from __future__ import annotations

import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Iterable

NULL_PIPE_DIR = "mps-none"
# What a job's uid gets on its GPU's pipe directory: search only. Clients and the servers the
# control daemon starts as their uid open fixed names there (the `control` socket, FIFOs the daemon
# made); none lists or creates anything in it, so no uid can delete or plant a socket there.
CLIENT_PERM = 0o1


# --- who may reach a pipe directory (POSIX ACL) ------------------------------------------------
#
# The pipe directory is root's, mode 0700, plus one ACL entry `user:UID:--x` per uid that colo
# runs MPS jobs for on that GPU (docs/mps.md "Files"). Written as the kernel's own xattr format
# (linux/posix_acl_xattr.h, version 2): no library, no `setfacl` binary to install, one syscall
# that replaces the whole list (so a change is atomic and nothing is left of an earlier one).

_ACL_XATTR = "system.posix_acl_access"
_ACL_VERSION = 2
_USER_OBJ, _USER, _GROUP_OBJ, _GROUP, _MASK, _OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
_NO_ID = 0xFFFFFFFF


def _acl_bytes(uids: Iterable[int], perm: int = CLIENT_PERM) -> bytes:
    """owner rwx, each uid `perm`, group and others nothing. The kernel wants entries sorted by
    tag, then id; without named users it is a plain mode (0700) and the kernel stores just that."""
    ids = sorted({int(u) for u in uids})
    ents = [(_USER_OBJ, 0o7, _NO_ID)] + [(_USER, perm, u) for u in ids] + [(_GROUP_OBJ, 0, _NO_ID)]
    if ids:
        ents.append((_MASK, perm, _NO_ID))
    ents.append((_OTHER, 0, _NO_ID))
    return struct.pack("<I", _ACL_VERSION) + b"".join(struct.pack("<HHI", *e) for e in ents)


def acl_users(path: Path) -> set[int]:
    """The uids named in a directory's access ACL (empty when it has none)."""
    try:
        raw = os.getxattr(path, _ACL_XATTR, follow_symlinks=False)
    except OSError:
        return set()
    if len(raw) < 4 or struct.unpack_from("<I", raw)[0] != _ACL_VERSION:
        return set()
    return {i for t, _, i in struct.iter_unpack("<HHI", raw[4:4 + (len(raw) - 4) // 8 * 8]) if t == _USER}


def set_pipe_access(path: Path, uids: Iterable[int]) -> None:
    """Root's 0700 directory that exactly these uids may search (and nobody else). On any failure
    it is left 0700 with every named entry masked off: closed, never open to all."""
    try:
        os.setxattr(path, _ACL_XATTR, _acl_bytes(uids), follow_symlinks=False)
    except OSError:
        try:
            os.chmod(path, 0o700, follow_symlinks=False)  # the ACL mask becomes ---: all named entries off
        except OSError:
            pass
        raise


def acl_problem(root: Path) -> str | None:
    """Why directories under `root` cannot carry a POSIX ACL (None when they can): tried on a
    scratch directory there, so the answer is the filesystem's own."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = Path(tempfile.mkdtemp(prefix=".acl-", dir=root))
    except OSError as e:
        return f"cannot create {root}: {e.strerror}"
    try:
        set_pipe_access(probe, [_NO_ID - 1])
        if acl_users(probe) != {_NO_ID - 1}:
            return f"{root}: an ACL written there does not read back"
        return None
    except OSError as e:
        return f"{root} takes no POSIX ACL ({e.strerror})"
    finally:
        try:
            probe.rmdir()
        except OSError:
            pass


# --- time-sliced jobs -------------------------------------------------------------------------

def null_pipe_dir(root: Path) -> Path:
    """An existing empty directory with no daemon behind it (read-only, so nobody but root can
    put a pipe there). A time-sliced job's CUDA_MPS_PIPE_DIRECTORY points here, so its driver finds
    no control daemon and creates an ordinary context, whatever runs elsewhere on the node."""
    d = Path(root) / NULL_PIPE_DIR
    d.mkdir(parents=True, exist_ok=True)
    d.chmod(0o755)
    for p in d.iterdir():  # stale content must not lead anywhere either
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    d.chmod(0o555)
    return d


def timesliced_env(root: Path) -> dict[str, str]:
    return {"CUDA_MPS_PIPE_DIRECTORY": str(null_pipe_dir(root))}
