"""DeepSeek-V2/V3 (MLA + routed and shared experts) and the latent KV pool: greedy output token-identical to
transformers in fp32, the pool's page the latent + rope row (one head, replicated under TP), moved unchanged by
the PD handoff (digests checked), the L2 tier and an L3 store; the contract names the pool; unserved kinds refused in one line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import httpx
import msgspec
import pytest
import torch

from trnd.engine.request import SamplingParams
from trnd.engine.runner import alloc_kv, kv_page_bytes
from trnd.llm import LLM
from trnd.model.config import ModelConfig
from trnd.model.maker import make_model
from trnd.roles.common import pool_spec
from trnd.transfer import protocol as wire
from trnd.transfer.plan import Layout, make_plan

from tests.launch import admin_state, start_store, stop, wait_for
from tests.procs.test_disagg import Deployment, aggregated, prompts
from tests.unit.test_engine_vs_hf import assert_batch_matches_transformers, hf_greedy, prompts_of

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
LENGTHS = [5, 40, 17, 70]  # pages of 8: one, several (70 tokens: 9 pages)

MODELS = {
    "v2": dict(preset="tiny-mla", seed=3),  # V2-Lite shaped: q_proj, greedy routing, per-expert tensors
    # V2's group-limited routing, the experts stacked as transformers 5 holds them, a dense layer between sparse ones
    "v2-group-fused": dict(preset="tiny-mla", seed=5, expert_layout="fused", overrides={
        "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2, "routed_scaling_factor": 1.5,
        "num_hidden_layers": 3}),
    # V3: q_lora_rank, sigmoid group routing with a score correction, YaRN with mscale_all_dim
    "v3": dict(preset="tiny-mla-v3", seed=4),
}


def _make(models_dir, name):
    path = models_dir / f"mla-{name}"
    if not path.exists():
        make_model(path, dtype="float32", **MODELS[name])
    return path


@pytest.fixture(scope="module")
def tiny_mla(models_dir):
    return _make(models_dir, "v2")


@pytest.mark.parametrize("name", MODELS)
def test_greedy_matches_transformers(models_dir, name):
    """Several prompts in one batch, chunked prefill (expanded form) and decode (absorbed form) through the engine."""
    model = _make(models_dir, name)
    assert_batch_matches_transformers(model, prompts_of(LENGTHS, 1000, seed=len(name)), GREEDY)


def test_the_latent_pool_holds_one_row_per_token_and_layer(tiny_mla):
    """[page, layer, 1 part, 1 head, slot, kv_lora_rank + qk_rope_head_dim]: a fraction of the expanded K|V."""
    mc = ModelConfig.from_dir(tiny_mla, "float32")
    m, pool = mc.mla, mc.pool
    assert (pool.name, pool.parts, pool.heads, pool.width) == ("latent", 1, 1, m.kv_lora_rank + m.qk_rope_head_dim)
    kv = alloc_kv(mc, 1, 4, 8)
    assert kv.shape == (4, mc.num_layers, 1, 1, 8, 40)
    assert kv_page_bytes(mc, 1, 8) == kv[0].numel() * 4
    expanded = mc.num_layers * mc.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * 4
    assert pool.bytes_per_token(mc.num_layers, 4) * 4 == expanded  # 40 values a layer against 4 x (24 + 16)


def test_a_tp_plan_copies_the_replicated_latent_from_one_rank():
    lay = lambda ranks: Layout(3, 8, 40, 4, ((0, 1),) * ranks, 0, 1, "latent")  # noqa: E731
    page = 3 * 8 * 40 * 4
    assert lay(2).page_bytes(1) == page and lay(2).canonical() == lay(1)
    plan = make_plan(lay(2), lay(1))  # two ranks' identical copies: one is read
    assert [(g.src_rank, g.dst_rank, g.length) for g in plan] == [(0, 0, page)]
    plan = make_plan(lay(1), lay(2))  # every destination rank gets the whole latent
    assert [(g.src_rank, g.dst_rank, g.length) for g in plan] == [(0, 0, page), (0, 1, page)]
    gqa = Layout(3, 8, 40, 4, ((0, 1),), 0)
    with pytest.raises(ValueError, match="page shape"):
        make_plan(gqa, lay(1))


def test_tp2_shards_the_heads_and_replicates_the_latent(tiny_mla):
    """Query/output heads and kv_b_proj split over 2 ranks, each rank's latent pool the same bytes as the other's."""
    ps = prompts_of([40, 70], 1000, seed=8)
    expected = hf_greedy(tiny_mla, ps, GREEDY.max_tokens)
    llm = LLM(str(tiny_mla), page_size=8, num_pages=64, tp=2)
    try:
        assert [c.token_ids for c in llm.generate(ps, GREEDY)] == expected
        pools = llm.engine.pools
        assert pools[0].shape == pools[1].shape and pools[0].shape[2:4] == (1, 1)
        assert torch.equal(pools[0], pools[1])
    finally:
        llm.engine.close()


def test_latent_pages_come_back_from_the_host_tier(tiny_mla):
    """Evicted latent pages stored in L2 and loaded back on a revisit: the same output as a pool that kept them."""
    g = torch.Generator().manual_seed(0)
    hist = [torch.randint(5, 1000, (96,), generator=g).tolist() for _ in range(3)]
    turns = [h + [7, 7] for h in hist] + [h + [9] for h in hist]

    def run(**kw):
        llm = LLM(str(tiny_mla), page_size=8, max_batch=1, **kw)
        outs = [llm.generate([p], GREEDY)[0].token_ids for p in turns]
        llm.engine.check_integrity()
        return outs, llm.engine

    big, _ = run(num_pages=256)
    tiered, e = run(num_pages=16, host_cache_gb=0.01)  # holds one history (13 pages), not three
    assert tiered == big
    assert e.stats.loaded_tokens >= 3 * 88
    host = e.state().tiers.host
    assert host.loaded > 0 and host.stored > 0


def test_manifest_names_the_pool_and_a_mismatch_names_its_field(tiny_mla, tiny_qwen3):
    def layout(model) -> Layout:
        llm = LLM(str(model), page_size=8, num_pages=4, prefix_cache=False)
        return llm.engine.layout

    mla, gqa = pool_spec(layout(tiny_mla), "float32"), pool_spec(layout(tiny_qwen3), "float32")
    assert (mla.kind, mla.layout, mla.bytes_per_token) == ("latent", [3, 1, 1, 8, 40], 3 * 40 * 4)
    assert (gqa.kind, gqa.layout) == ("gqa", [2, 2, 2, 8, 16])
    base = wire.Manifest(role="prefill", model_name="m", model_fingerprint="f", dtype="float32", num_layers=3,
                         num_kv_heads=4, head_dim=8, page_size=8, point="8k", max_context=8192, max_batch=8, tp=1,
                         rank_heads=[(0, 1)], page_bytes=3 * 40 * 8 * 4, pools=[mla])
    assert wire.mismatch(base, msgspec.structs.replace(base, role="decode")) is None
    wider = msgspec.structs.replace(mla, layout=[3, 1, 1, 8, 48], bytes_per_token=3 * 48 * 4)
    assert wire.mismatch(base, msgspec.structs.replace(base, role="decode", pools=[wider])) == \
        "pools[latent].layout: prefill has [3, 1, 1, 8, 40], decode has [3, 1, 1, 8, 48]"
    assert wire.mismatch(base, msgspec.structs.replace(base, role="decode", pools=[gqa])) == \
        "pools: prefill has ['latent'], decode has ['gqa']"


def test_fp8_latent_rows_round_trip_within_the_format():
    """kernels/fp8.py write_parts / gather_parts on a latent pool: one scale per (page, layer) block, every value
    within e4m3's step of its block's largest, a page's earlier rows rescaled when a larger one arrives."""
    from trnd_kernels import fp8

    kv = torch.zeros(3, 2, 1, 1, 8 * 40 + fp8.SCALE_BYTES, dtype=torch.float8_e4m3fn)
    rows = torch.randn(20, 40)
    rows[12] *= 30  # page 1's second half: its block's scale grows after its first rows were written
    pages, slots = torch.arange(20) // 8, torch.arange(20) % 8
    for lo, hi in ((0, 10), (10, 20)):
        fp8.write_parts(kv, 1, rows[lo:hi, None, None, :], pages[lo:hi], slots[lo:hi])
    back = fp8.gather_parts(kv, 1, torch.arange(3), 40, torch.float32)[:, 0, 0].reshape(-1, 40)[:20]
    for p in range(3):
        block = slice(8 * p, min(8 * p + 8, 20))
        assert (back[block] - rows[block]).abs().max() <= rows[block].abs().max() / 8
    assert not fp8.gather_parts(kv, 0, torch.arange(3), 40, torch.float32).any()  # the other layer untouched


