"""What a vLLM or SGLang user types besides requests: `trnd --version`, a model by its Hugging Face id
from a local cache laid out as huggingface_hub lays it out, the presets said when made (`trnd points`,
`LLM("tiny")`), and the API key kept out of argv (--api-key-file, TRND_API_KEY), through real processes."""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.launch import free_port, stop, wait_ready
from trnd.model.config import ModelError
from trnd.model.hub import served_name, snapshot_dir

COMMIT = "a" * 40
COMMIT_V1 = "b" * 40


def trnd(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trnd", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_version():
    r = trnd("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"trnd {importlib.metadata.version('trnd')}"


@pytest.fixture(scope="module")
def hf_home(tiny_qwen3, tmp_path_factory) -> Path:
    """A Hugging Face cache as huggingface_hub writes it: files as blobs named by their hash, each snapshot a
    directory of relative symlinks to them, refs/<branch> naming the snapshot's commit."""
    home = tmp_path_factory.mktemp("hf-home")
    repo = home / "hub" / "models--acme--tiny-chat"
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    for commit, ref in ((COMMIT, "main"), (COMMIT_V1, "v1")):
        snap = repo / "snapshots" / commit
        snap.mkdir(parents=True)
        for f in tiny_qwen3.iterdir():
            blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
            if not blob.exists():
                shutil.copyfile(f, blob)
            (snap / f.name).symlink_to(os.path.relpath(blob, snap))
        (repo / "refs" / ref).write_text(commit)
    return home


def test_a_hugging_face_id_resolves_in_the_local_cache(hf_home, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(hf_home))
    repo = hf_home / "hub" / "models--acme--tiny-chat"
    assert snapshot_dir("acme/tiny-chat") == repo / "snapshots" / COMMIT
    assert snapshot_dir("acme/tiny-chat", "v1") == repo / "snapshots" / COMMIT_V1
    assert snapshot_dir("acme/tiny-chat", COMMIT_V1) == repo / "snapshots" / COMMIT_V1
    assert served_name(repo / "snapshots" / COMMIT) == "acme/tiny-chat"
    monkeypatch.setenv("HF_HUB_CACHE", str(hf_home / "hub"))  # wins over HF_HOME
    monkeypatch.setenv("HF_HOME", "/nonexistent")
    assert snapshot_dir("acme/tiny-chat") == repo / "snapshots" / COMMIT
    for model, rev in (("acme/other", None), ("acme/tiny-chat", "v2")):
        with pytest.raises(ModelError) as e:
            snapshot_dir(model, rev)
        assert "\n" not in str(e.value) and f"hf download {model}" in str(e.value) and str(hf_home / "hub") in str(e.value)


def test_serve_a_model_by_its_hugging_face_id(hf_home, tmp_path):
    env = {"HF_HOME": str(hf_home), "HF_HUB_CACHE": ""}
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "trnd", "serve", "--aggregated", "--model", "acme/tiny-chat",
                             "--port", str(port), "--threads", "1", "--kv-memory-gb", "0.05"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **env})
    try:
        wait_ready(port, proc)
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["acme/tiny-chat"]
    finally:
        stop(proc)
    r = trnd("serve", "--aggregated", "--model", "acme/absent", "--port", str(free_port()), env=env)
    assert r.returncode == 78 and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "hf download acme/absent" in r.stderr


def test_a_preset_is_said_when_it_is_made(tmp_path, monkeypatch):
    """`trnd points --model tiny` writes a model on first use: it says so, once; LLM takes the name too."""
    env = {"TRND_CACHE_DIR": str(tmp_path)}
    first = trnd("points", "--model", "tiny", env=env)
    assert first.returncode == 0, first.stderr
    assert f"created random-weight model 'tiny' at {tmp_path / 'models'}" in first.stderr
    again = trnd("points", "--model", "tiny", env=env)
    assert again.returncode == 0 and "created" not in again.stderr
    monkeypatch.setenv("TRND_CACHE_DIR", str(tmp_path))
    from trnd.llm import LLM
    from trnd.sampling_params import SamplingParams

    out = LLM("tiny", kv_memory_gb=0.05).generate(["Hello"], SamplingParams(max_tokens=3, temperature=0))
    assert len(out[0].token_ids) == 3


