"""Greedy generation is token-identical to transformers (the oracle) on the same checkpoint, in fp32."""

from __future__ import annotations

import pytest
import torch

from trnd.engine.request import SamplingParams
from trnd.llm import LLM

transformers = pytest.importorskip("transformers")


def hf_greedy(model_dir, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    outs = []
    for p in prompts:
        with torch.no_grad():
            g = ref.generate(torch.tensor([p]), max_new_tokens=max_new, do_sample=False, eos_token_id=None,
                             pad_token_id=0, min_new_tokens=max_new)
        outs.append(g[0, len(p):].tolist())
    return outs


def prompts_of(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab - 1, (n,), generator=g).tolist() for n in lengths]


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def assert_batch_matches_transformers(model_dir, prompts: list[list[int]], params: SamplingParams) -> None:
    """The prompts in one batch through a small paged engine (8-token pages, 24-token chunks: several pages and
    chunks a prompt) give the oracle's greedy tokens, and no page stays held after."""
    expected = hf_greedy(model_dir, prompts, params.max_tokens)
    llm = LLM(str(model_dir), page_size=8, num_pages=128, chunk_size=24, token_budget=64)
    assert [c.token_ids for c in llm.generate(prompts, params)] == expected
    assert llm.engine.check_integrity()["in_use"] == 0


@pytest.fixture(scope="module")
def oracle(tiny_model):
    cache = {}

    def get(lengths, seed=0, max_new=12):
        key = (tuple(lengths), seed, max_new)
        if key not in cache:
            vocab = transformers.AutoConfig.from_pretrained(tiny_model).vocab_size
            ps = prompts_of(lengths, vocab, seed)
            cache[key] = (ps, hf_greedy(tiny_model, ps, max_new))
        return cache[key]

    return get


@pytest.mark.parametrize("chunk", [512, 7, 16, 33])
def test_batch_of_mixed_lengths_matches_transformers(tiny_model, oracle, chunk):
    prompts, expected = oracle([5, 40, 17, 64, 1, 100])
    llm = LLM(str(tiny_model), page_size=8, num_pages=256, chunk_size=chunk, token_budget=max(chunk, 64))
    got = llm.generate(prompts, GREEDY)
    assert [c.token_ids for c in got] == expected
    assert llm.engine.check_integrity()["in_use"] == 0


def test_single_prompt_matches_transformers(tiny_model, oracle):
    prompts, expected = oracle([23])
    llm = LLM(str(tiny_model), page_size=16, num_pages=64)
    assert llm.generate(prompts, GREEDY)[0].token_ids == expected[0]


def test_prefix_cache_hits_keep_outputs_identical(tiny_model, oracle):
    base = prompts_of([48], 200, seed=3)[0]
    prompts = [base + [7, 8, 9], base + [10, 11], base[:40]]
    vocab = transformers.AutoConfig.from_pretrained(tiny_model).vocab_size
    assert max(max(p) for p in prompts) < vocab
    expected = hf_greedy(tiny_model, prompts, 12)
    llm = LLM(str(tiny_model), page_size=8, num_pages=256)
    first = llm.generate([prompts[0]], GREEDY)[0]
    assert first.cached_tokens == 0
    rest = llm.generate(prompts[1:], GREEDY)
    assert [first.token_ids] + [c.token_ids for c in rest] == expected
    assert rest[0].cached_tokens == 48  # the whole shared 48-token prefix, in whole pages
    assert rest[1].cached_tokens == 32  # 39 of 40 tokens may match: 4 whole pages
    assert llm.engine.radix.stats()["hit_tokens"] >= 80


def test_preemption_recomputes_to_identical_output(tiny_model, oracle):
    prompts, expected = oracle([30, 31, 29, 33], seed=5, max_new=24)
    # 4 requests x (30 + 24 tokens) need ~28 pages of 8; give 16 so decode growth forces preemption.
    llm = LLM(str(tiny_model), page_size=8, num_pages=16, max_batch=4)
    got = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert [c.token_ids for c in got] == expected
    assert llm.engine.stats.preemptions > 0
    assert llm.engine.check_integrity()["in_use"] == 0


