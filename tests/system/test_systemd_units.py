"""trnd as a systemd service, statically: the unit files (systemd-analyze verify and security) and
sysusers/tmpfiles, checked with systemd's own tools."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from trnd.config import ServeConfig
from trnd.daemon import lifecycle

from tests.launch import UNIT, unit_settings


ROOT = Path(__file__).resolve().parents[2]
SYSTEMD = ROOT / "systemd"
EXPOSURE_TARGET = 2.0  # docs/DEPLOY.md: systemd-analyze security exposure of trnd@.service must stay at or below


def need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"{tool} is not installed (apt-get install -y --no-install-recommends systemd)")
    return path


def seconds(value: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(ms|s|min|h)?", value)
    assert m, value
    return float(m[1]) * {"ms": 1e-3, None: 1, "s": 1, "min": 60, "h": 3600}[m[2]]


# -- the unit files ---------------------------------------------------------------------------------

def test_unit_files_verify_without_a_single_message(tmp_path):
    need("systemd-analyze")
    system = next((p for p in (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system")) if p.is_dir()), None)
    if system is None:
        pytest.skip("no systemd unit directory to verify against")
    # An alternate root with the distribution's units (for sysinit.target and friends), our units in
    # /etc/systemd/system and stand-ins for the two commands the unit runs, which verify checks exist.
    root = tmp_path / "root"
    shutil.copytree(system, root / "usr/lib/systemd/system", symlinks=True)
    etc = root / "etc/systemd/system"
    etc.mkdir(parents=True)
    for name in ("trnd@.service", "trnd.target"):
        shutil.copy(SYSTEMD / name, etc / name)
    for exe in ("usr/bin/trnd", "bin/kill"):
        (root / exe).parent.mkdir(parents=True, exist_ok=True)
        (root / exe).write_text("#!/bin/sh\n")
        (root / exe).chmod(0o755)
    r = subprocess.run(["systemd-analyze", "verify", f"--root={root}", "--man=no", "trnd@serve.service",
                        "trnd@prefill.service", "trnd@decode.service", "trnd.target"],
                       capture_output=True, text=True, timeout=120)
    assert r.stderr == "" and r.returncode == 0, r.stderr


def test_unit_security_exposure_is_below_target():
    need("systemd-analyze")
    r = subprocess.run(["systemd-analyze", "security", "--offline=yes", str(UNIT)], capture_output=True, text=True,
                       timeout=60)
    m = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?) (\w+)", r.stdout)
    assert m, r.stdout + r.stderr
    assert float(m[1]) <= EXPOSURE_TARGET, r.stdout
    assert m[2] in ("PERFECT", "SAFE", "OK"), r.stdout


def test_unit_contract():
    u = unit_settings()
    assert u["Type"] == ["notify"] and u["NotifyAccess"] == ["main"]
    assert u["ExecStart"] == ["/usr/bin/trnd %i --config /etc/trnd/%i.toml"]
    assert u["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert u["Restart"] == ["on-failure"] and u["RestartPreventExitStatus"] == ["69 78"]
    assert u["KillMode"] == ["mixed"]
    # The drain must fit in the stop timeout with room to abort and close the ranks.
    assert seconds(u["TimeoutStopSec"][0]) >= ServeConfig().http.drain_timeout_s + lifecycle.STOP_MARGIN_S
    assert seconds(u["WatchdogSec"][0]) >= 10
    assert "TRND_CACHE_DIR=/var/cache/trnd" in " ".join(u["Environment"]).split()
    assert u["User"] == ["trnd"] and u["CapabilityBoundingSet"] == [""] and u["NoNewPrivileges"] == ["yes"]
    assert u["DevicePolicy"] == ["closed"] and "PrivateDevices" not in u
    assert u["PartOf"] == ["trnd.target"] and u["WantedBy"] == ["trnd.target"]
    assert any(v.startswith("trnd:/etc/trnd/credentials") for v in u["LoadCredential"])


def test_sysusers_and_tmpfiles_make_the_account_and_directories(tmp_path):
    need("systemd-sysusers")
    need("systemd-tmpfiles")
    if os.geteuid() != 0:
        pytest.skip("tmpfiles needs root to hand directories to the trnd user")
    (tmp_path / "etc").mkdir()
    r = subprocess.run(["systemd-sysusers", f"--root={tmp_path}", str(SYSTEMD / "trnd.sysusers")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    user = next(line.split(":") for line in (tmp_path / "etc/passwd").read_text().splitlines()
                if line.startswith("trnd:"))
    assert user[5] == "/var/lib/trnd" and user[6].endswith("nologin")
    r = subprocess.run(["systemd-tmpfiles", f"--root={tmp_path}", "--create", str(SYSTEMD / "trnd.tmpfiles")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    uid = int(user[2])
    for path, mode, owner in (("etc/trnd/credentials", 0o700, 0), ("var/lib/trnd", 0o750, uid),
                              ("var/cache/trnd", 0o750, uid)):
        st = (tmp_path / path).stat()
        assert (st.st_mode & 0o777, st.st_uid) == (mode, owner), path