def test_the_api_key_from_a_file_or_the_environment(tiny_qwen3, tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    for args, env, key in ((["--api-key-file", str(key_file)], {}, "from-file"),
                           ([], {"TRND_API_KEY": "from-env"}, "from-env")):
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "trnd", "serve", "--aggregated", "--model", str(tiny_qwen3),
                                 "--port", str(port), "--threads", "1", "--kv-memory-gb", "0.05", *args],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, **env})
        try:
            wait_ready(port, proc)
            url = f"http://127.0.0.1:{port}"
            assert key not in " ".join(proc.args)
            denied = httpx.get(f"{url}/v1/models")
            assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
            assert denied.json()["error"]["type"] == "invalid_request_error"
            assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
            if env:  # trnd top reads the same variable
                top = trnd("top", "--once", url, env=env, timeout=60)
                assert top.returncode == 0, top.stdout + top.stderr
        finally:
            stop(proc)


def test_transfer_counters_read_as_numbers():
    from trnd.top.panels import fmt_counter

    assert fmt_counter("post_ms", 24.529749000180345) == "24.5"
    assert fmt_counter("bytes", 6.3 * 2**20) == "6.3 MiB" and fmt_counter("xfers", 31) == "31"


def test_the_shipped_role_configs_start_outside_systemd(tiny_qwen3, tmp_path):
    """README: `trnd prefill --config configs/prefill.toml` and `trnd decode --config configs/decode.toml` by hand.
    Their secret_file is systemd's credential; without systemd both roles share this host's secret, which the
    first makes 0600 beside trnd's state."""
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRND_CACHE_DIR": str(tmp_path)}
    env.pop("CREDENTIALS_DIRECTORY", None)
    control, admin, port = free_port(), free_port(), free_port()
    common = ["--model", str(tiny_qwen3), "--threads", "1", "--kv-memory-gb", "0.1"]
    prefill = subprocess.Popen([sys.executable, "-m", "trnd", "prefill", "--config", str(repo / "configs/prefill.toml"),
                                "--control-port", str(control), "--admin-port", str(admin), *common],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    decode = subprocess.Popen([sys.executable, "-m", "trnd", "decode", "--config", str(repo / "configs/decode.toml"),
                               "--prefill", f"127.0.0.1:{control}", "--port", str(port), *common],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        wait_ready(port, decode)
        secret = tmp_path / "control_secret"
        assert secret.stat().st_mode & 0o777 == 0o600 and len(secret.read_text().strip()) == 64
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"prompt": "Hello", "max_tokens": 3, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        out = stop(decode) + stop(prefill)
    assert "Traceback" not in out and " ERROR " not in out, out
    # a variable other than systemd's that is not set: one line naming the field and the two ways out
    r = trnd("prefill", "--model", str(tiny_qwen3), "--secret-file", "${NO_SUCH_DIR}/secret", env=env)
    assert r.returncode == 78 and len(r.stderr.strip().splitlines()) == 1
    assert "secret_file" in r.stderr and "NO_SUCH_DIR is not set" in r.stderr, r.stderr


def test_a_point_the_model_or_memory_cannot_serve_is_refused_once_before_any_child(tiny_qwen3):
    """Each role refused such a point in turn, after the supervisor printed its children: now one line first."""
    for args, said in ((["--point", "1m"], "point '1m' serves max_context = 1048576"),
                       (["--kv-memory-gb", "0.0001"], "point '8k' needs")):
        r = trnd("serve", "--model", str(tiny_qwen3), "--port", str(free_port()), *args, timeout=120)
        out = r.stdout + r.stderr
        assert r.returncode == 78 and out.count(said) == 1, out
        assert "local deployment" not in out and "Traceback" not in out, out  # no child was started


def test_a_capped_point_is_said_at_start_and_on_v1_models(tiny_qwen3):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "trnd", "serve", "--model", str(tiny_qwen3), "--port", str(port),
                             "--max-model-len", "4096", "--kv-memory-gb", "0.1", "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_ready(port, proc)
        card = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"][0]
        assert card["max_model_len"] == 4096 and card["point"] == "8k" and card["capacity"]["max_batch"] == 32, card
    finally:
        out = stop(proc)
    assert "point 8k capped: max_model_len 4096 of its max_context 8192" in out, out
