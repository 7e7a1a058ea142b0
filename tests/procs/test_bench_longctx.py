"""`trnd bench longctx` at tiny sizes: the real command on the 1m point (the tiny Llama with RoPE scaled to
1M positions passes the role's position check), growing prefixes served from the prefix cache, a decode
step timed at each context, the CPU line; and the time cap stops before a length predicted past it."""

from __future__ import annotations

import json
import subprocess
import sys

from trnd.bench.longctx import long_model, run_curve
from trnd.llm import LLM
from trnd.points import check_positions, get_point


def test_the_long_model_reaches_the_1m_point():
    from trnd.model.config import ModelConfig

    mc = ModelConfig.from_dir(long_model(1048576))
    assert mc.max_position_embeddings == 131072  # the positions come from the scaling, not a bigger number
    assert check_positions(get_point("1m"), mc.max_position_embeddings, mc.rope_scaling) is None
    cfg = json.loads((long_model(1048576) / "config.json").read_text())
    assert cfg["rope_scaling"]["factor"] * cfg["rope_scaling"]["original_max_position_embeddings"] == 1048576


def test_bench_longctx_smoke():
    out = subprocess.run([sys.executable, "-m", "trnd", "bench", "longctx", "--lengths", "256,640",
                          "--decode-steps", "2", "--threads", "1"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("cpu: ") and "isa " in lines[0]
    assert "point 1m (page 128, chunk 8192)" in out.stdout
    rows = [ln.split("|")[1:-1] for ln in lines if ln.startswith("| ") and ln.split("|")[1].strip().isdigit()]
    assert [int(r[0]) for r in rows] == [256, 640]
    assert all(float(r[2]) > 0 and float(r[4]) > 0 for r in rows)
    assert "+384 tokens" in out.stdout  # 640 after 256: the first 256 came from the prefix cache
    assert lines[-1] == "every length served"


def test_the_time_cap_stops_before_a_length_predicted_past_it(tiny_qwen3):
    engine = LLM(str(tiny_qwen3), num_pages=64, page_size=16, max_model_len=1024).engine
    rows, ended = run_curve(engine, [64, 128, 256], decode_steps=2, max_seconds=0.0)
    assert [r["context"] for r in rows] == [64] and rows[0]["decode_steps"] == 2
    assert ended.startswith("stopped before 128: predicted")
    engine.check_integrity()