def test_fp8_latent_pages_serve_and_come_back_from_the_host_tier(tiny_mla):
    """kv_cache_dtype fp8_e4m3 on the latent pool: pages of values + one scale per layer, logits near the fp32
    pool's (trnd bench kv-accuracy's harness, teacher-forced; measured: max 1.22, mean 0.104, top-1 0.89, where
    tiny's GQA pool gives 0.60, 0.070, 0.94); evicted to L2 and loaded back, the output is the one a pool that
    kept them gives."""
    from trnd.bench.kv_accuracy import measure

    mc = ModelConfig.from_dir(tiny_mla, "float32")
    llm = LLM(str(tiny_mla), page_size=8, num_pages=64, kv_cache_dtype="fp8_e4m3")
    assert llm.engine.runner.page_bytes == mc.num_layers * (8 * 40 + 4)
    g = torch.Generator().manual_seed(0)
    r = measure(str(tiny_mla), [torch.randint(3, 500, (n,), generator=g).tolist() for n in (20, 37, 50, 64)], 16,
                formats=("auto", "fp8_e4m3"), hf=False)["fp8_e4m3"]
    assert 0 < r["max_abs"] < 2.5 and r["mean_abs"] < 0.2 and r["top1"] >= 0.8
    hist = prompts_of([96, 96], 1000, seed=7)
    turns = [h + [7] for h in hist] + [h + [9] for h in hist]

    def run(**kw):
        e = LLM(str(tiny_mla), page_size=8, max_batch=1, kv_cache_dtype="fp8_e4m3", **kw)
        return [e.generate([t], GREEDY)[0].token_ids for t in turns], e.engine

    big, _ = run(num_pages=128)
    tiered, e = run(num_pages=16, host_cache_gb=0.01)
    assert tiered == big and e.stats.loaded_tokens >= 2 * 88


