"""`trnd compile` then roles that load its graphs: a real local deployment (prefill + decode processes) on the
static path with the cache compiles nothing (torch's own counters, in /admin/state and the start-up line)
and answers greedy requests token for token like the eager path; a cache built for another model, point,
dtype, torch or thread count is refused in one line naming the field and both values, exit 78.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import msgspec
import openai
import pytest

from tests.launch import admin_state, free_port, stop, wait_ready
from trnd.config import ConfigError, PrefillConfig, load_config

# Four graphs (decode batch 2, prefill chunk 16, page-table widths 1 and 2) keep the compile near a minute.
# ct-twin: the same shapes under another name (a cache must be refused for its point's name alone).
_SHAPE = """
max_context = 32
max_batch = 2
page_size = 16
prefill_chunk = 16
decode_buckets = [2]
prefill_buckets = [16]
"""
POINTS = f"[points.ct]{_SHAPE}\n[points.ct-twin]{_SHAPE}"
KV_GB = "0.002"
PROMPTS = [[5, 17, 33, 250, 9, 71, 402, 8, 19, 600, 12, 44, 3, 90, 18, 27, 301, 55, 6, 14], [7, 8, 9, 10, 11]]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    d = tmp_path_factory.mktemp("points")
    (d / "points.toml").write_text(POINTS)
    import os

    return {**os.environ, "TRND_POINTS": str(d / "points.toml")}


@pytest.fixture(scope="module")
def cache(tiny_qwen3, env, tmp_path_factory):
    out = tmp_path_factory.mktemp("compile") / "ct"
    r = subprocess.run([sys.executable, "-m", "trnd", "compile", "--point", "ct", "--model", str(tiny_qwen3), "--out",
                        str(out), "--kv-memory-gb", KV_GB, "--threads", "1"], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "point ct, 4 graphs (4 compiled" in r.stdout, r.stdout
    return out


def test_the_manifest_names_what_the_graphs_were_built_for(cache, tiny_qwen3):
    import torch

    from trnd.compile_cache import CacheManifest
    from trnd.model.config import fingerprint

    m = msgspec.json.decode((cache / "manifest.json").read_bytes(), type=CacheManifest)
    assert (m.model, m.point, m.dtype, m.torch, m.compiler) == (fingerprint(tiny_qwen3), "ct", "float32",
                                                                str(torch.__version__), "inductor")
    assert sorted(m.graphs) == [("decode", 2, 1), ("decode", 2, 2), ("prefill", 16, 1), ("prefill", 16, 2)]
    assert any((cache / "inductor" / "fxgraph").rglob("*")), "the FX graph cache is in DIR"


@pytest.mark.slow
def test_roles_with_the_cache_compile_nothing_and_match_the_eager_path(cache, tiny_qwen3, env):
    from trnd.engine.request import SamplingParams
    from trnd.llm import LLM

    want = LLM(str(tiny_qwen3), page_size=16, num_pages=8, max_batch=2, token_budget=16, chunk_size=16,
               max_model_len=32).generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "trnd", "serve", "--model", str(tiny_qwen3), "--port", str(port),
                             "--point", "ct", "--compile-cache", str(cache), "--kv-memory-gb", KV_GB, "--threads", "1"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        while line and "local deployment" not in line:
            line = proc.stdout.readline()
        prefill_admin = int(re.search(r"prefill0 pid \d+ \(http://127.0.0.1:(\d+)\)", line).group(1))
        wait_ready(port, proc, timeout=240)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        card = client.models.list().data[0].model_dump()
        assert card["point"] == "ct" and card["static"] is True
        assert card["capacity"]["tokens"] == card["capacity"]["pages"] * 16
        for ids, w in zip(PROMPTS, want):
            got = client.completions.create(model=card["id"], prompt=ids, max_tokens=10, temperature=0.0,
                                            extra_body={"ignore_eos": True})
            assert got.choices[0].text == w.text and got.usage.completion_tokens == 10
        for state in (admin_state(port), admin_state(prefill_admin)):
            s = state["static"]
            assert (s["point"], s["compiler"], s["graphs"], s["loaded"], s["compiled"]) == ("ct", "inductor", 4, 4, 0)
            assert s["compile_cache"] == str(cache)
    finally:
        out = stop(proc, timeout=30)
    assert out.count("graphs loaded, 0 compiled") == 2, out[-3000:]  # each role's start-up line


def _prefill(tiny_model, cache, env, tmp_path, *extra) -> subprocess.Popen:
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    return subprocess.Popen([sys.executable, "-m", "trnd", "prefill", "--model", str(tiny_model), "--secret-file",
                             str(secret), "--threads", "1", "--kv-memory-gb", KV_GB, "--compile-cache", str(cache),
                             "--control-port", str(free_port()), "--admin-port", str(free_port()), *extra],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_cache_built_for_another_setup_is_refused_naming_the_field(cache, tiny_qwen3, tiny_llama, env, tmp_path):
    old_torch = tmp_path / "old-torch"
    old_torch.mkdir()
    m = json.loads((cache / "manifest.json").read_text())
    (old_torch / "manifest.json").write_text(json.dumps({**m, "torch": "2.12.0+cpu"}))
    shutil.copytree(cache / "inductor", old_torch / "inductor")
    cases = {  # field -> (the role, what the error must show)
        "model": _prefill(tiny_llama, cache, env, tmp_path, "--point", "ct"),
        "point": _prefill(tiny_qwen3, cache, env, tmp_path, "--point", "ct-twin"),
        "dtype": _prefill(tiny_qwen3, cache, env, tmp_path, "--point", "ct", "--dtype", "bfloat16"),
        "torch": _prefill(tiny_qwen3, old_torch, env, tmp_path, "--point", "ct"),
        "threads": _prefill(tiny_qwen3, cache, env, tmp_path, "--point", "ct", "--threads", "2"),
    }
    shown = {"model": None, "point": ("'ct'", "'ct-twin'"), "dtype": ("'float32'", "'bfloat16'"),
             "torch": ("'2.12.0+cpu'", f"'{m['torch']}'"), "threads": ("= 1 in the cache, 2 in this role",)}
    for field, proc in cases.items():
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 78, (field, err[-2000:])
        lines = [ln for ln in err.splitlines() if "trnd: cannot start" in ln]
        assert len(lines) == 1 and "Traceback" not in err, (field, err[-2000:])
        assert f"was built for another setup: {field} = " in lines[0], (field, lines[0])
        if shown[field]:
            assert all(v in lines[0] for v in shown[field]), (field, lines[0])


def test_no_manifest_and_static_config_errors_are_one_line(tmp_path, tiny_qwen3, env):
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    r = subprocess.run([sys.executable, "-m", "trnd", "prefill", "--model", str(tiny_qwen3), "--point", "ct",
                        "--secret-file", str(secret), "--compile-cache", str(tmp_path / "none")], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 78 and "no manifest.json there" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    with pytest.raises(ConfigError, match=r"static runs one rank: tp = 2 must be 1 - at `\$.static`"):
        load_config(PrefillConfig, None, {"static": True, "tp": 2})
    with pytest.raises(ConfigError, match=r"compile_cache keeps KV in the model dtype.*fp8_e4m3"):
        load_config(PrefillConfig, None, {"compile_cache": "/x", "kv_cache_dtype": "fp8_e4m3"})


def test_a_static_role_without_a_cache_shows_its_buckets(tiny_qwen3, env, tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    ap = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "trnd", "prefill", "--model", str(tiny_qwen3), "--point", "ct",
                             "--static", "--secret-file", str(secret), "--threads", "1", "--kv-memory-gb", KV_GB,
                             "--control-port", str(free_port()), "--admin-port", str(ap)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_ready(ap, proc)
        s = admin_state(ap)["static"]
        assert (s["point"], s["decode_buckets"], s["prefill_buckets"], s["widths"], s["graphs"], s["loaded"]) == \
            ("ct", [2], [16], [1, 2], 4, 0)
        assert s["compiler"] == "eager" and s.get("compile_cache") is None
        assert s["compiled"] == s["used"] >= 1  # one graph per bucket run so far (the warm-up's), on first use
    finally:
        out = stop(proc)
    assert "static path: point ct, decode buckets [2], prefill buckets [16]" in out


def test_a_cache_others_could_write_is_refused(cache, tiny_qwen3, env, tmp_path):
    """torch loads pickles and shared objects from the cache: a world-writable DIR, a world-writable entry deep
    in inductor/, or a tree another user owns is refused (one line naming compile_cache and the path, exit 78),
    as ssh refuses a key file others can write; a sticky /tmp above it is fine (the other roles here use it)."""
    import os

    cases = {}
    for case in ("world-writable dir", "world-writable entry", "foreign owner"):
        d = tmp_path / case.replace(" ", "-")
        shutil.copytree(cache, d)
        if case == "world-writable dir":
            d.chmod(0o777)
        elif case == "world-writable entry":
            deepest = max((p for p in (d / "inductor").rglob("*") if p.is_file()), key=lambda p: len(p.parts))
            deepest.chmod(0o666)
        else:
            os.chown(d / "inductor", 4321, 4321)
        cases[case] = (d, _prefill(tiny_qwen3, d, env, tmp_path, "--point", "ct"))
    for case, (d, proc) in cases.items():
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 78, (case, err[-2000:])
        lines = [ln for ln in err.splitlines() if "trnd: cannot start" in ln]
        assert len(lines) == 1 and "Traceback" not in err, (case, err[-2000:])
        assert f"compile_cache = '{d}': refused: {d}" in lines[0], (case, lines[0])
        assert ("writable by every user" if "writable" in case else "owned by uid 4321") in lines[0], lines[0]
