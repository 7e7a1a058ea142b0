"""Preemption that keeps the work: a preempted request's full pages go to the prefix cache and, once
evicted, to L2; at re-admission they come back from there instead of being recomputed, and the greedy
output is the same as without preemption (fp32)."""

from __future__ import annotations

import torch

from trnd.engine.request import SamplingParams
from trnd.llm import LLM

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(5, 1000, (120,), generator=g).tolist() for _ in range(4)]


def run(model, **kw):
    llm = LLM(str(model), page_size=8, max_batch=4, token_budget=512, chunk_size=512, **kw)
    outs = [o.token_ids for o in llm.generate(prompts(), GREEDY)]
    llm.engine.check_integrity()
    return outs, llm.engine


def test_preempted_requests_resume_from_l2_with_the_same_output(tiny_qwen3):
    ref, e_ref = run(tiny_qwen3, num_pages=256)
    assert e_ref.stats.preemptions == 0
    # 4 x (120 + 40) tokens need 80 pages: 48 admit three prompts (45), whose growth preempts
    recomputed, e_rc = run(tiny_qwen3, num_pages=48)
    tiered, e_l2 = run(tiny_qwen3, num_pages=48, host_cache_gb=0.02)
    assert e_rc.stats.preemptions > 0 and e_l2.stats.preemptions > 0
    assert recomputed == ref and tiered == ref
    # the preempted requests' KV came back from L2 (the prompts share nothing: only a resume loads)
    # rather than being computed again
    assert e_l2.tiers.host.loaded > 0
    assert e_l2.stats.prefill_tokens <= e_rc.stats.prefill_tokens - e_l2.tiers.host.loaded * 8
