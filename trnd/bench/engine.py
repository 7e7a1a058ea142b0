"""`trnd bench engine`: trnd's engine vs transformers on the same checkpoint, side by side in one run.

Each side runs in its own child process (so peak memory is its own), one after the other, with the
same prompts. Prefill: one prompt of --prompt-len tokens, time to first token. Decode: batches of
short prompts, tokens/s over --new-tokens greedy tokens with eos ignored, prefill time subtracted.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from trnd.bench import cpu_line

DECODE_PROMPT = 64


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab - 1, (length,), generator=g).tolist() for _ in range(n)]


def _trnd_side(model: str, dtype: str, prompt_len: int, new: int, batches: list[int], tp: int = 1,
               ep: int = 1) -> dict:
    from trnd.sampling_params import SamplingParams
    from trnd.llm import LLM

    biggest = max(batches) * (DECODE_PROMPT + new) + prompt_len
    llm = LLM(model, dtype=dtype, page_size=16, num_pages=biggest // 16 + 64, max_batch=max(batches),
              prefix_cache=False, chunk_size=2048, token_budget=2048, tp=tp, ep=ep,
              threads=max(1, (os.cpu_count() or 1) // tp))
    vocab = llm.engine.model_config.vocab_size
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate(_prompts(1, 32, vocab, 99), one)  # warm-up
    res = {}
    p = _prompts(1, prompt_len, vocab, 0)
    t = time.perf_counter()
    llm.generate(p, one)
    res["prefill_s"] = time.perf_counter() - t
    for b in batches:
        res[f"decode_b{b}_s"] = _decode_s(llm, _prompts(b, DECODE_PROMPT, vocab, b), new)
    llm.engine.close()
    return res


def _decode_s(llm, ps: list[list[int]], new: int) -> float:
    """Seconds for `new` greedy tokens of every prompt, their prefill (timed alone first) subtracted."""
    from trnd.sampling_params import SamplingParams

    t = time.perf_counter()
    llm.generate(ps, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    t_pre = time.perf_counter() - t
    t = time.perf_counter()
    outs = llm.generate(ps, SamplingParams(max_tokens=new + 1, temperature=0.0, ignore_eos=True))
    total = time.perf_counter() - t
    assert all(len(o.token_ids) == new + 1 for o in outs)
    return total - t_pre


def _hf_side(model: str, dtype: str, prompt_len: int, new: int, batches: list[int]) -> dict:
    import torch
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype))
    m.eval()
    vocab = m.config.vocab_size
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None, cache_implementation="static")

    def gen(ps, n):
        with torch.inference_mode():
            return m.generate(torch.tensor(ps), max_new_tokens=n, min_new_tokens=n, **kw)

    gen(_prompts(1, 32, vocab, 99), 2)  # warm-up
    res = {}
    t = time.perf_counter()
    gen(_prompts(1, prompt_len, vocab, 0), 1)
    res["prefill_s"] = time.perf_counter() - t
    for b in batches:
        ps = _prompts(b, DECODE_PROMPT, vocab, b)
        t = time.perf_counter()
        gen(ps, 1)
        t_pre = time.perf_counter() - t
        t = time.perf_counter()
        out = gen(ps, new + 1)
        total = time.perf_counter() - t
        assert out.shape[1] == DECODE_PROMPT + new + 1
        res[f"decode_b{b}_s"] = total - t_pre
    return res


def _floor_side(model: str, dtype: str, new: int, rounds: int) -> dict:
    """Rounds of (read bandwidth, batch-1 decode step) back to back: the host's bandwidth drifts by 20% and more
    over minutes here, so a step and a floor measured apart compare two different machines."""
    from trnd.sampling_params import SamplingParams
    from trnd.llm import LLM

    llm = LLM(model, dtype=dtype, page_size=16, num_pages=(DECODE_PROMPT + new) // 16 + 64, max_batch=1,
              prefix_cache=False, chunk_size=2048, token_budget=2048, threads=os.cpu_count() or 1)
    vocab = llm.engine.model_config.vocab_size
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate(_prompts(1, 32, vocab, 99), one)  # warm-up
    out = []
    for r in range(rounds):
        bw = read_bandwidth_gbs()
        out.append((bw, _decode_s(llm, _prompts(1, DECODE_PROMPT, vocab, r), new) / new))
    llm.engine.close()
    return {"rounds": out}


def _child(side: str, args: tuple, conn) -> None:
    if side == "trnd-eager-layers":  # decode steps through the model's Python loop, not ops.decode_layers
        os.environ["TRND_DECODE_LAYERS"] = "0"
        side = "trnd"
    if side.startswith("trnd-tp"):  # trnd-tpN or trnd-tpN-epE
        fn, args = _trnd_side, (*args, *(int(n) for n in side.removeprefix("trnd-tp").split("-ep")))
    elif side == "floor":
        fn = _floor_side
    else:
        fn = _trnd_side if side == "trnd" else _hf_side
    try:
        res = fn(*args)
        res["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        conn.send(json.dumps(res))
    except BaseException as e:  # reported by the parent
        conn.send(json.dumps({"error": repr(e)}))


def run_side(side: str, args: tuple) -> dict:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_child, args=(side, args, child))
    p.start()
    res = json.loads(parent.recv())
    p.join()
    if "error" in res:
        raise RuntimeError(f"{side}: {res['error']}")
    return res


def read_bandwidth_gbs() -> float:
    """Measured memory read bandwidth: the faster of two readers (a sum over 256 MiB of fp32 and one over 256 MiB
    of bf16), each its best of five. One reader alone can be bound by its own arithmetic rather than the memory
    (on AMD Zen 4 the fp32 sum once read 27 GB/s while the bf16 one read 43.5), which would make the floor too
    low a bar; the faster one is the closer to what the cores can stream."""
    import torch

    best_gbs = 0.0
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.ones(256 * 2**20 // dtype.itemsize, dtype=dtype)  # 256 MiB
        x.sum()
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - t)
        best_gbs = max(best_gbs, x.numel() * x.element_size() / best / 1e9)
        del x
    return best_gbs


def _best(runs: list[dict]) -> dict:
    """Per metric, the best of several runs: on a shared machine the minimum is the least disturbed."""
    return {k: min(r[k] for r in runs) for k in runs[0]}


def weight_bytes(model_dir: str, dtype: str | None = None) -> int:
    """Bytes one decode step reads at least: every weight once, in the dtype it is loaded in or the checkpoint's where
    that is narrower (the compiled fp32 linears keep a bf16 checkpoint's weights at 2 bytes: csrc/linear_f32.cpp;
    FP8 and MXFP4 codes stay a byte and half a byte), and of a MoE's experts the top_k of num_experts a token is
    routed to (its active weights: at batch 1 the kernels read no other expert, csrc/moe.cpp)."""
    from safetensors import safe_open

    from trnd.model.config import ModelConfig
    from trnd.model.loader import _weight_files

    moe = ModelConfig.from_dir(model_dir).moe
    total = 0.0
    for f in set(_weight_files(__import__("pathlib").Path(model_dir)).values()):
        with safe_open(f, framework="pt") as h:
            for k in h.keys():
                sl = h.get_slice(k)
                n = 1
                for d in sl.get_shape():
                    n *= d
                stored = {"BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "U8": 1}.get(sl.get_dtype(), 4)
                size = min(stored, {"float32": 4, "bfloat16": 2, "float16": 2}.get(dtype or "", stored))
                share = moe.top_k / moe.num_experts if moe is not None and ".mlp.experts." in k else 1.0
                total += n * size * share
    return int(total)


def main(args) -> int:
    from trnd.model.maker import resolve_model

    model = str(resolve_model(args.model))
    batches = [int(b) for b in args.batches.split(",")]
    a = (model, args.dtype, args.prompt_len, args.new_tokens, batches)
    print(f"trnd bench engine: model {model}, dtype {args.dtype}, prefill {args.prompt_len} tokens, "
          f"decode {args.new_tokens} tokens at batch {batches}", flush=True)
    print(cpu_line(), flush=True)
    if args.tp > 1 and args.ep > 1:  # TP=N with the experts split into EP groups vs TP=N alone, both trnd
        ours, theirs = run_side(f"trnd-tp{args.tp}-ep{args.ep}", a), run_side(f"trnd-tp{args.tp}", a)
        print(f"comparing trnd TP={args.tp} EP={args.ep} (first column) with trnd TP={args.tp} EP=1 (second column); "
              "peak RSS is rank 0's")
    elif args.tp > 1:  # TP=1 vs TP=N, both trnd
        ours, theirs = run_side(f"trnd-tp{args.tp}", a), run_side("trnd", a)
        print(f"comparing trnd TP={args.tp} (first column) with trnd TP=1 (second column)")
    elif args.compare_dtype:  # one engine, two compute dtypes, alternated; the best of each round counts
        b = (model, args.compare_dtype, *a[2:])
        runs = [(run_side("trnd", a), run_side("trnd", b)) for _ in range(args.rounds)]
        ours, theirs = (_best([r[i] for r in runs]) for i in (0, 1))
        print(f"comparing dtype {args.dtype} (first column) with {args.compare_dtype} (second column), best of "
              f"{args.rounds} alternated round(s)")
    elif args.compare_decode_layers:  # decode steps in one call vs the Python loop over layers, alternated
        runs = [(run_side("trnd", a), run_side("trnd-eager-layers", a)) for _ in range(args.rounds)]
        ours, theirs = (_best([r[i] for r in runs]) for i in (0, 1))
        print(f"comparing decode_layers (first column) with the eager loop over layers (second column, "
              f"TRND_DECODE_LAYERS=0), best of {args.rounds} alternated round(s)")
    else:
        ours = run_side("trnd", a)
        theirs = None if args.skip_hf else run_side("hf", a)
    bw = read_bandwidth_gbs()
    wb = weight_bytes(model, args.dtype)
    rows = [("prefill tok/s", args.prompt_len / ours["prefill_s"],
             theirs and args.prompt_len / theirs["prefill_s"])]
    for b in batches:
        k = f"decode_b{b}_s"
        rows.append((f"decode tok/s b={b}", b * args.new_tokens / ours[k],
                     theirs and b * args.new_tokens / theirs[k]))
    rows.append(("peak RSS MB", ours["peak_rss_mb"], theirs and theirs["peak_rss_mb"]))
    names = ((f"TP={args.tp} EP={args.ep}", f"TP={args.tp} EP=1") if args.tp > 1 and args.ep > 1 else
             (f"trnd TP={args.tp}", "trnd TP=1") if args.tp > 1 else
             (args.dtype, args.compare_dtype) if args.compare_dtype else
             ("one call", "Python loop") if args.compare_decode_layers else ("trnd", "transformers"))
    print(f"{'metric':<20}{names[0]:>12}{names[1]:>14}{'ratio':>8}")
    for name, o, t in rows:
        ratio = f"{o / t:.2f}x" if t else "-"
        print(f"{name:<20}{o:>12.1f}{(t or 0):>14.1f}{ratio:>8}")
    step_ms = ours[f"decode_b{batches[0]}_s"] / args.new_tokens * 1e3 if batches[0] == 1 else None
    floor_ms = wb / (bw * 1e9) * 1e3
    print(f"weights {wb / 1e6:.0f} MB, measured read bandwidth {bw:.1f} GB/s -> bandwidth floor "
          f"{floor_ms:.1f} ms/step" + (f"; trnd batch-1 step {step_ms:.1f} ms = {floor_ms / step_ms:.0%} of the "
                                        "bandwidth limit" if step_ms else ""))
    if args.floor_rounds > 0:
        rounds = run_side("floor", (model, args.dtype, args.new_tokens, args.floor_rounds))["rounds"]
        print(f"\nbatch-1 step against the bandwidth floor, {args.floor_rounds} round(s) of (read bandwidth, "
              f"{args.new_tokens} decode steps) back to back:")
        print(f"{'round':>6}{'GB/s':>8}{'floor ms':>10}{'step ms':>9}{'step/floor':>12}")
        ratios = []
        for i, (gbs, step_s) in enumerate(rounds, 1):
            fl = wb / (gbs * 1e9)
            ratios.append(step_s / fl)
            print(f"{i:>6}{gbs:>8.1f}{fl * 1e3:>10.2f}{step_s * 1e3:>9.2f}{ratios[-1]:>11.2f}x")
        print(f"median step/floor {statistics.median(ratios):.2f}x (best {min(ratios):.2f}x, worst "
              f"{max(ratios):.2f}x)")
        if args.save_floor:
            from trnd.bench import current
            from trnd.bench.report import machine_facts

            facts = machine_facts()
            path = current.save_run({
                "kind": "floor", "facts": {k: facts[k] for k in ("cpu", "date", "nproc", "mem_gib", "kernel")},
                "ratio": round(statistics.median(ratios), 3), "rounds": [round(r, 3) for r in ratios],
                "dtype": args.dtype, "commit": current.commit_of(), "command": " ".join(["trnd", *sys.argv[1:]])},
                Path(args.save_floor))
            print(f"saved {path} (trnd bench report puts it in docs/RESULTS.md)")
    return 0
