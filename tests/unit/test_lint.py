"""ruff's checks (pyproject.toml: syntax errors, undefined names, unused imports, mutable defaults) on the
whole tree: an undefined name in an error path is a crash waiting for the fault that takes it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_is_clean():
    exe = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not Path(exe).exists():
        pytest.skip("ruff is not installed (a test extra: pip install -e '.[test]')")
    out = subprocess.run([exe, "check", "--quiet", str(ROOT)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
