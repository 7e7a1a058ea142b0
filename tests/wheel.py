"""The wheel docs/DEPLOY.md installs, built from this checkout the way an operator builds it (`pip wheel .`),
for the tests that install it (tests/system/test_wheel.py, tests/system/test_systemd_boot.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def checkout_copy(dest: Path) -> Path:
    """The checkout's files (tracked, and new ones git does not ignore) copied into dest, with the kernels this
    checkout built: the package build finds them current (same sources, flags and torch) and compiles nothing.
    A copy, so two builds at once (the suite's two workers) do not share a build/ directory."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for f in filter(None, files):
        src = ROOT / f
        if src.is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / f)
    built = ROOT / "kernels/cpu/build"
    for lib in built.glob("*/*.so"):
        d = dest / lib.parent.relative_to(ROOT)
        d.mkdir(parents=True, exist_ok=True)
        for f in (lib, lib.parent / "torch_version", lib.parent / "source_digest"):
            if f.exists():
                shutil.copy2(f, d / f.name)
    return dest


def build_wheel(work: Path, env: dict | None = None) -> Path:
    """`pip wheel .` of a copy of this checkout (no build isolation: this venv has the pinned torch, setuptools
    and ninja, as `make venv` installs them); the wheel's path."""
    src = checkout_copy(work / "src")
    out = work / "dist"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                        str(src)], capture_output=True, text=True, env=env or dict(os.environ))
    if r.returncode != 0:
        raise RuntimeError(f"pip wheel failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    (wheel,) = out.glob("trnd-*.whl")
    return wheel
