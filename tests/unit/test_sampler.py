import math

import numpy as np
import pytest
import torch

from trnd_kernels import sampling as K
from trnd.engine.request import Req, SamplingParams
from trnd.engine.sampler import Sampler, SampleOut

EOS = 2


def req(prompt=(5, 6, 7), output=(), **params) -> Req:
    r = Req(list(prompt), SamplingParams(**params))
    r.output_ids = list(output)
    return r


def rand_logits(b, v, seed=0):
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * 3


# ---- kernels against per-row NumPy ----------------------------------------------------------------

def test_token_counts():
    ids = [[1, 1, 3], [], [0, 9, 9, 9, 42]]  # 42 is out of range: dropped
    got = K.token_counts(ids, 10).numpy()
    want = np.zeros((3, 10), np.int32)
    for i, row in enumerate(ids):
        for t in row:
            if t < 10:
                want[i, t] += 1
    np.testing.assert_array_equal(got, want)


def test_apply_penalties_matches_numpy():
    g = np.random.default_rng(0)
    B, V = 6, 50
    logits = g.normal(size=(B, V)).astype(np.float32) * 3
    prompts = [list(g.integers(0, V, size=g.integers(1, 20))) for _ in range(B)]
    outputs = [list(g.integers(0, V, size=g.integers(0, 20))) for _ in range(B)]
    pres, freq, rep = g.uniform(-1, 2, B), g.uniform(-1, 2, B), g.uniform(0.5, 2, B)
    got = K.apply_penalties(torch.tensor(logits), K.token_counts(prompts, V) > 0, K.token_counts(outputs, V),
                            torch.tensor(pres), torch.tensor(freq), torch.tensor(rep)).numpy()
    for b in range(B):
        row = logits[b].astype(np.float64)
        for t in set(prompts[b]) | set(outputs[b]):
            row[t] = row[t] / rep[b] if row[t] > 0 else row[t] * rep[b]
        for t in set(outputs[b]):
            row[t] -= freq[b] * outputs[b].count(t) + pres[b]
        np.testing.assert_allclose(got[b], row, rtol=1e-5, atol=1e-5)


def test_apply_temperature():
    x = rand_logits(3, 7)
    t = torch.tensor([0.5, 1.0, 2.0])
    got = K.apply_temperature(x, t)
    for b in range(3):
        torch.testing.assert_close(got[b], x[b] / t[b])


def np_filter(row, k, p, mp):
    """Per-row reference: top_k, then top_p on the renormalized survivors, then min_p."""
    row = row.astype(np.float64)
    order = np.argsort(-row, kind="stable")
    keep = np.zeros(len(row), bool)
    n = len(row) if k <= 0 else min(k, len(row))
    keep[order[:n]] = True
    if p < 1.0:
        probs = np.exp(row[order[:n]] - row[order[0]])
        probs /= probs.sum()
        mass = 0.0
        for j in range(n):
            if j > 0 and mass >= p:
                keep[order[j]] = False
            mass += probs[j]
    if mp > 0:
        probs = np.exp(row - row.max())
        keep &= probs >= mp * probs.max() * (1 - 1e-6)
    return keep


@pytest.mark.parametrize("seed", range(5))
def test_top_k_top_p_min_p_matches_numpy(seed):
    g = np.random.default_rng(seed)
    B, V = 8, 40
    logits = (g.normal(size=(B, V)) * 2).astype(np.float32)
    top_k = np.array([-1, 0, 1, 5, 40, 3, -1, 7])
    top_p = np.array([1.0, 0.5, 1.0, 0.9, 0.3, 1.0, 0.05, 0.8])
    min_p = np.array([0.0, 0.0, 0.0, 0.1, 0.0, 0.5, 0.0, 0.2])
    got = K.top_k_top_p_min_p_mask(torch.tensor(logits), torch.tensor(top_k), torch.tensor(top_p),
                                   torch.tensor(min_p, dtype=torch.float32)).numpy()
    for b in range(B):
        keep = np_filter(logits[b], top_k[b], top_p[b], min_p[b])
        np.testing.assert_array_equal(np.isfinite(got[b]), keep, err_msg=f"row {b}")
        np.testing.assert_array_equal(got[b][keep], logits[b][keep])


