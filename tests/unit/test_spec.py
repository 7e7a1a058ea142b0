"""Speculative decoding (engine/spec/): n-gram and draft-model proposals verified in one forward of the
target. Greedy outputs are the target's own (fp32), with logprobs, stop strings, max_tokens, penalties and
structured outputs; sampling keeps the target's distribution (a statistical test over seeded draws);
rejected drafts leave no page behind and nothing in the prefix cache; a bad --speculative-config is one
line naming the field."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import torch

from trnd.config import SpeculativeConfig
from trnd.engine.request import SamplingParams
from trnd.engine.spec import ngram
from trnd.engine.spec.verify import accept_greedy, rejection_sample
from trnd.llm import LLM
from trnd.sampling_params import GrammarSpec

REPEAT = ("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
          "Rewrite it unchanged:\ndef add(a, b):\n    return a + b\n\ndef sub(")


def spec(method: str, k: int = 4, **kw) -> SpeculativeConfig:
    """Drafting at every step (adaptive off) unless asked: the counters and seeded draws below are then a
    function of the inputs, not of how fast this host ran each step."""
    return SpeculativeConfig(method=method, num_speculative_tokens=k, **{"adaptive": False, **kw})


def generate(model, prompts, params, speculative=None, **kw):
    llm = LLM(str(model), dtype="float32", speculative=speculative, **{"num_pages": 256, **kw})
    outs = llm.generate(prompts, params)
    llm.engine.check_integrity()
    return outs, llm.engine


def prompts(tokenizer_model=None):
    g = torch.Generator().manual_seed(5)
    rand = [torch.randint(5, 1000, (n,), generator=g).tolist() for n in (9, 40)]
    loop = [(list(range(40, 52)) * 4)[:45]]  # the answer repeats the context: n-gram drafts are right
    return [REPEAT, "the cat sat on the mat and the cat sat on the", *rand, *loop]


# -- pieces --------------------------------------------------------------------------------------------------


def test_ngram_finds_the_earliest_longest_match():
    assert ngram.propose([1, 2, 3, 4, 2, 3], k=4, min_n=2, max_n=3) == [4, 2, 3]
    assert ngram.propose([1, 2, 3, 9, 1, 2, 3, 7, 2, 3], k=2, min_n=1, max_n=3) == [9, 1]  # [2, 3]: earliest
    assert ngram.propose([5, 1, 2, 3, 8, 1, 2, 3], k=3, min_n=1, max_n=3) == [8, 1, 2]  # the longest wins
    assert ngram.propose([1, 2, 3, 4], k=4, min_n=1, max_n=3) == []  # nothing repeats
    assert ngram.propose([7, 7], k=4, min_n=1, max_n=1) == [7]  # only one token follows the match
    assert ngram.propose([1, 2, 1, 2], k=0, min_n=1, max_n=2) == []


def test_greedy_acceptance_keeps_the_agreeing_prefix_and_the_target_token_after_it():
    assert accept_greedy([5, 6, 7], [5, 6, 9, 1]) == [5, 6, 9]
    assert accept_greedy([5, 6, 7], [5, 6, 7, 1]) == [5, 6, 7, 1]  # all kept: the bonus token
    assert accept_greedy([5, 6, 7], [4, 6, 7, 1]) == [4]
    assert accept_greedy([], [3]) == [3]


def _chi2_sf(stat: float, dof: int) -> float:
    """Upper tail of the chi-square distribution (Wilson-Hilferty: close enough for a test threshold)."""
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize("draft", ["model", "ngram"])
def test_rejection_sampling_emits_the_target_distribution(draft):
    """Whatever the draft proposes, each emitted position is distributed as the target's p: the first token
    over 8000 draws (accepted drafts and residual draws together), and the second given the first."""
    g = torch.Generator().manual_seed(0)
    V, n = 6, 8000
    p = torch.softmax(torch.randn(3, V, generator=g) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(2, V, generator=g) * 1.5, dim=-1)
    drafted = torch.stack([torch.multinomial(q[j], n, replacement=True, generator=g) for j in range(2)], 1).tolist()
    uniforms = torch.rand(n, 5, generator=g).tolist()
    first, second, firsts = Counter(), Counter(), Counter()
    for d, u in zip(drafted, uniforms):
        # drafted from q, as a draft model samples; or an n-gram's fixed guess, a point mass
        d, qq = (d, q) if draft == "model" else ([2, 4], None)
        out = rejection_sample(p, d, qq, u[:2], u[2:])
        first[out[0]] += 1
        if len(out) > 1 and out[0] == d[0]:  # the second token was verified at row 1 (its context is d[0])
            firsts[out[0]] += 1
            second[(out[0], out[1])] += 1
    stat = sum((first[t] - n * p[0, t].item()) ** 2 / (n * p[0, t].item()) for t in range(V))
    assert _chi2_sf(stat, V - 1) > 1e-4, (stat, first)
    for t0, m in firsts.items():  # given the first token, the second follows p's row 1
        if m < 300:
            continue
        stat = sum((second[(t0, t)] - m * p[1, t].item()) ** 2 / (m * p[1, t].item()) for t in range(V))
        assert _chi2_sf(stat, V - 1) > 1e-4, (t0, stat)


def test_bad_speculative_config_is_one_line_naming_the_field(capsys):
    from trnd.cli import main
    from trnd.procs import EX_CONFIG

    cases = {'{"method": "ngram", "num_speculative_tokens": 0}': "speculative_config.num_speculative_tokens",
             '{"method": "eagle9", "num_speculative_tokens": 2}': "speculative_config.method",
             '{"method": "draft", "num_speculative_tokens": 2}': "speculative_config.model",
             '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}':
                 "speculative_config.prompt_lookup_min",
             '{"method": "ngram", "num_speculative_tokens": 2, "speculative_token_tree": 1}': "speculative_config",
             '{"method": ngram}': "speculative_config: not valid JSON",
             '[4]': "speculative_config: expected a JSON object"}
    for text, field in cases.items():
        for cmd in (["serve", "--aggregated"], ["decode"]):
            assert main([*cmd, "--speculative-config", text]) == EX_CONFIG
            err = capsys.readouterr().err.strip()
            assert err.count("\n") == 0 and "Traceback" not in err, err
            assert field in err, (text, err)


def test_a_draft_model_of_another_tokenizer_is_refused(tiny_qwen3, models_dir):
    from trnd.config import StartupError
    from trnd.model.maker import make_model

    other = models_dir / "tiny-qwen3-small-vocab"
    if not other.exists():
        make_model(other, preset="tiny", arch="qwen3", seed=0, dtype="float32", overrides={"vocab_size": 1088})
    with pytest.raises(StartupError, match="speculative_config.model"):
        LLM(str(tiny_qwen3), dtype="float32", num_pages=64, speculative=spec("draft", model=str(other)))
    with pytest.raises(StartupError, match="speculative_config.method = 'mtp'"):
        LLM(str(tiny_qwen3), dtype="float32", num_pages=64, speculative=spec("mtp"))


# -- greedy: the target's own output -------------------------------------------------------------------------


def _same(ref, got):
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert [o.text for o in got] == [o.text for o in ref]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in ref]
    for a, b in zip(ref, got):
        assert len(a.logprobs) == len(b.logprobs)
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.token == y.token and math.isclose(x.logprob, y.logprob, abs_tol=1e-4)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]


@pytest.fixture(scope="module")
def draft_other(tiny_qwen3, models_dir):
    """A draft that is not the target but near it (its weights plus 10% noise, the same tokenizer): it
    proposes the target's tokens about a third of the time at temperature 1, so both the kept-draft and the
    residual paths run (two random-weight checkpoints agree on almost nothing)."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = models_dir / "tiny-qwen3-noisy"
    if not out.exists():
        shutil.copytree(tiny_qwen3, out)
        g = torch.Generator().manual_seed(1)
        for f in out.glob("*.safetensors"):
            t = load_file(f)
            save_file({k: v + 0.1 * v.std() * torch.randn(v.shape, generator=g, dtype=v.dtype) if v.dim() > 1 else v
                       for k, v in t.items()}, f, metadata={"format": "pt"})
    return out


