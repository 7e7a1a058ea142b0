"""`trnd bench kv-accuracy`: fp8 KV pages against model-dtype KV, with transformers as the oracle.

For each prompt: the model-dtype engine's greedy continuation (`gen` tokens) is the reference sequence;
transformers computes its logits in one forward (teacher-forced), and trnd computes them the way it
serves, with its KV pool of each format: the prompt as one prefill, then one decode step per token (so
every fp8 scale grows and requantizes as it does when serving). Reported: max and mean |logit
difference| against transformers and fp8 against model-dtype, the top-1 agreement of the teacher-forced
positions, and how many free-running fp8 greedy continuations equal the model-dtype ones token for token.
"""

from __future__ import annotations

import time

import torch

from trnd_kernels.attention import AttnMeta, PrefillSeq
from trnd.engine.runner import alloc_kv
from trnd.model.loader import load_model

FORMATS = ("auto", "fp8_e4m3", "fp8_e5m2")


@torch.no_grad()
def trnd_logits(model, kv: torch.Tensor, ids: list[int], prompt_len: int, page_size: int) -> torch.Tensor:
    """Logits predicting ids[prompt_len:] (and one past the end): [len(ids) - prompt_len + 1, vocab]."""
    n_pages = -(-len(ids) // page_size)
    pages = list(range(n_pages))
    t = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    p = prompt_len
    meta = AttnMeta(t([pages[i // page_size] for i in range(p)]), t([i % page_size for i in range(p)]), 0, None,
                    None, [PrefillSeq(0, p, p, t(pages[: -(-p // page_size)]))])
    out = [model(t(ids[:p]), t(list(range(p))), kv, meta, t([p - 1]))[0].float()]
    for i in range(p, len(ids)):
        table = pages[: i // page_size + 1]
        meta = AttnMeta(t([table[-1]]), t([i % page_size]), 1, t([table]), t([i + 1]), [])
        out.append(model(t([ids[i]]), t([i]), kv, meta, t([0]))[0].float())
    return torch.stack(out)


def measure(model_dir: str, prompts: list[list[int]], gen: int, dtype: str = "float32", page_size: int = 16,
            formats=FORMATS, hf: bool = True) -> dict:
    """{format: {max_abs, mean_abs, top1, vs_hf_max, vs_hf_mean, same_greedy}} (auto's fp8 fields vs itself)."""
    from trnd.engine.request import SamplingParams
    from trnd.llm import LLM

    greedy = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)
    pool_pages = -(-(max(map(len, prompts)) + gen + 1) // page_size)
    runs = {f: [c.token_ids for c in LLM(model_dir, dtype=dtype, page_size=page_size, num_pages=8 * pool_pages + 64,
                                         kv_cache_dtype=f).generate(prompts, greedy)] for f in formats}
    model, mc = load_model(model_dir, dtype)
    ref_model = None
    if hf:
        import transformers

        ref_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    logits = {f: [] for f in formats}
    oracle = []
    for prompt, cont in zip(prompts, runs["auto"]):
        ids = prompt + cont[:-1]  # the reference sequence: predict cont[0..gen-1] from prompt + cont[:i]
        for f in formats:
            kv = alloc_kv(mc, mc.pool.heads, pool_pages, page_size, kv_cache_dtype=f)
            logits[f].append(trnd_logits(model, kv, ids, len(prompt), page_size))
        if ref_model is not None:
            with torch.no_grad():
                oracle.append(ref_model(torch.tensor([ids])).logits[0, len(prompt) - 1:].float())
    out = {}
    for f in formats:
        d = torch.cat([(a - b).abs().flatten() for a, b in zip(logits[f], logits["auto"])])
        top1 = torch.cat([(a.argmax(-1) == b.argmax(-1)) for a, b in zip(logits[f], logits["auto"])])
        r = {"max_abs": d.max().item(), "mean_abs": d.mean().item(), "top1": top1.float().mean().item(),
             "same_greedy": sum(a == b for a, b in zip(runs[f], runs["auto"])), "n": len(prompts),
             "logit_std": torch.cat([b.flatten() for b in logits["auto"]]).std().item()}
        if oracle:
            h = torch.cat([(a - b).abs().flatten() for a, b in zip(logits[f], oracle)])
            ht = torch.cat([(a.argmax(-1) == b.argmax(-1)) for a, b in zip(logits[f], oracle)])
            r |= {"vs_hf_max": h.max().item(), "vs_hf_mean": h.mean().item(), "vs_hf_top1": ht.float().mean().item()}
        out[f] = r
    return out


def main(args) -> int:
    from trnd.bench import cpu_line
    from trnd.model.maker import resolve_model

    model = str(resolve_model(args.model))
    vocab = load_model(model, args.dtype)[1].vocab_size
    g = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(args.min_len, args.max_len + 1, (args.prompts,), generator=g).tolist()
    prompts = [torch.randint(3, vocab - 1, (n,), generator=g).tolist() for n in lengths]
    t = time.perf_counter()
    res = measure(model, prompts, args.gen, args.dtype, args.page_size)
    print(cpu_line())
    print(f"model {args.model} ({args.dtype}), {args.prompts} prompts of {args.min_len}-{args.max_len} tokens x "
          f"{args.gen} generated, page_size {args.page_size} ({time.perf_counter() - t:.0f} s)")
    print(f"logits (auto KV): std {res['auto']['logit_std']:.3f}; top-1: argmax of the teacher-forced positions; "
          "same greedy: free-running continuations equal token for token")
    print("| KV | max abs logit diff vs auto | mean | top-1 agree vs auto | same greedy | max / mean vs HF | "
          "top-1 vs HF |")
    print("|---|---|---|---|---|---|---|")
    for f, r in res.items():
        print(f"| {f} | {r['max_abs']:.4f} | {r['mean_abs']:.5f} | {r['top1']:.4f} | {r['same_greedy']}/{r['n']} | "
              f"{r.get('vs_hf_max', float('nan')):.3g} / {r.get('vs_hf_mean', float('nan')):.3g} | "
              f"{r.get('vs_hf_top1', float('nan')):.4f} |")
    return 0


def add_arguments(p) -> None:
    p.add_argument("--model", default="small", help="model dir or preset (default small)")
    p.add_argument("--dtype", default="float32", help="model dtype (the auto KV's dtype; default float32)")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=200)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