def test_top_k_partial_path_matches_numpy():
    """Every row has top_k > 0: only the top max(k) are sorted; everything else must be dropped."""
    g = np.random.default_rng(9)
    B, V = 6, 50
    logits = (g.normal(size=(B, V)) * 2).astype(np.float32)
    top_k = np.array([1, 3, 10, 10, 4, 2])
    top_p = np.array([1.0, 1.0, 0.6, 1.0, 0.99, 0.5])
    min_p = np.array([0.0, 0.0, 0.0, 0.3, 0.0, 0.0])
    got = K.top_k_top_p_min_p_mask(torch.tensor(logits), torch.tensor(top_k), torch.tensor(top_p),
                                   torch.tensor(min_p, dtype=torch.float32)).numpy()
    for b in range(B):
        np.testing.assert_array_equal(np.isfinite(got[b]), np_filter(logits[b], top_k[b], top_p[b], min_p[b]))


def test_filter_all_off_is_identity():
    x = rand_logits(4, 30)
    off = K.top_k_top_p_min_p_mask(x, torch.tensor([-1, 0, -1, 0]), torch.ones(4), torch.zeros(4))
    torch.testing.assert_close(off, x)


def test_log_softmax_and_topk_logprobs():
    x = rand_logits(3, 20)
    lp = K.log_softmax(x)
    for b in range(3):
        row = x[b].double().numpy()
        want = row - (row.max() + np.log(np.exp(row - row.max()).sum()))
        np.testing.assert_allclose(lp[b].numpy(), want, rtol=1e-5, atol=1e-5)
    vals, ids = K.topk_logprobs(lp, 4)
    for b in range(3):
        want_ids = np.argsort(-lp[b].numpy(), kind="stable")[:4]
        np.testing.assert_array_equal(ids[b].numpy(), want_ids)
        np.testing.assert_array_equal(vals[b].numpy(), lp[b].numpy()[want_ids])


def test_sample_from_uniform_matches_numpy():
    g = np.random.default_rng(3)
    B, V = 64, 30
    logits = (g.normal(size=(B, V)) * 2).astype(np.float32)
    logits[g.uniform(size=(B, V)) < 0.3] = -np.inf
    logits[:, 7] = 0.0  # at least one live token per row
    u = g.uniform(size=B).astype(np.float32)
    u[:4] = [1e-12, 1 - 1e-7, 0.5, 2 ** -24]
    got = K.sample_from_uniform(torch.tensor(logits), torch.tensor(u)).numpy()
    for b in range(B):
        p = np.exp(logits[b].astype(np.float64) - logits[b].max())
        cdf = np.cumsum(p / p.sum())
        want = int(np.argmax(cdf >= u[b] * cdf[-1]))
        assert got[b] == want or abs(cdf[min(got[b], want)] - u[b]) < 1e-5, (b, got[b], want)
        assert np.isfinite(logits[b, got[b]])  # masked tokens are never drawn, even at u ~ 0 or 1


def test_sample_from_uniform_is_monotone_in_u():
    x = torch.log(torch.tensor([[0.2, 0.3, 0.5]])).repeat(5, 1)
    u = torch.tensor([0.01, 0.19, 0.21, 0.49, 0.99])
    assert K.sample_from_uniform(x, u).tolist() == [0, 0, 1, 1, 2]


# ---- Sampler --------------------------------------------------------------------------------------

def tokens(outs):
    return [o.token for o in outs]


def test_greedy_is_argmax_fast_path():
    x = rand_logits(32, 100)
    outs = Sampler([EOS]).sample(x, [req(temperature=0.0) for _ in range(32)])
    assert tokens(outs) == x.argmax(-1).tolist()
    assert all(isinstance(o, SampleOut) and o.logprob is None and o.top_logprobs is None for o in outs)


def test_top_k_one_and_tiny_top_p_pick_argmax():
    x = rand_logits(16, 100, seed=1)
    s = Sampler([EOS], seed=0)
    want = x.argmax(-1).tolist()
    assert tokens(s.sample(x, [req(temperature=1.5, top_k=1) for _ in range(16)])) == want
    assert tokens(s.sample(x, [req(temperature=1.5, top_p=1e-6) for _ in range(16)])) == want
    # Mixed with random rows, greedy rows still return the argmax.
    mixed = [req(temperature=0.0) if i % 2 else req(temperature=1.0) for i in range(16)]
    got = tokens(s.sample(x, mixed))
    assert got[1::2] == want[1::2]


def test_min_p_semantics():
    # probs 0.5, 0.3, 0.15, 0.05: min_p 0.5 keeps p >= 0.25 -> tokens {0, 1}
    x = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(400, 1)
    outs = Sampler([EOS], seed=1).sample(x, [req(min_p=0.5, seed=i) for i in range(400)])
    seen = set(tokens(outs))
    assert seen == {0, 1}
    # min_p 0.05 keeps everything (0.05 >= 0.025): all four appear.
    outs = Sampler([EOS], seed=1).sample(x, [req(min_p=0.05, seed=i) for i in range(400)])
    assert set(tokens(outs)) == {0, 1, 2, 3}