def test_logits_match_transformers_within_tolerance(tiny_model):
    from trnd_kernels.attention import AttnMeta, PrefillSeq
    from trnd.model.loader import load_model

    model, cfg = load_model(tiny_model, "float32")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    ids = torch.tensor(prompts_of([50], cfg.vocab_size, seed=9)[0])
    p = 8
    kv = torch.zeros(8, cfg.num_layers, 2, cfg.num_kv_heads, p, cfg.head_dim)
    pos = torch.arange(len(ids))
    meta = AttnMeta(pos // p, pos % p, 0, None, None, [PrefillSeq(0, len(ids), len(ids), torch.arange(7))])
    ours = model(ids, pos, kv, meta, pos)
    with torch.no_grad():
        theirs = ref(ids[None]).logits[0]
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4), (ours - theirs).abs().max()


def test_last_layer_runs_only_the_sampled_rows(tiny_model):
    """Two prompts prefilled in one step, one finishing (its last row sampled), one a first chunk (no row
    sampled): the last layer attends and runs its MLP for the one sampled row only, every row's K/V still goes
    into the pool, and that row's logits are transformers' (the K/V the next chunk reads, too: the second
    prompt's next chunk is checked against transformers as well)."""
    from trnd_kernels.attention import AttnMeta, PrefillSeq
    from trnd.model.loader import load_model

    model, cfg = load_model(tiny_model, "float32")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    a, b = (torch.tensor(x) for x in prompts_of([21, 30], cfg.vocab_size, seed=4))
    p, first = 8, 19  # b's first chunk: 19 of its 30 tokens, ending mid-page
    kv = torch.zeros(16, cfg.num_layers, 2, cfg.num_kv_heads, p, cfg.head_dim)
    pa, pb = torch.arange(len(a)), torch.arange(len(b))
    pages_a, pages_b = torch.arange(0, 3), torch.arange(3, 7)  # a: 3 pages, b: 4
    rows = []
    hook = model.layers[-1].mlp.register_forward_hook(lambda mod, inp, out: rows.append(inp[0].shape[0]))
    first_hook = model.layers[0].mlp.register_forward_hook(lambda mod, inp, out: rows.append(inp[0].shape[0]))
    try:
        ids = torch.cat([a, b[:first]])
        pos = torch.cat([pa, pb[:first]])
        pages = torch.cat([pages_a[pa // p], pages_b[pb[:first] // p]])
        meta = AttnMeta(pages, pos % p, 0, None, None,
                        [PrefillSeq(0, len(a), len(a), pages_a), PrefillSeq(len(a), first, first, pages_b[:3])])
        ours_a = model(ids, pos, kv, meta, torch.tensor([len(a) - 1]))
        assert rows == [len(a) + first, 1]  # first layer: every row; last layer: the sampled one
        rows.clear()
        rest = pb[first:]  # b's second chunk reads its first chunk's K/V from the pages, last layer's included
        meta = AttnMeta(pages_b[rest // p], rest % p, 0, None, None, [PrefillSeq(0, len(rest), len(b), pages_b)])
        ours_b = model(b[first:], rest, kv, meta, torch.tensor([len(rest) - 1]))
        assert rows == [len(rest), 1]
    finally:
        hook.remove()
        first_hook.remove()
    with torch.no_grad():
        theirs_a, theirs_b = ref(a[None]).logits[0, -1], ref(b[None]).logits[0, -1]
    assert torch.allclose(ours_a[0], theirs_a, atol=1e-4, rtol=1e-4), (ours_a[0] - theirs_a).abs().max()
    assert torch.allclose(ours_b[0], theirs_b, atol=1e-4, rtol=1e-4), (ours_b[0] - theirs_b).abs().max()
