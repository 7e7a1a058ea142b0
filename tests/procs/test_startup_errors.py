"""Start-up errors a restart cannot fix: one line naming the field or value, exit 78, no traceback."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import pytest

from tests.launch import free_port, refused_port


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
    cfg["architectures"] = ["MambaForCausalLM"]
    (model / "config.json").write_text(json.dumps(cfg))
    out = run("serve", *mode, "--model", str(model))
    assert out.returncode == 78 and "Traceback" not in out.stderr
    lines = [ln for ln in out.stderr.splitlines() if "model error" in ln]
    assert len(lines) == 1 and "'architectures'" in lines[0] and "MambaForCausalLM" in lines[0]


# -- every role, every kind of start-up error: one line at error priority naming it, 78 or 1 ----------

def _holder() -> tuple[socket.socket, int]:
    """Another process's listening socket (this test's): the port a role must not take for its own."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s, s.getsockname()[1]


def _table_cases():
    """(role argv builder, exit status, what the line must name). `P` is the held port, `M` the tiny
    model, `S` the secret file, `F` a free port; the moe model has an architecture trnd does not run."""
    role = {"prefill": ["prefill", "--model", "M", "--secret-file", "S", "--control-port", "F", "--admin-port", "F"],
            "decode": ["decode", "--model", "M", "--secret-file", "S", "--port", "F"],
            "serve": ["serve", "--model", "M", "--port", "F"],
            "aggregated": ["serve", "--aggregated", "--model", "M", "--port", "F"],
            "router": ["router", "--target", "127.0.0.1:9", "--port", "F"],
            "store": ["store", "--secret-file", "S", "--control-port", "F", "--admin-port", "F", "--memory-gb", "0.01"]}
    cases = []
    for name, argv in role.items():
        cases.append((name, "config", [*argv, "--config", "BADCFG"], 78, "max_nn"))
        held = [i for i, a in enumerate(argv) if a == "F"]
        for i in held:  # each port the role binds, held by another process
            bad = list(argv)
            bad[i] = "P"
            cases.append((name, f"port {argv[i - 1]}", bad, 1, "P"))
    for name in ("prefill", "decode", "serve", "aggregated"):
        argv = role[name]
        cases.append((name, "model path", [a if a != "M" else "NOPE" for a in argv], 78, "nope/config.json"))
        cases.append((name, "architecture", [a if a != "M" else "MOE" for a in argv], 78, "MambaForCausalLM"))
        # a point is a disaggregated deployment's: one process refuses it by name, whatever the value
        cases.append((name, "point", [*argv, "--point", "9k"], 78, "'9k'" if name != "aggregated" else
                      "point: it does not apply with aggregated"))
        cases.append((name, "backend", [*argv, "--backend", "neuron"], 69, "Neuron"))
    for name in ("prefill", "decode"):
        cases.append((name, "core lock", [*role[name], "--core-lock", "NOPE/cores.lock"], 78, "core_lock"))
    cases.append(("serve", "port --prefill-control-port", [*role["serve"], "--prefill-control-port", "P"], 1, "P"))
    cases.append(("serve", "port --prefill-admin-port", [*role["serve"], "--prefill-admin-port", "P"], 1, "P"))
    cases.append(("serve", "port --decode-port", [*role["serve"], "--decode", "2", "--decode-port", "P"], 1, "P"))
    cases.append(("router", "model path", [*role["router"], "--model", "NOPE"], 78, "nope"))
    # every *_file field read at start: missing, or empty (a key that would turn authentication off)
    for name, argv in role.items():
        cases.append((name, "api_key_file missing", [*argv, "--config", "KEYNOPE"], 78, "api_key_file = '/nonexistent/key'"))
        cases.append((name, "api_key_file empty", [*argv, "--config", "KEYEMPTY"], 78, "is empty"))
        cases.append((name, "api_key empty", [*argv, "--config", "KEYBLANK"], 78, "api_key is empty"))
    for name in ("prefill", "decode", "store"):
        cases.append((name, "secret_file missing", [a if a != "S" else "NOPE" for a in role[name]], 78,
                      "secret_file"))
    cases.append(("router", "target_api_key_file empty", [*role["router"], "--config", "TKEYEMPTY"], 78,
                  "target_api_key_file"))
    return cases