@pytest.mark.parametrize("arch", ["Qwen3NextForCausalLM"])
def test_an_unserved_attention_kind_is_one_line_at_start(tiny_qwen3, tmp_path, arch):
    model = tmp_path / "next"
    shutil.copytree(tiny_qwen3, model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(cfg | {"architectures": [arch]}))
    out = subprocess.run([sys.executable, "-m", "trnd", "serve", "--aggregated", "--model", str(model)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 78 and "Traceback" not in out.stderr
    lines = [ln for ln in out.stderr.splitlines() if "model error" in ln]
    assert len(lines) == 1 and arch in lines[0] and "linear attention" in lines[0], out.stderr


@pytest.mark.slow
def test_latent_pages_cross_the_pd_handoff_byte_for_byte(tiny_mla, tmp_path):
    """trnd prefill + trnd decode on loopback: the latent pages go over NIXL, decode checks the digest of what
    landed against prefill's, and the text is the aggregated engine's."""
    secret = tmp_path / "secret"
    secret.write_text("test-secret-0123456789")
    ps = prompts([9, 300], seed=4)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = aggregated(tiny_mla, ps, params)
    d = Deployment(tiny_mla, secret)
    try:
        got = [d.complete(p, max_tokens=8) for p in ps]
        assert [g["choices"][0]["text"] for g in got] == expected
        r = httpx.get(f"http://127.0.0.1:{d.port}/admin/requests/{got[1]['id']}", timeout=10).json()
        trail = [p["what"] for t in r["traces"] for p in t["phases"]]
        assert any(w.startswith("KV digest verified") for w in trail), trail
        st = admin_state(d.port)
        assert st["transfers"]["digest_failures"] == 0 and st["transfers"]["kv_pages_received"] > 0
        assert wait_for(d.baseline_ok)
    finally:
        d.close()


@pytest.mark.slow
def test_latent_pages_cross_an_l3_store_from_tp2_to_tp1(tiny_mla, tmp_path):
    """A tp=2 engine writes a conversation's latent pages to a real `trnd store` (one canonical copy of the
    replicated latent); a cold tp=1 engine loads them for the next turn and decodes what transformers does."""
    secret = tmp_path / "secret"
    secret.write_text("l3-secret-0123456789")
    store, cp, _ = start_store(secret)
    kw = dict(page_size=8, num_pages=128, store=[f"127.0.0.1:{cp}"], store_secret=secret.read_bytes().strip())

    def connected(llm) -> bool:
        return wait_for(lambda: all(s["connected"] for s in llm.engine.tiers.remote.state()["stores"]), timeout=20)

    history = prompts_of([96], 1000, seed=11)[0]
    a = LLM(str(tiny_mla), tp=2, **kw)
    try:
        assert connected(a)
        first = a.generate([history], GREEDY)[0]
        written = lambda: (a.engine.tiers.poll(), a.engine.tiers.remote_written)[1]  # noqa: E731
        assert wait_for(lambda: written() >= 12, timeout=30)  # the 13 pages' full ones, when turn 1 finished
    finally:
        a.engine.close()
    turn = history + first.token_ids + [5, 6, 7]
    expected = hf_greedy(tiny_mla, [turn], GREEDY.max_tokens)[0]
    b = LLM(str(tiny_mla), **kw)
    try:
        assert connected(b)
        got = b.generate([turn], GREEDY)[0]
        assert got.token_ids == expected
        assert b.engine.stats.loaded_tokens >= 96
    finally:
        b.engine.close()
        stop(store)