def test_penalties_change_the_argmax():
    s = Sampler([EOS])
    x = torch.tensor([[2.0, 1.9, 0.0, 0.0]])
    assert tokens(s.sample(x, [req(temperature=0)])) == [0]
    assert tokens(s.sample(x, [req(output=[0], temperature=0, frequency_penalty=0.5)])) == [1]
    assert tokens(s.sample(x, [req(output=[0], temperature=0, presence_penalty=0.5)])) == [1]
    # Presence/frequency look at output tokens only, not the prompt.
    assert tokens(s.sample(x, [req(prompt=[0], temperature=0, presence_penalty=5)])) == [0]
    # Repetition covers the prompt: 2.0 / 1.2 < 1.9.
    assert tokens(s.sample(x, [req(prompt=[0], temperature=0, repetition_penalty=1.2)])) == [1]
    # Negative logits are multiplied: -1.0 * 1.2 < -1.1.
    neg = torch.tensor([[-1.0, -1.1, -5.0, -5.0]])
    assert tokens(s.sample(neg, [req(prompt=[0], temperature=0, repetition_penalty=1.2)])) == [1]
    # Frequency scales with the count: two occurrences of 0 at 0.06 beat a 0.1 gap; one does not.
    assert tokens(s.sample(x, [req(output=[0], temperature=0, frequency_penalty=0.06)])) == [0]
    assert tokens(s.sample(x, [req(output=[0, 0], temperature=0, frequency_penalty=0.06)])) == [1]


def test_sampler_does_not_modify_callers_logits():
    x = rand_logits(2, 10)
    before = x.clone()
    Sampler([EOS]).sample(x, [req(output=[1], frequency_penalty=1.0, min_tokens=3, temperature=0.7),
                              req(output=[1], repetition_penalty=2.0, temperature=0)])
    torch.testing.assert_close(x, before, rtol=0, atol=0)


def step_logits(step, v=64):
    """The logits a fixed request sees at output position `step`, independent of batch."""
    return torch.randn(v, generator=torch.Generator().manual_seed(1000 + step)) * 2


def generate(seed, n, companions, fresh_sampler_each_step=False, position_in_batch=0):
    """Sample n tokens for a seeded request, batched with `companions` other requests."""
    target = req(seed=seed, temperature=0.9, top_p=0.95)
    s = Sampler([EOS], seed=123)
    others = [req(temperature=t, seed=None if i % 2 else 77 + i)
              for i, t in enumerate([1.0, 0.0, 0.7, 1.3][:companions])]
    for step in range(n):
        if fresh_sampler_each_step:
            s = Sampler([EOS])  # a different process: nothing carried over but output_ids
        batch = list(others)
        pos = position_in_batch % (len(batch) + 1)
        batch.insert(pos, target)
        rows = [step_logits(step) if r is target else torch.randn(64) for r in batch]
        out = s.sample(torch.stack(rows), batch)
        target.output_ids.append(out[pos].token)
        for r, o in zip(batch, out):
            if r is not target:
                r.output_ids.append(o.token)
    return target.output_ids


def test_seed_reproducible_across_batches_and_processes():
    alone = generate(seed=42, n=30, companions=0)
    assert generate(seed=42, n=30, companions=3, position_in_batch=2) == alone
    assert generate(seed=42, n=30, companions=4, position_in_batch=0) == alone
    assert generate(seed=42, n=30, companions=2, fresh_sampler_each_step=True, position_in_batch=1) == alone
    # Sampling position i alone, with history appended in between, and a fresh Sampler.
    r = req(seed=42, temperature=0.9, top_p=0.95)
    for step in range(30):
        r.output_ids.append(Sampler([EOS]).sample(step_logits(step)[None], [r])[0].token)
    assert r.output_ids == alone


def test_different_seeds_differ_and_positions_differ():
    a, b = generate(seed=1, n=40, companions=0), generate(seed=2, n=40, companions=0)
    assert a != b
    assert sum(x != y for x, y in zip(a, b)) > 10
    # Same seed, same logits every step: the draw still varies with the position.
    r = req(seed=5)
    flat = torch.zeros(1, 50)
    for _ in range(40):
        r.output_ids.append(Sampler([EOS]).sample(flat, [r])[0].token)
    assert len(set(r.output_ids)) > 10