@pytest.mark.parametrize("role,kind,argv,code,named", _table_cases(), ids=lambda v: v if isinstance(v, str) else None)
def test_every_startup_error_is_one_line_at_error_priority(tiny_qwen3, tmp_path, role, kind, argv, code, named):
    moe = tmp_path / "moe"
    if "MOE" in argv:
        shutil.copytree(tiny_qwen3, moe)
        cfg = json.loads((moe / "config.json").read_text())
        cfg["architectures"] = ["MambaForCausalLM"]
        (moe / "config.json").write_text(json.dumps(cfg))
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    bad_cfg = tmp_path / "bad.toml"
    bad_cfg.write_text("max_nn = 3\n")
    empty = tmp_path / "empty_key"
    empty.write_text(" \n")
    configs = {"KEYNOPE": 'api_key_file = "/nonexistent/key"\n', "KEYEMPTY": f'api_key_file = "{empty}"\n',
               "KEYBLANK": 'api_key = " "\n', "TKEYEMPTY": f'target_api_key_file = "{empty}"\n'}
    for k, text in configs.items():
        (tmp_path / f"{k}.toml").write_text(text)
    holder, held = _holder()
    names = {"M": str(tiny_qwen3), "NOPE": str(tmp_path / "nope"), "MOE": str(moe), "S": str(secret),
             "BADCFG": str(bad_cfg), "P": str(held), **{k: str(tmp_path / f"{k}.toml") for k in configs}}
    try:
        args = [names.get(a) or (str(free_port()) if a == "F" else a) for a in argv]
        out = subprocess.run([sys.executable, "-m", "trnd", *args], capture_output=True, text=True, timeout=180,
                             env={**os.environ, "JOURNAL_STREAM": "8:1"})  # as under systemd: <N> prefixes
    finally:
        holder.close()
    errors = [ln for ln in out.stderr.splitlines() if re.match(r"<[0-3]>", ln)]
    assert out.returncode == code, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert len(errors) == 1, out.stderr[-3000:]  # one line an operator reads with journalctl -p err
    want = names.get(named, named)
    assert want in errors[0], errors
    if kind.startswith("port"):
        assert "in use" in errors[0], errors


def _listen_beside(argv: list[str], port: int, when) -> str:
    """Start `trnd *argv` (journald priorities on), wait until `when(proc)` holds, then bind and listen on
    `port` as a role binds it (SO_REUSEADDR: whichever listens first keeps it). The role must end with exit
    1 and no traceback; returns its stderr."""
    proc = subprocess.Popen([sys.executable, "-m", "trnd", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "JOURNAL_STREAM": "8:1"})
    holder = socket.socket()
    try:
        when(proc)
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", port))
        holder.listen()
        _, err = proc.communicate(timeout=180)
    finally:
        proc.kill()
        holder.close()
    assert proc.returncode == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    return err


def test_a_port_taken_after_the_supervisors_check_stops_the_deployment_with_exit_1(tiny_qwen3):
    """The supervisor tries every child's port before starting them; another process that takes one in
    between is found by the child itself: one line at error priority naming the port, the supervisor
    says which child stopped the deployment (a warning), exit 1 (a restart can fix it). Nothing of the
    other process counts as the deployment's decode server, though it answers on its port."""
    port = free_port()

    def children_starting(proc):
        assert proc.stdout.readline().startswith("trnd: local deployment:")

    err = _listen_beside(["serve", "--model", str(tiny_qwen3), "--port", str(port), "--threads", "1",
                          "--kv-memory-gb", "0.05"], port, children_starting)
    errors = [ln for ln in err.splitlines() if re.match(r"<[0-3]>", ln)]
    assert len(errors) == 1 and str(port) in errors[0], err[-3000:]
    assert any(ln.startswith("<4>") and "decode exited with 1 before the deployment was ready" in ln
               for ln in err.splitlines()), err[-3000:]
    assert "deployment ready" not in err


def _bound(port: int) -> bool:
    """Another socket is bound to 127.0.0.1:port (a role's early bind, not listening yet: /proc/net/tcp does
    not list it): a bind without SO_REUSEADDR conflicts with it."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_a_port_another_process_listens_on_first_ends_the_role_with_exit_1(tiny_qwen3, tmp_path, role):
    """The role binds its port at start and listens once loaded; another process binding it too (both with
    SO_REUSEADDR, which Linux allows while neither listens) and listening in between wins it. The role must
    not run on serving nothing (uvloop's create_server does not raise): one line naming the port, exit 1."""
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    port = free_port()
    argv = (["decode", "--port", str(port), "--prefill", f"127.0.0.1:{refused_port()}"] if role == "decode" else
            ["prefill", "--control-port", str(port), "--admin-port", str(free_port())])

    def role_bound(proc):
        deadline = time.monotonic() + 60
        while not _bound(port):
            assert proc.poll() is None and time.monotonic() < deadline, "the role never bound its port"
            time.sleep(0.005)

    err = _listen_beside([*argv, "--model", str(tiny_qwen3), "--secret-file", str(secret), "--threads", "1",
                          "--kv-memory-gb", "0.05"], port, role_bound)
    errors = [ln for ln in err.splitlines() if re.match(r"<[0-3]>", ln) and str(port) in ln]  # (decode: and
    assert len(errors) == 1 and "another process" in errors[0], err[-3000:]  # its unreachable prefill peer)
