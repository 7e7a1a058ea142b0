"""FP8 KV pages (kernels/fp8.py): values + per-(page, layer, k|v, head) scales inside each page; the pool
holds ~2x the tokens at a budget; accuracy against model-dtype KV (transformers the oracle) is bounded;
L2 and L3 return fp8 pages byte-identically (checksums cover the scales); the kv_cache_dtype is part of
the page-hash namespace and the store's key space."""

from __future__ import annotations

import hashlib
import uuid

import pytest
import torch

from trnd_kernels import fp8
from trnd_kernels.attention import AttnMeta, _gather, write_kv
from trnd.cache.host import HostTier
from trnd.engine.request import SamplingParams
from trnd.llm import LLM
from trnd.transfer.plan import Layout, make_plan

FORMATS = list(fp8.FORMATS)


def pool(fmt, n=8, L=2, hk=2, P=8, D=16):
    dt = fp8.FORMATS[fmt] if fmt != "auto" else torch.float32
    shape = (n, L, 2, hk, P * D + fp8.SCALE_BYTES) if fmt != "auto" else (n, L, 2, hk, P, D)
    return torch.zeros(shape, dtype=dt)


def meta(pages, offsets):
    return AttnMeta(torch.tensor(pages), torch.tensor(offsets), 0, None, None, [])


@pytest.mark.parametrize("fmt", FORMATS)
def test_write_then_read_is_within_the_format_precision(fmt):
    g = torch.Generator().manual_seed(0)
    kv, ref = pool(fmt), pool("auto")
    k, v = torch.randn(20, 2, 16, generator=g), torch.randn(20, 2, 16, generator=g)
    pages, offs = [3] * 8 + [5] * 8 + [1] * 4, list(range(8)) * 2 + list(range(4))
    # two writes; the second continues page 5 mid-way with values 4x larger: its scale grows and the
    # block's earlier slots are requantized to it
    for sl, mul in ((slice(0, 10), 1.0), (slice(10, 20), 4.0)):
        for dst in (kv, ref):
            write_kv(dst, 1, k[sl] * mul, v[sl] * mul, meta(pages[sl], offs[sl]))
    q = torch.zeros(1, 16)
    got, want = _gather(kv, 1, torch.tensor([3, 5, 1]), q), _gather(ref, 1, torch.tensor([3, 5, 1]), q)
    rel = 2.0 ** -3 if fmt == "fp8_e4m3" else 2.0 ** -2  # half an ulp of 3 / 2 mantissa bits, on the block max
    for a, b in zip(got, want):
        err = (a - b).abs().amax(-1)  # [Hk, 20 tokens]
        block_max = b.unflatten(1, (3, 8)).abs().amax((-1, -2))  # [Hk, 3 pages]
        assert (err.unflatten(1, (3, 8)) <= block_max[..., None] * rel * 1.01 + 1e-6).all()
    _, scales = fp8.split(kv, 16)
    fmax = torch.finfo(kv.dtype).max
    kv_in = torch.stack((k, v), 1).abs()
    amax5 = torch.maximum(kv_in[8:10].amax((0, -1)), kv_in[10:16].amax((0, -1)) * 4)  # page 5: both writes
    torch.testing.assert_close(scales[5, 1], amax5 / fmax)
    assert (scales[:, 0] == 0).all() and (scales[[0, 2, 4, 6, 7], 1] == 0).all()  # other layers/pages untouched


def test_a_write_at_slot_0_starts_the_block_afresh():
    """A recycled page's old scale (and values) must not leak into its new owner's KV."""
    kv = pool("fp8_e4m3")
    write_kv(kv, 0, torch.full((8, 2, 16), 100.0), torch.full((8, 2, 16), 100.0), meta([2] * 8, list(range(8))))
    write_kv(kv, 0, torch.full((1, 2, 16), 0.5), torch.full((1, 2, 16), 0.5), meta([2], [0]))
    _, scales = fp8.split(kv, 16)
    assert torch.allclose(scales[2, 0], torch.tensor(0.5 / 448))
    k, _ = _gather(kv, 0, torch.tensor([2]), torch.zeros(1, 16))
    assert (k[:, 0] == 0.5).all() and (k[:, 1:] == 0).all()