METHODS = ["ngram", "draft=target", "draft=other"]


def _config(method, tiny_model, draft_other, k=4):
    if method == "ngram":
        return spec("ngram", k, prompt_lookup_min=1, prompt_lookup_max=3)
    return spec("draft", k, model=str(tiny_model if method == "draft=target" else draft_other))


@pytest.mark.parametrize("method", METHODS)
def test_greedy_output_is_the_target_s(tiny_model, draft_other, method):
    cases = [SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, logprobs=2),
             SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),  # max_tokens inside a kept draft
             SamplingParams(max_tokens=40, temperature=0.0, presence_penalty=0.5, repetition_penalty=1.2,
                            min_tokens=10)]
    for params in cases:
        ref, _ = generate(tiny_model, prompts(), params)
        got, engine = generate(tiny_model, prompts(), params, _config(method, tiny_model, draft_other))
        _same(ref, got)
        st = engine.spec.stats
        assert st.num_drafts > 0 and st.num_draft_tokens >= st.num_accepted_tokens
        if method == "draft=target" and params.presence_penalty == 0:  # (the draft applies no penalties)
            assert st.num_accepted_tokens == st.num_draft_tokens  # the draft is the target: every token kept
        assert engine.stats.generation_tokens == sum(len(o.token_ids) for o in got)


