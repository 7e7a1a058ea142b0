"""`trnd bench preempt`: how fast a preempted request resumes, from L2 against by recompute, at one context.

    trnd bench preempt [--model small] [--context 8192] [--rounds 3]

One request of --context prompt tokens is prefilled and decodes a few tokens; then it is preempted the
way page pressure preempts it (engine/scheduler.py: its full pages to the radix cache) and the device
cache is emptied, so its pages are on no device page any more: with the host tier they were written to
L2 on eviction (write-back), without it they are gone. The resume is timed from the preemption to its
next token: the load from L2 (parked on the tier's copy thread, engine/parked.py) plus the last partial
page, against recomputing the whole context. Both engines run in this process, alternated --rounds
times; each round checks the resumed request's tokens against an uninterrupted run (greedy).
"""

from __future__ import annotations

import statistics
import time


def add_arguments(p) -> None:
    p.add_argument("--model", default="small", help="model dir or preset (default small)")
    p.add_argument("--context", type=int, default=8192, help="prompt tokens of the preempted request")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=None)


def _engine(model: str, args, host_gb: float):
    from trnd.engine.build import EngineConfig, build
    from trnd.engine.engine import Engine

    page = 16
    pages = -(-(args.context + 64) // page) + 8
    return Engine(build(EngineConfig(model=model, dtype=args.dtype, page_size=page, num_pages=pages,
                                     max_model_len=pages * page, token_budget=2048, chunk_size=2048,
                                     threads=args.threads, host_cache_gb=host_gb, role="bench")))


def one_round(engine, prompt: list[int], want: list[int], tag: str) -> dict:
    from trnd.engine.request import SamplingParams

    rid = f"preempt-{tag}-{time.monotonic_ns()}"
    engine.add(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), rid=rid)
    req = engine.scheduler.find(rid)
    while req.num_output < 4:
        engine.step()
    t0 = time.perf_counter()
    engine.scheduler.preempt(req)
    engine.radix.evict(engine.radix.num_evictable_pages)  # write-back: to L2 here, when there is one
    saved_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    while req.num_output < 5:
        engine.step()
        if engine.idle_step:
            time.sleep(0.0005)  # parked on the host copy: the loop polls
    resume_s = time.perf_counter() - t1
    while engine.has_work:
        engine.step()
    if req.output_ids != want:
        raise SystemExit(f"{tag}: the resumed request's tokens differ from an uninterrupted run")
    engine.check_integrity()
    engine.radix.evict(engine.radix.num_evictable_pages)  # the next round starts cold
    if engine.tiers is not None:
        engine.tiers.reset()
    return {"resume_s": resume_s, "saved_s": saved_s, "loaded": req.loaded_from.get("host", 0)}


def main(args) -> int:
    import torch

    from trnd.bench import cpu_line
    from trnd.engine.request import SamplingParams
    from trnd.model.maker import resolve_model

    model = str(resolve_model(args.model))
    print(cpu_line(), flush=True)
    l2 = _engine(model, args, host_gb=args.context * 0.0002 + 0.5)
    rc = _engine(model, args, host_gb=0.0)
    prompt = torch.randint(10, min(15000, l2.model_config.vocab_size), (args.context,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    rc.add(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), rid="uninterrupted")
    ref = rc.scheduler.find("uninterrupted")
    while rc.has_work:
        rc.step()
    want = list(ref.output_ids)
    rc.radix.evict(rc.radix.num_evictable_pages)
    print(f"model {model} ({str(l2.model_config.dtype).removeprefix('torch.')}), context {args.context}, page 16, "
          f"torch threads {torch.get_num_threads()}", flush=True)
    res: dict[str, list[dict]] = {"l2": [], "recompute": []}
    for r in range(args.rounds):
        for tag, eng in (("l2", l2), ("recompute", rc)) if r % 2 == 0 else (("recompute", rc), ("l2", l2)):
            res[tag].append(one_round(eng, prompt, want, tag))
            x = res[tag][-1]
            print(f"  round {r + 1} {tag}: resume {x['resume_s'] * 1e3:.1f} ms (preempt + evict "
                  f"{x['saved_s'] * 1e3:.1f} ms), {x['loaded']} tokens loaded from L2", flush=True)
    med = {k: statistics.median(x["resume_s"] for x in v) for k, v in res.items()}
    print(f"| context | resume from L2 ms | resume by recompute ms | ratio |\n|---:|---:|---:|---:|\n"
          f"| {args.context} | {med['l2'] * 1e3:.1f} | {med['recompute'] * 1e3:.1f} | "
          f"{med['recompute'] / med['l2']:.1f}x |")
    l2.close()
    rc.close()
    return 0
