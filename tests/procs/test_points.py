"""Decode points that tell the truth: positions checked against the model, capacity in tokens and
full-length sequences, `trnd points`, and an unknown point named in one line."""

from __future__ import annotations

import subprocess
import sys

from trnd.points import capacity, check_positions, get_point, model_positions


def test_positions_past_the_model_are_refused_with_both_numbers():
    why = check_positions(get_point("1m"), 131072, None)
    assert why and "1048576" in why and "131072" in why and "rope_scaling" in why
    assert check_positions(get_point("128k"), 131072, None) is None


def test_rope_scaling_reaches_further():
    yarn = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 131072}
    assert model_positions(32768, yarn)[0] == 1048576
    assert check_positions(get_point("1m"), 32768, yarn) is None
    short = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}
    assert model_positions(131072, short) == (131072, "max_position_embeddings = 131072")  # the larger wins


def test_capacity_counts_tokens_and_full_length_sequences():
    p = get_point("128k")  # 64-token pages, max_context 131072, batch 32
    cap = capacity(p, page_bytes=64 * 1000, pages=4096)
    assert cap.tokens == 262144 and cap.full_length_sequences == 2.0 and cap.kv_bytes_per_token == 1000
    assert cap.tokens_per_sequence_at_full_batch == 8192 and "2.00 full-length sequences" in cap.line()


def test_trnd_points_prints_every_point(tiny_qwen3):
    out = subprocess.run([sys.executable, "-m", "trnd", "points", "--model", str(tiny_qwen3)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = {ln.split()[0]: ln for ln in out.stdout.splitlines() if ln.split() and ln.split()[0] in ("8k", "128k", "1m")}
    assert set(lines) == {"8k", "128k", "1m"}
    assert "refused" in lines["1m"] and "1048576" in lines["1m"]
    assert "ok" in lines["8k"]


def test_unknown_point_is_one_line_exit_78(tiny_qwen3):
    out = subprocess.run([sys.executable, "-m", "trnd", "serve", "--model", str(tiny_qwen3), "--point", "2m"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 78 and out.stderr.count("\n") == 1
    assert "point = '2m' is not a known decode point" in out.stderr and "Traceback" not in out.stderr


def test_a_role_on_a_point_past_the_models_positions_is_refused(tiny_qwen3, tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    out = subprocess.run([sys.executable, "-m", "trnd", "prefill", "--model", str(tiny_qwen3), "--point", "1m",
                          "--secret-file", str(secret), "--kv-memory-gb", "1"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 78, out.stderr[-2000:]
    err = [ln for ln in out.stderr.splitlines() if "1048576" in ln]
    assert err and "131072" in err[0] and "Traceback" not in out.stderr


def test_capacity_is_in_admin_state(tiny_qwen3, tmp_path):
    from tests.launch import admin_state, free_port, stop, wait_ready

    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    cp, ap = free_port(), free_port()
    pre = subprocess.Popen([sys.executable, "-m", "trnd", "prefill", "--model", str(tiny_qwen3), "--secret-file",
                            str(secret), "--threads", "1", "--kv-memory-gb", "0.05", "--control-port", str(cp),
                            "--admin-port", str(ap)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_ready(ap, pre)
        cap = admin_state(ap)["capacity"]
        assert cap["tokens"] == cap["pages"] * 16 and cap["max_batch"] == 32
        assert cap["full_length_sequences"] == round(cap["tokens"] / 8192, 3)
    finally:
        out = stop(pre)
    assert "full-length sequences" in out  # the start-up line


def test_trnd_points_sizes_fp8_pages(tiny_qwen3):
    from trnd.points_report import rows

    auto = {r["point"]: r for r in rows(tiny_qwen3, "float32", 1, 0.1)}
    fp8 = {r["point"]: r for r in rows(tiny_qwen3, "float32", 1, 0.1, "fp8_e4m3")}
    assert fp8["8k"]["kv_per_token"] < auto["8k"]["kv_per_token"] / 3  # fp32 KV -> 1 byte + scales
    assert fp8["8k"]["tokens"] > 3 * auto["8k"]["tokens"]