@pytest.mark.parametrize("method", METHODS)
def test_stop_strings_end_the_output_where_they_did(tiny_qwen3, draft_other, method):
    base = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    ref, _ = generate(tiny_qwen3, prompts(), base)
    # a stop string taken from the middle of each reference output: the stop lands inside a kept draft
    stops = [o.text[len(o.text) // 2: len(o.text) // 2 + 3] for o in ref]
    for i, prompt in enumerate(prompts()):
        if not stops[i].strip():
            continue
        p = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, stop=[stops[i]])
        r, _ = generate(tiny_qwen3, [prompt], p)
        g, _ = generate(tiny_qwen3, [prompt], p, _config(method, tiny_qwen3, draft_other))
        assert (g[0].text, g[0].finish_reason) == (r[0].text, r[0].finish_reason)


@pytest.mark.parametrize("method", ["ngram", "draft=other"])
def test_structured_output_masks_every_drafted_position(tiny_qwen3, draft_other, method):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "ok": {"type": "boolean"}}, "required": ["name", "ok"],
              "additionalProperties": False}
    p = SamplingParams(max_tokens=60, temperature=0.0, grammar=GrammarSpec(kind="json_schema", value=json.dumps(schema)))
    prompt = ['{"name":"abc","ok":true} {"name":"abc","ok":true} {"name":"abc","ok":true} ']
    ref, _ = generate(tiny_qwen3, prompt, p)
    got, engine = generate(tiny_qwen3, prompt, p, _config(method, tiny_qwen3, draft_other))
    assert got[0].text == ref[0].text and got[0].finish_reason == "stop"
    assert json.loads(got[0].text).keys() == {"name", "ok"}
    assert engine.spec.stats.num_drafts > 0


