"""Tensor parallelism: TP=2 ranks (real processes over gloo) give the same greedy tokens as TP=1 and
transformers; a killed rank takes the role down cleanly."""

from __future__ import annotations

import os
import signal
import time

import msgspec
import pytest

from trnd.engine.request import SamplingParams
from trnd.llm import LLM

from .procs import alive, children, start_serve, wait_ready

from .test_engine_vs_hf import hf_greedy, prompts_of

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_gqa1(models_dir):
    from trnd.model.maker import make_model

    path = models_dir / "tiny-gqa1"
    if not path.exists():
        make_model(path, preset="tiny-gqa1", arch="qwen3", seed=2, dtype="float32")
    return path


def run_tp(model_dir, tp: int, prompts):
    llm = LLM(str(model_dir), page_size=8, num_pages=128, tp=tp, threads=1)
    try:
        outs = [c.token_ids for c in llm.generate(prompts, GREEDY)]
        state = msgspec.to_builtins(llm.engine.state().layout)  # as /admin/state has it
        # every rank wrote its KV into its own pool, which the role process can see (shared memory)
        assert all(pool.abs().sum() > 0 for pool in llm.engine.pools)
    finally:
        llm.engine.close()
    return outs, state


@pytest.mark.parametrize("which", ["qwen3", "llama", "gqa1"])
def test_tp2_matches_tp1_and_transformers(which, tiny_qwen3, tiny_llama, tiny_gqa1):
    model_dir = {"qwen3": tiny_qwen3, "llama": tiny_llama, "gqa1": tiny_gqa1}[which]
    prompts = prompts_of([9, 30, 17], 200, seed=11)
    expected = hf_greedy(model_dir, prompts, 8)
    tp1, _ = run_tp(model_dir, 1, prompts)
    tp2, layout = run_tp(model_dir, 2, prompts)
    assert tp1 == expected
    assert tp2 == expected
    assert layout["tp"] == 2 and all(r["alive"] for r in layout["ranks"]) and len(layout["ranks"]) == 2
    if which == "gqa1":  # one KV head, two ranks: replicated, each rank holds it
        assert layout["kv_heads_per_rank"] == 1


@pytest.mark.slow
def test_killed_rank_takes_the_role_down_with_no_orphans(tiny_qwen3, tmp_path):
    proc, port = start_serve(tiny_qwen3, "--aggregated", "--tp", "2", "--threads", "1", "--kv-memory-gb", "0.05")
    try:
        wait_ready(port, proc)
        workers = [p for p in children(proc.pid) if b"spawn_main" in open(f"/proc/{p}/cmdline", "rb").read()]
        assert workers, "no rank processes found"
        victim = max(workers)
        os.kill(victim, signal.SIGKILL)
        rc = proc.wait(timeout=20)
        out = proc.stdout.read()
        assert rc != 0
        assert "rank 1" in out and "died" in out
        deadline = time.time() + 5
        while any(alive(p) for p in workers) and time.time() < deadline:
            time.sleep(0.1)
        assert not any(alive(p) for p in workers), "orphan rank processes left behind"
    finally:
        if proc.poll() is None:
            proc.kill()
