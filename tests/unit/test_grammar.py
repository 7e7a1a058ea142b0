"""The grammar mask in the sampler: a masked row never samples outside its grammar (over many random
logits, greedy and random), rows without a grammar are untouched, the reasoning gate, and a
prefill/decode split that continues the grammar state after the first token."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch

from trnd.engine.grammar import GrammarSpec, Grammars
from trnd.engine.request import Req, SamplingParams
from trnd.engine.sampler import Sampler
from trnd.model.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "n", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tok(tiny_qwen3):
    return Tokenizer.from_dir(tiny_qwen3)


@pytest.fixture(scope="module")
def grammars(tiny_qwen3, tok):
    from trnd.model.config import ModelConfig

    vocab = ModelConfig.from_dir(tiny_qwen3).vocab_size
    return Grammars((tiny_qwen3 / "tokenizer.json").read_text(), vocab, tok.eos_token_ids)


def _req(grammars, spec, **kw):
    r = Req([1, 2, 3], SamplingParams(max_tokens=200, grammar=spec, **kw))
    r.grammar = grammars.state(spec)
    return r


def _run(grammars, tok, spec, rng, steps=200, **kw):
    """Sample until eos under random logits, checking each token against a shadow matcher."""
    r = _req(grammars, spec, **kw)
    shadow = grammars.state(spec)
    sampler = Sampler(tok.eos_token_ids, seed=rng.randrange(2**32))
    vocab = grammars.vocab_size
    for _ in range(steps):
        logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(rng.randrange(2**32))) * 4
        t = sampler.sample(logits, [r])[0].token
        if t in tok.eos_token_ids:
            assert shadow.matcher.is_accepting(), "eos before the grammar was complete"
            return tok.decode(r.output_ids)
        assert shadow.matcher.consume_token(t), f"token {t} is outside the grammar"
        r.output_ids.append(t)
        r.grammar.advance(t)
    raise AssertionError(f"no eos after {steps} tokens: {tok.decode(r.output_ids)!r}")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_masked_sampler_never_leaves_the_schema(grammars, tok, temperature):
    rng = random.Random(0)
    spec = GrammarSpec(kind="json_schema", value=json.dumps(SCHEMA))
    for _ in range(15):
        text = _run(grammars, tok, spec, rng, temperature=temperature)
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("spec, check", [
    (GrammarSpec(kind="regex", value=r"[0-9]{2}-[a-c]+"), lambda s: __import__("re").fullmatch(r"[0-9]{2}-[a-c]+", s)),
    (GrammarSpec(kind="choice", value=json.dumps(["alpha", "beta", "gamma delta"])),
     lambda s: s in ("alpha", "beta", "gamma delta")),
    (GrammarSpec(kind="ebnf", value='root ::= "yes" | "no" | "n" [0-9]'),
     lambda s: s in ("yes", "no") or (len(s) == 2 and s[0] == "n" and s[1].isdigit())),
])
def test_regex_choice_and_grammar(grammars, tok, spec, check):
    rng = random.Random(1)
    for _ in range(10):
        text = _run(grammars, tok, spec, rng, temperature=1.0)
        assert check(text), text


def test_rows_without_a_grammar_are_untouched(grammars, tok):
    spec = GrammarSpec(kind="regex", value="a+")
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        logits = torch.randn(3, grammars.vocab_size, generator=g)
        plain = [Req([1], SamplingParams(temperature=0.0)), Req([1], SamplingParams(temperature=0.7, seed=5))]
        alone = Sampler(tok.eos_token_ids).sample(logits[[0, 2]], plain)
        mixed = [plain[0], _req(grammars, spec, temperature=0.0), plain[1]]
        together = Sampler(tok.eos_token_ids).sample(logits, mixed)
        assert [together[0].token, together[2].token] == [o.token for o in alone]
        assert tok.decode([together[1].token]).strip("a") == "" or together[1].token in tok.eos_token_ids


def test_logprobs_under_a_grammar_read_minus_inf_outside_it(grammars, tok):
    r = _req(grammars, GrammarSpec(kind="choice", value='["x"]'), temperature=0.0, logprobs=3)
    out = Sampler(tok.eos_token_ids).sample(torch.randn(1, grammars.vocab_size), [r])[0]
    assert out.logprob == pytest.approx(0.0, abs=1e-5)  # the only allowed token
    assert out.top_logprobs[1][1] == float("-inf")


def test_grammar_starts_after_the_reasoning_marker(grammars, tok):
    spec = GrammarSpec(kind="choice", value='["ok"]', after="</think>")
    st = grammars.state(spec)
    for t in tok.encode("<think>let me see</thi", add_special_tokens=False):
        assert not st.active
        st.advance(t)
    assert not st.active
    for t in tok.encode("nk>", add_special_tokens=False):
        st.advance(t)
    assert st.active
    r = Req([1], SamplingParams(temperature=1.0, grammar=spec))
    r.grammar = st
    text = ""
    sampler = Sampler(tok.eos_token_ids, seed=0)
    for _ in range(10):
        t = sampler.sample(torch.randn(1, grammars.vocab_size), [r])[0].token
        if t in tok.eos_token_ids:
            break
        text += tok.decode([t])
        r.output_ids.append(t)
        st.advance(t)
    assert text == "ok"


def test_uncompilable_specs_are_reported(grammars):
    assert grammars.check(GrammarSpec(kind="json_schema", value='{"type": "bogus"}'))
    assert grammars.check(GrammarSpec(kind="regex", value="[a-"))
    assert grammars.check(GrammarSpec(kind="ebnf", value="root ::= ("))
    assert grammars.check(GrammarSpec(kind="json_schema", value=json.dumps(SCHEMA))) is None


def test_prefill_first_token_then_decode_continues(tiny_qwen3):
    """The disaggregated split in one process: engine A samples token 0 (max_tokens=1, as prefill
    does), engine B receives it through deliver() and decodes the rest; same tokens as one engine."""
    from trnd.engine.sampler import SampleOut
    from trnd.llm import LLM

    spec = GrammarSpec(kind="json_schema", value=json.dumps(SCHEMA))
    prompt = list(range(5, 40))
    for params in (SamplingParams(max_tokens=60, temperature=0.0, grammar=spec),
                   SamplingParams(max_tokens=60, temperature=1.0, seed=7, grammar=spec)):
        whole = LLM(str(tiny_qwen3), num_pages=64, seed=0).generate([prompt], params)[0]
        a = LLM(str(tiny_qwen3), num_pages=64, seed=0)
        first = a.generate([prompt], SamplingParams(**{**{f: getattr(params, f) for f in params.__struct_fields__},
                                                       "max_tokens": 1}))[0].token_ids[0]
        b = LLM(str(tiny_qwen3), num_pages=64, seed=0).engine
        req = b.add(prompt, params)
        out_ids = []
        out = b.deliver(req, SampleOut(first))
        out_ids += out.token_ids
        while not out.finished:
            for out in b.step():
                out_ids += out.token_ids
        assert out_ids == whole.token_ids
        jsonschema.validate(json.loads(b.tokenizer.decode(out_ids)), SCHEMA)


def test_a_grammar_compiles_once_and_requests_copy_it(grammars):
    """Before: the same large grammar sent twice compiled twice (4.3-5.9 s each). It is kept, compiled, by its
    canonical text; a request's matcher is a copy, so two requests never share a position."""
    spec = GrammarSpec(kind="json_schema", value=json.dumps({**SCHEMA, "title": "compiled-once"}))
    assert not grammars.cached(spec)
    assert grammars.check(spec) is None and grammars.cached(spec)
    a, b = grammars.state(spec), grammars.state(GrammarSpec(kind=spec.kind, value=spec.value, after="</think>"))
    assert a.matcher is not b.matcher