def test_the_scales_are_inside_the_page_bytes():
    kv = pool("fp8_e4m3")
    before = kv[4].view(torch.uint8).clone()
    write_kv(kv, 1, torch.ones(1, 2, 16), torch.ones(1, 2, 16), meta([4], [0]))
    changed = (kv.view(torch.uint8) != torch.cat([kv.view(torch.uint8)[:4], before[None],
                                                  kv.view(torch.uint8)[5:]])).nonzero()
    assert set(changed[:, 0].tolist()) == {4}  # one page changed: its values and its scales
    row = kv[4, 1, 0, 0].view(torch.uint8)
    assert row[-4:].view(torch.float32).item() == pytest.approx(1 / 448)


def test_plan_moves_each_heads_scale_with_its_values():
    """TP=2 -> TP=1: a head's block (values + scale) lands whole in the canonical page."""
    src = Layout(2, 8, 16, 1, ((0, 1), (1, 2)), 4)
    dst = Layout(2, 8, 16, 1, ((0, 2),), 4)
    plan = make_plan(src, dst)
    assert sum(s.length for s in plan) == dst.page_bytes(0) == 2 * 2 * 2 * (8 * 16 + 4)
    pools = [pool("fp8_e4m3", hk=1), pool("fp8_e4m3", hk=1)]
    for r, p in enumerate(pools):
        write_kv(p, 0, torch.randn(8, 1, 16) * (r + 1), torch.randn(8, 1, 16), meta([1] * 8, list(range(8))))
    whole = torch.zeros(dst.page_bytes(0), dtype=torch.uint8)
    for s in plan:
        row = pools[s.src_rank][1].view(torch.uint8).flatten()
        whole[s.dst_off:s.dst_off + s.length] = row[s.src_off:s.src_off + s.length]
    assert torch.equal(whole.view(torch.float8_e4m3fn).view(2, 2, 2, -1).view(torch.uint8),
                       torch.cat([p[1] for p in pools], dim=2).view(torch.uint8))


def test_pool_holds_twice_the_tokens_at_the_same_budget(tiny_qwen3):
    auto = LLM(str(tiny_qwen3), kv_memory_gb=0.01, dtype="bfloat16").engine
    f8 = LLM(str(tiny_qwen3), kv_memory_gb=0.01, dtype="bfloat16", kv_cache_dtype="fp8_e4m3").engine
    a, b = auto.state().pages, f8.state().pages
    mc = f8.model_config
    assert b.page_bytes == mc.num_layers * 2 * mc.num_kv_heads * (16 * mc.head_dim + 4)
    assert a.page_bytes == 2 * mc.num_layers * 2 * mc.num_kv_heads * 16 * mc.head_dim
    assert b.kv_dtype == "float8_e4m3fn" and a.kv_dtype == "bfloat16"
    assert 1.9 < b.token_capacity / a.token_capacity <= 2.0
    assert f8.namespace != auto.namespace and f8.namespace.endswith("kv=fp8_e4m3")


def test_logit_difference_against_model_dtype_kv_is_bounded(tiny_qwen3):
    """The fixed case: 4 prompts x 16 tokens, teacher-forced through prefill + decode steps (the bench's
    harness; docs/RESULTS.md has 32 x 64 on tiny and small). Measured: e4m3 max 0.60, mean 0.069."""
    pytest.importorskip("transformers")
    from trnd.bench.kv_accuracy import measure

    g = torch.Generator().manual_seed(0)
    ps = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (20, 37, 50, 64)]
    r = measure(str(tiny_qwen3), ps, 16, formats=("auto", "fp8_e4m3"))
    assert r["auto"]["vs_hf_max"] < 1e-3  # the model-dtype side is transformers'
    e4 = r["fp8_e4m3"]
    assert 0 < e4["max_abs"] < 1.5 and e4["mean_abs"] < 0.15 and e4["top1"] >= 0.85


GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def checksums(engine, pages) -> list[bytes]:
    rows = engine.pools[0].view(torch.uint8).view(engine.pools[0].shape[0], -1)
    return [hashlib.blake2b(rows[p].numpy().tobytes(), digest_size=16).digest() for p in pages]