@pytest.mark.parametrize("method", METHODS)
def test_no_page_leaks_and_the_prefix_cache_keeps_no_rejected_token(tiny_qwen3, draft_other, method):
    """Short of pages (drafts dropped, requests preempted), the output is the same; every page is accounted
    for after each step, and the KV the prefix cache keeps is the KV of the tokens it is keyed by."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    kw = dict(page_size=8, num_pages=40, max_batch=4)
    ref, e_ref = generate(tiny_qwen3, prompts(), params, **kw)
    llm = LLM(str(tiny_qwen3), dtype="float32", speculative=_config(method, tiny_qwen3, draft_other), **kw)
    ids = [llm.tokenizer.encode(p) if isinstance(p, str) else p for p in prompts()]
    for i in ids:
        llm.engine.add(i, params)
    done = {}
    while llm.engine.has_work:
        for out in llm.engine.step():
            done.setdefault(out.rid, []).extend(out.token_ids)
        llm.engine.check_integrity()
    assert list(done.values()) == [o.token_ids for o in ref]
    assert llm.engine.spec.stats.num_drafts > 0
    counts = llm.engine.check_integrity()
    assert counts["in_use"] == 0
    if llm.engine.spec.draft is not None:
        assert llm.engine.spec.draft.pool.num_free == llm.engine.spec.draft.pool.num_pages
    # every cached page holds the KV the reference engine computed for the same tokens
    checked = 0
    for prompt, out in zip(ids, done.values()):
        toks = prompt + out
        m, m_ref = llm.engine.radix.match(toks), e_ref.radix.match(toks)
        n = min(len(m.pages), len(m_ref.pages))
        for a, b in zip(m.pages[:n], m_ref.pages[:n]):
            assert torch.allclose(llm.engine.pools[0][a], e_ref.pools[0][b], atol=1e-5)
            checked += 1
    assert checked > 0


def test_greedy_output_through_an_l2_reload(tiny_qwen3, draft_other):
    """A second turn whose first turn's pages were evicted to L2 and loaded back: the same output as without
    speculation, and the draft model catches up on the loaded prompt."""
    g = torch.Generator().manual_seed(11)
    fillers = [torch.randint(5, 1000, (100,), generator=g).tolist() for _ in range(3)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    def turns(speculative):
        llm = LLM(str(tiny_qwen3), dtype="float32", page_size=8, num_pages=48, max_batch=2, host_cache_gb=0.02,
                  speculative=speculative)
        first = llm.generate([REPEAT], params)[0]
        llm.generate(fillers, params)  # evicts the first turn's pages to L2
        second = llm.generate([first.prompt_ids + first.token_ids + [13, 11]], params)[0]
        llm.engine.check_integrity()
        return (first.token_ids, second.token_ids, second.cached_tokens), llm.engine

    ref, _ = turns(None)
    for method in METHODS:
        got, engine = turns(_config(method, tiny_qwen3, draft_other))
        assert got == ref, method
        assert engine.tiers.host.loaded > 0 and engine.spec.stats.num_drafts > 0


# -- sampling: the target's distribution ----------------------------------------------------------------------


def test_seeded_sampling_with_a_draft_model_keeps_the_target_distribution(tiny_qwen3, draft_other):
    """Many seeded requests at temperature 1 (top_k 3: a small support to count): the second to fourth
    tokens, which verification emits (kept drafts, residual draws, bonus tokens), have the same distribution
    with a draft that often disagrees as without speculation (a two-sample chi-square test per position)."""
    n = 600
    prompt = [[17, 230, 41, 99, 5]]

    def draws(speculative):
        params = [SamplingParams(max_tokens=4, temperature=1.0, top_k=3, seed=s, ignore_eos=True) for s in range(n)]
        llm = LLM(str(tiny_qwen3), dtype="float32", max_batch=64, num_pages=512, speculative=speculative)
        outs = llm.generate(prompt * n, params)
        llm.engine.check_integrity()
        return [tuple(o.token_ids) for o in outs], llm.engine

    ref, _ = draws(None)
    got, engine = draws(spec("draft", 2, model=str(draft_other)))
    st = engine.spec.stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens  # both paths ran: kept drafts and residual draws
    for pos in (1, 2, 3):
        a, b = Counter(t[pos] for t in ref), Counter(t[pos] for t in got)
        keys = sorted(set(a) | set(b))
        stat = sum((a[k] - b[k]) ** 2 / (a[k] + b[k]) for k in keys)  # two samples of equal size
        assert _chi2_sf(stat, max(len(keys) - 1, 1)) > 1e-4, (pos, a, b)
    # and seeded draws are reproducible with speculation on
    again, _ = draws(spec("draft", 2, model=str(draft_other)))
    assert again == got


def test_acceptance_in_admin_state_and_trnd_top(tiny_qwen3):
    import msgspec

    from trnd import snapshot as S
    from trnd.top.panels import spec_text

    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    _, engine = generate(tiny_qwen3, prompts(), params, spec("ngram", 3, prompt_lookup_min=1, prompt_lookup_max=3))
    st = msgspec.json.decode(msgspec.json.encode(engine.state()), type=S.State).spec  # what /admin/state serves
    s = engine.spec.stats
    assert (st.method, st.num_speculative_tokens) == ("ngram", 3)
    assert (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens) == \
        (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) and st.num_accepted_tokens > 0
    assert st.accepted_per_pos == s.accepted_per_pos and len(st.accepted_per_pos) == 3
    assert st.acceptance == round(s.num_accepted_tokens / s.num_draft_tokens, 4)
    assert st.draft_pages is None  # n-gram: no draft pool
    line = spec_text(st)
    assert line.startswith("spec ngram k=3 · accepted") and f"({s.num_accepted_tokens}/{s.num_draft_tokens})" in line


# -- switching itself off where it does not pay (engine/spec/payoff.py) ----------------------------------------


def test_payoff_stops_drafting_where_it_is_slower_and_tries_again_now_and_then():
    from trnd.engine.spec.payoff import MAX_WAIT, MIN_WAIT, PLAIN_EVERY, Payoff

    pay = Payoff()

    def run(batch, steps, draft_rate, plain_rate):
        decided = []
        for _ in range(steps):
            d = pay.draft_now(batch)
            decided.append(d)
            pay.record(batch, d, 10, 10 / (draft_rate if d else plain_rate))
        return decided

    slow = run(1, 400, draft_rate=90.0, plain_rate=100.0)  # drafting a little slower (each try within budget)
    assert slow[:2] == [True, False]  # each side measured once
    tries = [i for i, d in enumerate(slow) if d]
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    assert gaps[1:4] == [2 * MIN_WAIT, 4 * MIN_WAIT, 8 * MIN_WAIT] and gaps[-1] == MAX_WAIT  # doubling waits
    assert sum(slow[100:]) <= 400 // MAX_WAIT  # about one step in MAX_WAIT drafts: at most ~1.5% slower here
    fast = run(4, 200, draft_rate=150.0, plain_rate=100.0)  # another batch size, where drafting pays
    # (it starts from batch size 1's averages, where drafting lost: one try after MIN_WAIT finds it pays here)
    assert 200 - sum(fast) <= 200 // PLAIN_EVERY + MIN_WAIT + 2  # then a plain step now and then
    assert all(fast[MIN_WAIT - 1: MIN_WAIT - 1 + PLAIN_EVERY])
    after = run(1, 3 * MAX_WAIT, draft_rate=300.0, plain_rate=100.0)  # the workload changed: drafting pays again
    assert sum(after[-PLAIN_EVERY:]) >= PLAIN_EVERY - 1
    assert pay.state()[1][0] > pay.state()[1][1]


def test_payoff_bounds_what_the_losing_tries_cost():
    """A try that costs 50 plain steps (a draft near the target's size catching up on what it missed while held)
    is made only while the tries' losses stay within BUDGET of the time: drafting that never pays costs about
    BUDGET, not one such catch-up in every MAX_WAIT steps."""
    from trnd.engine.spec.payoff import BUDGET, Payoff

    pay, total, extra, tries = Payoff(), 0.0, 0.0, 0
    for _ in range(5000):
        d = pay.draft_now(1)
        t = 0.5 if d else 0.01
        pay.record(1, d, 1, t)
        total, extra, tries = total + t, extra + (t - 0.01 if d else 0.0), tries + d
    assert tries >= 3  # still tried now and then
    assert extra <= BUDGET * total + 2 * 0.5, (extra, total, tries)  # the first measurement and one try over


def test_adaptive_drafting_keeps_greedy_output_and_measures_both_sides(tiny_qwen3, draft_other):
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ref, _ = generate(tiny_qwen3, prompts(), params)
    got, engine = generate(tiny_qwen3, prompts(), params, spec("draft", 4, model=str(draft_other), adaptive=True))
    _same(ref, got)
    st = engine.state().spec
    assert st.num_drafts > 0 and st.plain_steps > 0  # both sides ran
    assert any(d is not None and p is not None for d, p in st.payoff.values()), st.payoff
