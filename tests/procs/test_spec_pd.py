"""Speculative decoding in a disaggregated pair (real processes, KV over NIXL): the decode server drafts
after the handoff exactly as the aggregated engine does after its own prefill, so greedy outputs and the
acceptance counters are the aggregated ones; a draft model's KV for the prompt is prefilled on decode;
the speculative config is part of the decode-point contract (a mismatch refused naming the field)."""

from __future__ import annotations

import json

import httpx
import pytest

from trnd.config import SpeculativeConfig
from trnd.engine.request import SamplingParams
from trnd.llm import LLM

from tests.launch import admin_state, free_port, start_role, stop, wait_for, wait_ready
from tests.procs.test_disagg import Deployment, prompts, secret  # noqa: F401  (secret: the module fixture)
from tests.unit.test_spec import REPEAT

# adaptive off: both sides draft at every step, so their counters can be compared (engine/spec/payoff.py)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}


def _prompts(tokenizer):
    return [tokenizer.encode(REPEAT), *prompts([40, 600], seed=4), (list(range(40, 52)) * 5)[:55]]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_pair_equals_aggregated_output_and_acceptance(tiny_qwen3, secret, method):  # noqa: F811
    conf = NGRAM if method == "ngram" else {"method": "draft", "num_speculative_tokens": 3, "model": str(tiny_qwen3),
                                            "adaptive": False}
    flag = ("--speculative-config", json.dumps(conf))
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    llm = LLM(str(tiny_qwen3), dtype="float32", page_size=16, num_pages=1024, speculative=SpeculativeConfig(**conf))
    ps = _prompts(llm.tokenizer)
    expected = [llm.generate([p], params)[0].text for p in ps]  # one at a time, as the pair gets them below
    agg = llm.engine.spec.stats
    d = Deployment(tiny_qwen3, secret, decode_extra=flag, prefill_extra=flag)
    try:
        got = [d.complete(p, max_tokens=30)["choices"][0]["text"] for p in ps]
        assert got == expected
        sp = admin_state(d.port)["spec"]
        assert (sp["num_drafts"], sp["num_draft_tokens"], sp["num_accepted_tokens"], sp["accepted_per_pos"]) == \
            (agg.num_drafts, agg.num_draft_tokens, agg.num_accepted_tokens, agg.accepted_per_pos)
        assert sp["num_accepted_tokens"] > 0 and sp["method"] == method
        metrics = httpx.get(f"http://127.0.0.1:{d.port}/metrics").text
        assert f'trnd:spec_decode_num_accepted_tokens_total{{model_name="m"}} {float(agg.num_accepted_tokens)}' \
            in metrics
        assert 'trnd:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"}' in metrics
        assert "spec" not in admin_state(d.prefills[0][2])  # prefill drafts nothing: no draft model there
        assert wait_for(d.baseline_ok)
        if method == "draft":  # the draft's pages for every request were given back
            assert admin_state(d.port)["spec"]["draft_pages"] == 0
    finally:
        d.close()


def test_a_speculative_config_mismatch_is_refused_naming_the_field(tiny_qwen3, secret, tmp_path):  # noqa: F811
    cp, ap, port = free_port(), free_port(), free_port()
    cfg = tmp_path / "decode.toml"
    cfg.write_text("ready_hold_s = 1.0\n")
    pre = start_role("prefill", tiny_qwen3, secret, "--speculative-config", json.dumps(NGRAM), control_port=cp,
                     admin_port=ap)
    dec = start_role("decode", tiny_qwen3, secret, "--config", str(cfg), "--kv-memory-gb", "0.1",
                     "--speculative-config", json.dumps(NGRAM | {"num_speculative_tokens": 3}),
                     "--prefill", f"127.0.0.1:{cp}", "--served-model-name", "m", port=port)
    try:
        wait_ready(ap, pre)
        wait_ready(port, dec, path="/health")
        assert wait_for(lambda: admin_state(port)["peers"][0]["refused"], timeout=20)
        refused = admin_state(port)["peers"][0]["refused"]
        assert "speculative_config.num_speculative_tokens" in refused and "4" in refused and "3" in refused
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2},
                       timeout=30)
        assert r.status_code == 503 and "speculative_config" in r.json()["error"]["message"]
    finally:
        stop(dec), stop(pre)
