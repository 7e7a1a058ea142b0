"""Start-up errors a restart cannot fix: one line naming the field or value, exit 78, no traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trnd", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("mode", [(), ("--aggregated",)])
def test_missing_model_directory(tmp_path, mode):
    out = run("serve", *mode, "--model", str(tmp_path / "nope"))
    assert out.returncode == 78 and "Traceback" not in out.stderr
    lines = [ln for ln in out.stderr.splitlines() if "model error" in ln]
    assert len(lines) == 1 and "nope/config.json: missing" in lines[0]


@pytest.mark.parametrize("mode", [(), ("--aggregated",)])
def test_unsupported_architecture(tiny_qwen3, tmp_path, mode):
    model = tmp_path / "moe"
    shutil.copytree(tiny_qwen3, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["architectures"] = ["Qwen3MoeForCausalLM"]
    (model / "config.json").write_text(json.dumps(cfg))
    out = run("serve", *mode, "--model", str(model))
    assert out.returncode == 78 and "Traceback" not in out.stderr
    lines = [ln for ln in out.stderr.splitlines() if "model error" in ln]
    assert len(lines) == 1 and "'architectures'" in lines[0] and "Qwen3MoeForCausalLM" in lines[0]
