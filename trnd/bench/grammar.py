"""`trnd bench grammar`: what the structured-output mask costs: decode tokens/s at one batch size with
no grammar and with a json_schema on every request, interleaved A/B/A/B in one process so machine
noise hits both sides alike; reported as a ratio, with the mask's own time per step.

The schema (an open array of short strings) never completes, so every step of every request is masked.
"""

from __future__ import annotations

import json
import os
import time

SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 8}}},
          "required": ["items"]}


def main(args) -> int:
    from trnd_kernels.cpuinfo import cpu_info
    from trnd.bench.engine import _prompts
    from trnd.llm import LLM
    from trnd.model.maker import resolve_model
    from trnd.sampling_params import GrammarSpec, SamplingParams

    model = str(resolve_model(args.model))
    b, new = args.batch, args.new_tokens
    llm = LLM(model, dtype=args.dtype, page_size=16, num_pages=b * (64 + new) // 16 + 64, max_batch=b,
              prefix_cache=False, threads=args.threads or os.cpu_count())
    vocab = llm.tokenizer.vocab_size
    spec = GrammarSpec(kind="json_schema", value=json.dumps(SCHEMA))
    plain = SamplingParams(max_tokens=new + 1, temperature=0.0, ignore_eos=True)
    masked = SamplingParams(max_tokens=new + 1, temperature=0.0, ignore_eos=True, grammar=spec)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    ps = _prompts(b, 64, vocab, 0)
    llm.generate(ps, [masked] * b)  # warm-up, grammar side compiled
    grammars = llm.engine.grammars
    mask_s, calls = 0.0, 0
    real_mask = grammars.mask

    def timed_mask(*a):
        nonlocal mask_s, calls
        t = time.perf_counter()
        try:
            return real_mask(*a)
        finally:
            mask_s += time.perf_counter() - t
            calls += 1

    grammars.mask = timed_mask
    res = {"none": [], "json_schema": []}
    for _ in range(args.reps):
        for name, p in (("none", plain), ("json_schema", masked)):
            t = time.perf_counter()
            llm.generate(ps, one)
            t_pre = time.perf_counter() - t
            t = time.perf_counter()
            outs = llm.generate(ps, [p] * b)
            total = time.perf_counter() - t
            assert all(len(o.token_ids) == new + 1 for o in outs)
            res[name].append(b * new / (total - t_pre))
    llm.engine.close()
    best = {k: max(v) for k, v in res.items()}
    info = cpu_info()
    print(f"trnd bench grammar: model {model}, batch {b}, {new} greedy tokens, best of {args.reps} interleaved "
          f"runs; CPU: {info.summary()}")
    print(f"decode tok/s b={b}: no grammar {best['none']:.1f}, json_schema on every request "
          f"{best['json_schema']:.1f} ({best['json_schema'] / best['none']:.2f}x); "
          f"mask {mask_s / max(calls, 1) * 1e3:.2f} ms per batched step")
    print("all runs:", {k: [round(x, 1) for x in v] for k, v in res.items()})
    return 0