def test_host_tier_round_trips_fp8_pages_byte_identically(tiny_qwen3):
    llm = LLM(str(tiny_qwen3), page_size=8, num_pages=64, kv_cache_dtype="fp8_e4m3")
    e = llm.engine
    prompt = torch.randint(5, 1000, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    llm.generate([prompt], GREEDY)
    pages = sorted(e.radix.all_pages())[:4]
    want = checksums(e, pages)
    assert all(e.pools[0][p].view(torch.uint8)[..., -4:].any() for p in pages)  # scales are set
    host = HostTier(e.pools, 8)
    hs = [uuid.uuid4().bytes for _ in pages]
    assert host.put(hs, pages) == 4
    dst = [60, 61, 62, 63]
    assert host.load(hs, dst).result(10) == 4
    assert checksums(e, dst) == want
    host.close()


def test_host_tier_serves_fp8_evictions_token_identically(tiny_qwen3):
    g = torch.Generator().manual_seed(0)
    hist = [torch.randint(5, 1000, (160,), generator=g).tolist() for _ in range(4)]
    prompts = [h + [7, 7, 7] for h in hist] + [h + [9, 9] for h in hist]

    def run(**kw):
        llm = LLM(str(tiny_qwen3), page_size=8, max_batch=1, kv_cache_dtype="fp8_e4m3", **kw)
        return [llm.generate([p], GREEDY)[0].token_ids for p in prompts], llm.engine

    big, _ = run(num_pages=512)
    tiered, e = run(num_pages=24, host_cache_gb=0.01)
    assert tiered == big
    assert e.stats.loaded_tokens >= 4 * 160 - 4 * 8
    assert e.state().tiers.host.page_bytes == e.runner.page_bytes


def test_store_round_trips_fp8_pages_across_tp_layouts(tmp_path):
    """L3: a TP=2 client writes fp8 pages (scales and all), a TP=1 client reads them: equal canonical bytes,
    and the store sizes its slots by the fp8 page."""
    from trnd.store.client import StoreClient
    from trnd.transfer.nixl import KVAgent

    from tests.launch import wait_for
    from tests.procs.test_store import StoreProc

    secret = tmp_path / "secret"
    secret.write_text("fp8-store-secret-0123456789")
    store = StoreProc(secret).wait()
    L, H, P, D = 2, 2, 8, 16
    clients = []
    try:
        for tp in (2, 1):
            pools = [pool("fp8_e4m3", n=16, L=L, hk=H // tp, P=P, D=D) for _ in range(tp)]
            agent = KVAgent(f"fp8-{tp}-{uuid.uuid4().hex[:6]}", pools)
            lay = Layout(L, P, D, 1, tuple((r * H // tp, (r + 1) * H // tp) for r in range(tp)), fp8.SCALE_BYTES)
            c = StoreClient([store.addr], secret.read_bytes().strip(), agent, lay, pools, "fp8-test",
                            dtype="float8_e4m3fn", deadline_s=5.0)
            clients.append((pools, agent, c))
        for _, _, c in clients:
            assert wait_for(lambda: c.state()["stores"][0]["connected"], 20)
        (pa, _, a), (pb, _, b) = clients
        for r, p in enumerate(pa):
            for page in (2, 3, 4):
                write_kv(p, 0, torch.randn(8, 1, D) * (page + r), torch.randn(8, 1, D), meta([page] * 8, list(range(8))))
                write_kv(p, 1, torch.randn(8, 1, D), torch.randn(8, 1, D) * 3, meta([page] * 8, list(range(8))))
        hs = [hashlib.sha256(bytes([i])).digest() for i in range(3)]
        assert a.write(hs, [2, 3, 4]).result(20) == 3
        assert b.read(hs, [10, 11, 12]).result(20) == 3
        for src, dst in zip((2, 3, 4), (10, 11, 12)):
            want = torch.cat([p[src] for p in pa], dim=2).view(torch.uint8)
            assert torch.equal(pb[0][dst].view(torch.uint8), want)
        st = store.state()
        assert st["slot_bytes"] == L * 2 * H * (P * D + 4)
    finally:
        for _, agent, c in clients:
            c.close()
            agent.close()
        store.close()


# -- disaggregated roles: the manifest carries kv_cache_dtype -------------------------------------------

@pytest.fixture(scope="module")
def secret(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp8") / "control_secret"
    path.write_text("fp8-test-secret-0123456789")
    return path


def test_fp8_pair_hands_off_fp8_pages_and_matches_aggregated(tiny_qwen3, secret):
    from tests.launch import admin_state, wait_for
    from tests.procs.test_disagg import Deployment, prompts

    flag = ("--kv-cache-dtype", "fp8_e4m3")
    d = Deployment(tiny_qwen3, secret, decode_extra=flag, prefill_extra=flag)
    try:
        ps = prompts([7, 300, 700])
        got = [d.complete(p, max_tokens=8) for p in ps]
        assert all(r["status"] == 200 for r in got)
        llm = LLM(str(tiny_qwen3), page_size=16, num_pages=1024, kv_cache_dtype="fp8_e4m3")
        want = [c.text for c in llm.generate(ps, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))]
        assert [r["choices"][0]["text"] for r in got] == want
        mc = llm.engine.model_config
        fp8_page = mc.num_layers * 2 * mc.num_kv_heads * (16 * mc.head_dim + 4)
        dec, pre = admin_state(d.port), admin_state(d.prefills[0][2])
        assert dec["pages"]["page_bytes"] == pre["pages"]["page_bytes"] == fp8_page
        assert dec["pages"]["kv_dtype"] == "float8_e4m3fn"
        t = dec["transfers"]
        assert t["kv_pages_received"] >= sum(-(-len(p) // 16) for p in ps) - 1
        assert t["kv_bytes_received"] == t["kv_pages_received"] * fp8_page
        # prefill wrote whole fp8 pages: its bytes are a multiple of the fp8 page, half a bf16 page's each
        assert pre["transfers"]["bytes"] > 0 and pre["transfers"]["bytes"] % fp8_page == 0
        assert fp8_page / (2 * mc.num_layers * 2 * mc.num_kv_heads * 16 * mc.head_dim) < 0.51
        assert wait_for(d.baseline_ok)
    finally:
        d.close()


def test_mismatched_kv_cache_dtype_is_refused_at_the_handshake(tiny_qwen3, secret):
    from tests.launch import admin_state, free_port, start_role, stop, wait_for, wait_ready

    cp, ap, port = free_port(), free_port(), free_port()
    pre = start_role("prefill", tiny_qwen3, secret, "--kv-cache-dtype", "fp8_e4m3", "--kv-memory-gb", "0.1",
                     control_port=cp, admin_port=ap)
    dec = start_role("decode", tiny_qwen3, secret, "--kv-memory-gb", "0.1", "--prefill", f"127.0.0.1:{cp}",
                     port=port)
    try:
        wait_ready(ap, pre)
        wait_ready(port, dec, path="/health")
        assert wait_for(lambda: admin_state(port)["peers"][0]["refused"], timeout=20)
        refused = admin_state(port)["peers"][0]["refused"]
        assert "kv_cache_dtype" in refused and "'fp8_e4m3'" in refused and "'auto'" in refused
    finally:
        out = stop(dec) + stop(pre)
    assert "kv_cache_dtype" in out


@pytest.mark.slow
def test_serve_fp8_on_the_default_model_serves_the_openai_client():
    """`trnd serve --kv-cache-dtype fp8_e4m3` (the local prefill + decode pair) on the default model."""
    import openai

    from tests.launch import admin_state, start_serve, stop, wait_ready

    proc, port = start_serve("small", "--kv-cache-dtype", "fp8_e4m3", "--kv-memory-gb", "0.5",
                             "--local-prefill-tokens", "0")  # the fp8 pages cross to decode, short prompts too
    try:
        wait_ready(port, proc, timeout=600)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        model = client.models.list().data[0].id
        r = client.completions.create(model=model, prompt="The KV cache in fp8 is", max_tokens=8, temperature=0)
        assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens >= 1
        chunks = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=6, stream=True))
        assert any(c.choices and c.choices[0].delta.content for c in chunks)
        st = admin_state(port)
        assert st["pages"]["kv_dtype"] == "float8_e4m3fn" and st["transfers"]["kv_bytes_received"] > 0
        assert st["transfers"]["kv_bytes_received"] == st["transfers"]["kv_pages_received"] * st["pages"]["page_bytes"]
    finally:
        stop(proc)


def test_a_bad_kv_cache_dtype_is_one_line_naming_the_field():
    from trnd.config import ConfigError, PrefillConfig, ServeConfig, load_config

    for cls in (ServeConfig, PrefillConfig):
        with pytest.raises(ConfigError, match=r"kv_cache_dtype = 'fp8' is not one of auto, fp8_e4m3, fp8_e5m2"):
            load_config(cls, None, {"kv_cache_dtype": "fp8"})
    assert load_config(ServeConfig, None, {"kv_cache_dtype": "fp8_e5m2"}).engine.kv_cache_dtype == "fp8_e5m2"