def test_unseeded_is_valid_and_varies():
    x = torch.full((64, 20), -1e9)
    x[:, 3:8] = 0.0  # only tokens 3..7 are possible
    s = Sampler([EOS])
    got = tokens(s.sample(x, [req(temperature=1.0) for _ in range(64)]))
    assert all(3 <= t < 8 for t in got)
    assert len(set(got)) > 1


def test_min_tokens_masks_eos_and_stop_token_ids():
    x = torch.zeros(1, 10)
    x[0, EOS] = 50.0
    x[0, 7] = 40.0
    x[0, 4] = 30.0
    s = Sampler([EOS])
    r = req(temperature=0, min_tokens=2, stop_token_ids=[7])
    assert s.sample(x, [r])[0].token == 4
    r.output_ids.append(4)
    assert s.sample(x, [r])[0].token == 4
    r.output_ids.append(4)
    assert s.sample(x, [r])[0].token == EOS  # min_tokens reached
    # Random rows too: with eos at +50, every draw would be eos without the mask.
    outs = s.sample(x.repeat(50, 1), [req(min_tokens=1, seed=i) for i in range(50)])
    assert EOS not in tokens(outs)
    # ignore_eos masks nothing: the engine just does not stop.
    assert s.sample(x, [req(temperature=0, ignore_eos=True)])[0].token == EOS


def test_logprobs_shape_and_values():
    V = 12
    x = rand_logits(3, V, seed=7)
    reqs = [req(temperature=0, logprobs=V), req(temperature=0.5, logprobs=3, seed=1),
            req(temperature=0.0)]
    outs = Sampler([EOS]).sample(x, reqs)
    assert outs[2].logprob is None and outs[2].top_logprobs is None
    want = torch.log_softmax(x, -1)
    full = outs[0].top_logprobs
    assert len(full) == V and sorted(t for t, _ in full) == list(range(V))
    assert abs(torch.logsumexp(torch.tensor([v for _, v in full]), 0).item()) < 1e-5
    assert [v for _, v in full] == sorted((v for _, v in full), reverse=True)
    for o, row in zip(outs[:2], want):
        assert math.isclose(o.logprob, row[o.token].item(), abs_tol=1e-5)
        for t, v in o.top_logprobs:
            assert math.isclose(v, row[t].item(), abs_tol=1e-5)  # temperature does not change them
    assert len(outs[1].top_logprobs) == 3
    assert [t for t, _ in outs[1].top_logprobs] == want[1].topk(3).indices.tolist()
    # logprobs=0: the chosen token's logprob and an empty top list.
    o = Sampler([EOS]).sample(x[:1], [req(temperature=0, logprobs=0)])[0]
    assert o.top_logprobs == [] and math.isclose(o.logprob, want[0].max().item(), abs_tol=1e-5)


def test_logprobs_are_after_penalties():
    x = torch.tensor([[2.0, 1.0, 0.0]])
    o = Sampler([EOS]).sample(x, [req(output=[0], temperature=0, frequency_penalty=3.0, logprobs=1)])[0]
    want = torch.log_softmax(torch.tensor([-1.0, 1.0, 0.0]), -1)
    assert o.token == 1 and math.isclose(o.logprob, want[1].item(), abs_tol=1e-5)


P = torch.tensor([0.2, 0.3, 0.5])


def freqs(toks, n=3):
    return torch.bincount(torch.tensor(toks), minlength=n).double() / len(toks)


@pytest.mark.parametrize("params, want", [
    (dict(), P),
    (dict(temperature=0.5), P ** 2 / (P ** 2).sum()),  # T = 0.5 squares the probabilities
    (dict(temperature=2.0), P.sqrt() / P.sqrt().sum()),
    (dict(top_k=2), torch.tensor([0.0, 0.375, 0.625])),
    (dict(top_p=0.6), torch.tensor([0.0, 0.375, 0.625])),  # 0.5 < 0.6, so 0.3 joins; 0.2 does not
])
def test_empirical_distribution(params, want):
    n = 2000
    x = torch.log(P).repeat(n, 1)
    # Unseeded rows from a seeded Sampler (deterministic test), batched.
    got = freqs(tokens(Sampler([EOS], seed=3).sample(x, [req(**params) for _ in range(n)])))
    assert torch.allclose(got, want.double(), atol=0.035), (got, want)
    # One seeded request across 2000 positions: the per-position draws are independent.
    r = req(seed=11, **params)
    s = Sampler([EOS])
    for _ in range(n):
        r.output_ids.append(s.sample(x[:1], [r])[0].token)
    got = freqs(r.output_ids)
    assert torch.allclose(got, want.double(), atol=0.035), (got, want)
