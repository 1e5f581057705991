"""Builds native/ (interposer, simulated driver, load tool) into the package at install time."""
import os
import shutil
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


class BuildWithNative(build_py):
    def run(self):
        super().run()
        # Editable installs use native/build in the source tree; wheels carry a copy.
        subprocess.run(["make", "-s", "-C", str(HERE / "native")], check=True)
        if not self.editable_mode:
            dest = Path(self.build_lib) / "colo" / "_native"
            if dest.exists():
                shutil.rmtree(dest)
            shutil.copytree(HERE / "native" / "build", dest, symlinks=False)
            for data in ("profiles", "workloads"):
                target = Path(self.build_lib) / "colo" / "data" / data
                shutil.rmtree(target, ignore_errors=True)
                shutil.copytree(HERE / data, target)
            for p in dest.rglob("*"):
                if p.is_file() and os.access(HERE / "native" / "build" / p.relative_to(dest), os.X_OK):
                    p.chmod(0o755)


setup(cmdclass={"build_py": BuildWithNative})
