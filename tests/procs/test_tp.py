"""Tensor parallelism: TP=2 ranks (real processes over gloo) give the same greedy tokens as TP=1 and
transformers; a killed rank takes the role down cleanly."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import replace

import msgspec
import pytest
import torch

from trnd.engine.request import SamplingParams
from trnd.llm import LLM
from trnd import parallel
from trnd.parallel import TPGroup

from tests.launch import alive, children, start_serve, wait_ready

from tests.unit.test_engine_vs_hf import hf_greedy, prompts_of

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


@pytest.mark.parametrize("sampled", ["none", "the chunk's last row"])
def test_every_ranks_kv_write_is_waited_for_before_the_forward_returns(tiny_qwen3, sampled, monkeypatch):
    """The prefill role ships a chunk's pages as soon as rank 0's forward returns, so that forward must not
    return before the other ranks wrote their heads' K/V: some collective that waits must follow every layer's
    K/V write. A first chunk has no sampled row and its last layer stops right after the write (the case that
    shipped a stale last layer from a tp=2 prefill under load)."""
    from trnd_kernels.attention import AttnMeta, PrefillSeq
    from trnd.model.loader import load_model

    log = []  # rank 0 of two, its collectives logged with whether they make it wait (gloo's: not over nothing)
    monkeypatch.setattr(parallel.dist, "all_reduce", lambda x: log.append(("waits", x.numel() > 0)))
    monkeypatch.setattr(parallel.dist, "all_gather",
                        lambda parts, x: [log.append(("waits", x.numel() > 0))] + [p.copy_(x) for p in parts])
    monkeypatch.setattr(parallel.dist, "barrier", lambda: log.append(("waits", True)))
    model, cfg = load_model(tiny_qwen3, "float32", TPGroup(0, 2))
    write_kv = model.layers[0].attn.ops.write_kv
    ops = replace(model.layers[0].attn.ops, write_kv=lambda *a: (log.append(("write_kv", None)), write_kv(*a))[1])
    for m in model.modules():
        if hasattr(m, "ops"):
            m.ops = ops
    n, p = 20, 8
    pages = torch.arange(3)
    pos = torch.arange(n)
    kv = torch.zeros(4, cfg.num_layers, 2, cfg.num_kv_heads // 2, p, cfg.head_dim)
    meta = AttnMeta(pages[pos // p], pos % p, 0, None, None, [PrefillSeq(0, n, n, pages)])
    rows = torch.tensor([] if sampled == "none" else [n - 1], dtype=torch.long)
    model(torch.randint(5, 100, (n,)), pos, kv, meta, rows)
    writes = [i for i, (what, _) in enumerate(log) if what == "write_kv"]
    assert len(writes) == cfg.num_layers
    for w in writes:
        assert ("waits", True) in log[w + 1:], f"nothing waits for the other rank after K/V write {w}: {log}"
