"""Builds native/ (interposer, simulated driver, load tool, root shim, SPANK plugin) into the package
at install time, and tags wheels for the platform their binaries run on (they carry x86_64 ELF
files, so not py3-none-any): manylinux_X_Y for the newest glibc symbol version any of them needs."""
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py
from distutils.command.build_scripts import build_scripts  # (setuptools has no module of its own for it)

try:
    from setuptools.command.bdist_wheel import bdist_wheel  # setuptools >= 70.1
except ImportError:
    try:
        from wheel.bdist_wheel import bdist_wheel
    except ImportError:  # an install without wheels (pip install --no-build-isolation, old setuptools)
        bdist_wheel = None

HERE = Path(__file__).resolve().parent
NATIVE_BUILD = HERE / "native" / "build"
# Libraries a manylinux wheel may link against (PEP 600 defers to auditwheel's policy list; the
# system's own C library pieces are all colo's binaries need).
MANYLINUX_LIBS = {"libc.so.6", "libdl.so.2", "libpthread.so.0", "libm.so.6", "librt.so.1", "libgcc_s.so.1",
                  "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1"}


def _fail(msg: str) -> None:
    """One line, not a traceback: pip shows it under 'error: subprocess-exited-with-error'."""
    print(f"colo: {msg}", file=sys.stderr)
    raise SystemExit(1)


def _check_toolchain() -> None:
    cc = shlex.split(os.environ.get("CC") or "cc")[0]
    missing = [t for t in ("make", cc) if not shutil.which(t)]
    if missing:
        _fail(f"building colo's native parts needs {' and '.join(missing)} (a C compiler and make; Debian/Ubuntu: "
              "`apt-get install gcc make libc6-dev`, RHEL/Fedora: `dnf install gcc make`), or install a prebuilt "
              "colo-gpu wheel for this platform")


def _build_native() -> None:
    r = subprocess.run(["make", "-s", "-C", str(HERE / "native")])
    if r.returncode != 0:
        _fail(f"`make -C native` failed (exit {r.returncode}): the compiler's messages are above")


class BuildWithNative(build_py):
    def run(self):
        _check_toolchain()  # first: its line is then the last thing pip shows
        super().run()
        # Editable installs use native/build in the source tree; wheels carry a copy.
        _build_native()
        if not self.editable_mode:
            dest = Path(self.build_lib) / "colo" / "_native"
            if dest.exists():
                shutil.rmtree(dest)
            shutil.copytree(NATIVE_BUILD, dest, symlinks=False)
            for data in ("profiles", "workloads"):
                target = Path(self.build_lib) / "colo" / "data" / data
                shutil.rmtree(target, ignore_errors=True)
                shutil.copytree(HERE / data, target)
            for p in dest.rglob("*"):
                if p.is_file() and os.access(NATIVE_BUILD / p.relative_to(dest), os.X_OK):
                    p.chmod(0o755)


def elf_needs(folder: Path) -> tuple[tuple[int, int], set[str]]:
    """The newest GLIBC_x.y symbol version and the libraries the ELF files under `folder` need
    (read with binutils' readelf, which every C toolchain has)."""
    newest, libs = (2, 5), set()
    for p in sorted(folder.rglob("*")):
        if not p.is_file() or p.is_symlink() or p.read_bytes()[:4] != b"\x7fELF":
            continue
        try:
            out = subprocess.run(["readelf", "-V", "-d", "-W", str(p)], capture_output=True, text=True,
                                 check=True).stdout
        except (OSError, subprocess.CalledProcessError) as e:
            _fail(f"tagging the wheel needs binutils' readelf to read {p.name}: {e}")
        libs |= set(re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out))
        for major, minor in re.findall(r"Name: GLIBC_(\d+)\.(\d+)", out):
            newest = max(newest, (int(major), int(minor)))
    return newest, libs


def platform_tag(folder: Path) -> str:
    """manylinux_X_Y_ARCH when the binaries need only the C library's pieces, else linux_ARCH."""
    arch = platform.machine()
    (major, minor), libs = elf_needs(folder)
    if libs <= MANYLINUX_LIBS and os.uname().sysname == "Linux":
        return f"manylinux_{major}_{minor}_{arch}"
    return f"linux_{arch}"


class ScriptsWithClient(build_scripts):
    """bin/colo-py as setuptools copies any script (its `#!python` made the installing interpreter),
    and beside it, as `colo`, the compiled client (native/client/colo.c) that runs it or its
    command server: in every install, editable or not, and in wheels (docs/fastcli.md). Not a
    script-files entry: setuptools reads each one's first line as text, which an ELF file is not."""

    def run(self):
        super().run()
        _build_native()  # (build_py built it already; make only checks)
        out = Path(self.build_dir) / "colo"
        shutil.copyfile(NATIVE_BUILD / "colo-client", out)
        out.chmod(0o755)


commands = {"build_py": BuildWithNative, "build_scripts": ScriptsWithClient}
if bdist_wheel is not None:
    class PlatformWheel(bdist_wheel):
        """py3-none-<platform>: the Python is any Python 3's; the binaries are this platform's."""

        def get_tag(self):
            return "py3", "none", platform_tag(NATIVE_BUILD)

    commands["bdist_wheel"] = PlatformWheel


class BinaryDistribution(Distribution):
    """Has binaries: the wheel's files go to platlib (not purelib, where no ELF file belongs)."""

    def has_ext_modules(self):
        return True


setup(distclass=BinaryDistribution, cmdclass=commands)