def test_a_refused_grammar_is_refused_again_without_compiling(grammars, monkeypatch):
    """Before: a grammar llguidance refuses (a 40 KB schema whose lexer is too big: 0.7-1.5 s) compiled again
    each time a client sent it, on the one compile thread. The reason is kept by the grammar's digest."""
    import trnd.engine.grammar as G

    calls = []
    real = G.grammar_text
    monkeypatch.setattr(G, "grammar_text", lambda spec: calls.append(spec) or real(spec))
    bad = GrammarSpec(kind="regex", value="(unclosed-refused-once")
    why = grammars.check(bad)
    assert why and grammars.check(bad) == why and len(calls) == 1 and not grammars.cached(bad)
    good = GrammarSpec(kind="regex", value="[0-9]{2}-refused-once")
    assert grammars.check(good) is None and grammars.check(good) is None and len(calls) == 2


def test_a_compile_past_its_time_is_a_400_naming_the_limit_and_the_loop_serves_meanwhile():
    import asyncio
    import threading

    from trnd.api.errors import APIError
    from trnd.api.structured import GrammarLimits, compile_grammar

    release = threading.Event()

    class SlowGrammars:
        def cached(self, spec):
            return False

        def check(self, spec):
            release.wait(10)
            return None

    class Engine:
        grammars = SlowGrammars()

    async def go():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        t = asyncio.create_task(tick())
        with pytest.raises(APIError) as e:
            await compile_grammar(Engine(), (GrammarSpec(kind="regex", value="x"), "structured_outputs.regex"),
                                  GrammarLimits(compile_s=0.3))
        t.cancel()
        release.set()
        return e.value, ticks

    err, ticks = asyncio.run(go())
    assert err.status == 400 and "grammar_compile_s" in str(err.body()) and ticks > 5
