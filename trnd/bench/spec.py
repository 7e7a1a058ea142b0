"""`trnd bench spec`: speculative decoding against the same engine without it, side by side in one run.

Each setting runs in its own child process holding two engines, one without speculation and one with
it, their rounds interleaved (off, on, on, off, ...) on the same prompts: c requests at once (c = each of
--concurrency), --new-tokens greedy tokens each with eos ignored. TPOT is per request (first token to
last over the tokens between), output tok/s over the wall time of a round; the figure of each side is its
median over the rounds, after one unmeasured round at each concurrency (the speculator's payoff measure
learns each batch size once in a server's life: its first drafted step there, a draft model's catch-up of
whole prompts included, is not what a running server pays per request). `held` is the share of the
speculating engine's steps that its payoff measure (engine/spec/payoff.py) ran without drafts;
--always-draft turns that off. Random-weight checkpoints
accept little, so the settings say where drafts can be right:

  draft-target  the draft model is the target itself (a second copy, its own pages): every drafted token is
                kept, so it shows what the machinery gains and costs when drafts are right; each draft token
                costs a forward of the target, so it cannot be faster than the target's own steps.
  ngram-loop    n-gram lookup on prompts whose answer repeats the context: each prompt is a random prompt
                followed by the target's own greedy continuation of it, long enough to have entered the cycle
                a random-weight model settles in, so the answer repeats what the prompt already holds (an
                edited file's unchanged lines are this case with a trained model). The acceptance printed is
                what it measured.
  ngram-random  n-gram lookup on random prompts: little repeats, acceptance near 0 (what it costs to look).
  draft-mini    a draft 1/10 of the target's width with unrelated random weights: acceptance 0, the
                speculator backs off (engine/spec/speculator.py, payoff.py); what drafting costs when it
                never pays.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import statistics
import time

from trnd.bench import cpu_line

SETTINGS = ("draft-target", "ngram-loop", "ngram-random", "draft-mini")


def add_arguments(p) -> None:
    p.add_argument("--model", default="small", help="target: model dir or preset (default small)")
    p.add_argument("--dtype", default="float32", help="compute dtype (default float32: the fast one on AVX2 hosts)")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens (default 4)")
    p.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of {', '.join(SETTINGS)}")
    p.add_argument("--concurrency", default="1,4", help="requests at once (default 1,4)")
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--always-draft", action="store_true",
                   help="draft at every step (adaptive false, vLLM's way) rather than where it measured to pay")
    p.add_argument("--rounds", type=int, default=4, help="rounds per side, interleaved (default 4)")


def _mini_draft(target: str) -> str:
    """A random checkpoint with the target's tokenizer and a tenth of its width: an unrelated draft."""
    from pathlib import Path

    from trnd.model.config import ModelConfig
    from trnd.model.maker import make_model

    mc = ModelConfig.from_dir(target)
    out = Path(target).parent / f"{Path(target).name}-mini-draft"
    if not (out / "config.json").exists():
        preset = "small" if mc.hidden_size >= 256 else "tiny"
        make_model(out, preset=preset, seed=99, dtype="float32",
                   overrides={"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2,
                              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16})
    return str(out)


def _prompts(llm, setting: str, n: int, length: int, new: int) -> list[list[int]]:
    import torch

    from trnd.sampling_params import SamplingParams

    vocab = llm.engine.model_config.vocab_size
    g = torch.Generator().manual_seed(7)
    rand = [torch.randint(10, vocab - 1, (length,), generator=g).tolist() for _ in range(n)]
    if setting != "ngram-loop":
        return rand
    cont = llm.generate(rand, SamplingParams(max_tokens=length, temperature=0.0, ignore_eos=True))
    return [p + c.token_ids for p, c in zip(rand, cont)]


def _engine(model: str, dtype: str, spec: dict | None, cmax: int, prompt_len: int, new: int):
    from trnd.config import SpeculativeConfig
    from trnd.llm import LLM

    return LLM(model, dtype=dtype, page_size=16, num_pages=cmax * (3 * prompt_len + new + 64) // 16 + 64,
               max_batch=cmax, chunk_size=1024, token_budget=2048, prefix_cache=False,
               speculative=SpeculativeConfig(**spec) if spec else None)


def _round(llm, prompts: list[list[int]], params) -> tuple[list[float], float]:
    """One round: the prompts at once, to the end -> each request's TPOT (s) and the round's output tok/s."""
    t_first, t_last, n_out = {}, {}, {}
    for p in prompts:
        llm.engine.add(p, params)
    t0 = time.perf_counter()
    while llm.engine.has_work:
        for o in llm.engine.step():
            now = time.perf_counter()
            if o.token_ids:
                t_first.setdefault(o.rid, now)
                t_last[o.rid] = now
                n_out[o.rid] = n_out.get(o.rid, 0) + len(o.token_ids)
    wall = time.perf_counter() - t0
    return [(t_last[r] - t_first[r]) / (n_out[r] - 1) for r in n_out], sum(n_out.values()) / wall


def _side(model: str, dtype: str, setting: str, spec: dict, concurrency: list[int], new: int,
          prompt_len: int, rounds: int) -> dict:
    """Both engines in this one process, their rounds interleaved (off, on, on, off, ...) on the same prompts,
    so a drift of the machine's speed (a shared host) lands on both sides alike."""
    from trnd.sampling_params import SamplingParams

    cmax = max(concurrency)
    off = _engine(model, dtype, None, cmax, prompt_len, new)
    on = _engine(model, dtype, spec, cmax, prompt_len, new)
    prompts = _prompts(off, setting, cmax * rounds, prompt_len, new)
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    for llm in (off, on):  # warm-up
        llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    out = {"off": {}, "on": {}}
    for c in concurrency:
        runs = {"off": ([], []), "on": ([], [])}
        for llm in (off, on):  # one unmeasured round: what the payoff learns once per batch size is not timed
            _round(llm, prompts[:c], params)
        before = _counts(on)
        for r in range(rounds):
            ps = prompts[r * cmax: r * cmax + c]
            for side in (("off", "on") if r % 2 == 0 else ("on", "off")):
                tpots, rate = _round(off if side == "off" else on, ps, params)
                runs[side][0].extend(tpots)
                runs[side][1].append(rate)
        after = _counts(on)
        drafted, accepted = after[0] - before[0], after[1] - before[1]
        for side, (tpots, rates) in runs.items():
            out[side][f"c{c}"] = {"tpot_ms": statistics.median(tpots) * 1e3, "tok_s": statistics.median(rates),
                                  "acceptance": accepted / drafted if drafted else None, "drafted": drafted,
                                  "held": (after[2] - before[2]) / max(after[3] - before[3], 1)}
    if on.engine.spec is not None and on.engine.spec.draft is not None:
        out["on"]["prefill"] = _prefill_costs(on, prompts[0][:prompt_len])
    off.engine.close()
    on.engine.close()
    return out


def _prefill_costs(llm, prompt: list[int]) -> dict:
    """What the draft's prompt KV costs where it is prefilled on the decode server (a PD handoff brings the
    target's pages only): the draft's forward over the prompt, against the target's prefill of it. Best of 3."""
    from trnd.engine.request import Req
    from trnd.sampling_params import SamplingParams

    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    draft, target = [], []
    for i in range(3):
        req = Req(prompt, one, rid=f"draft-prefill-{i}")
        t = time.perf_counter()
        llm.engine.spec.draft.propose([(req, 0)])  # k = 0: the catch-up forward only
        draft.append(time.perf_counter() - t)
        llm.engine.spec.release(req.rid)
        t = time.perf_counter()
        llm.generate([prompt], one)
        target.append(time.perf_counter() - t)
    return {"tokens": len(prompt), "draft_ms": min(draft) * 1e3, "target_ms": min(target) * 1e3}


def _counts(llm) -> tuple[int, int, int, int]:
    """Tokens drafted, accepted, steps held back from drafting (it measured slower), engine steps."""
    s = llm.engine.spec
    held = s.payoff.plain_steps if s is not None and s.payoff is not None else 0
    return (s.stats.num_draft_tokens, s.stats.num_accepted_tokens, held, llm.engine.stats.steps) if s is not None \
        else (0, 0, 0, 0)


def _child(args: tuple, conn) -> None:
    try:
        conn.send(json.dumps(_side(*args)))
    except BaseException as e:  # reported by the parent
        conn.send(json.dumps({"error": repr(e)}))


def run_side(args: tuple) -> dict:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_child, args=(args, child))
    p.start()
    res = json.loads(parent.recv())
    p.join()
    if "error" in res:
        raise RuntimeError(res["error"])
    return res


def spec_config(setting: str, model: str, k: int, adaptive: bool = True) -> dict:
    if setting.startswith("ngram"):
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 5,
                "adaptive": adaptive}
    return {"method": "draft", "num_speculative_tokens": k, "adaptive": adaptive,
            "model": model if setting == "draft-target" else _mini_draft(model)}


def main(args) -> int:
    from trnd.model.maker import resolve_model

    model = str(resolve_model(args.model))
    settings = [s for s in args.settings.split(",") if s]
    bad = [s for s in settings if s not in SETTINGS]
    if bad:
        print(f"trnd bench spec: --settings: {', '.join(bad)} not one of {', '.join(SETTINGS)}")
        return 2
    conc = [int(c) for c in args.concurrency.split(",")]
    print(f"trnd bench spec: target {model}, dtype {args.dtype}, K={args.k}, {args.new_tokens} greedy tokens after "
          f"{args.prompt_len}-token prompts, concurrency {conc}, median of {args.rounds} rounds, "
          f"{'drafting at every step' if args.always_draft else 'adaptive (drafting where it measured to pay)'}",
          flush=True)
    print(cpu_line(), flush=True)
    print(f"{'setting':<14}{'c':>3}{'TPOT ms off':>13}{'on':>8}{'ratio':>8}{'tok/s off':>11}{'on':>8}{'ratio':>8}"
          f"{'accept':>8}{'held':>6}")
    for setting in settings:
        spec = spec_config(setting, model, args.k, adaptive=not args.always_draft)
        a = (model, args.dtype, setting)
        rest = (conc, args.new_tokens, args.prompt_len, args.rounds)
        both = run_side((*a, spec, *rest))
        off, on = both["off"], both["on"]
        for c in conc:
            x, y = off[f"c{c}"], on[f"c{c}"]
            acc = "-" if y["acceptance"] is None else f"{y['acceptance']:.0%}"
            print(f"{setting:<14}{c:>3}{x['tpot_ms']:>13.2f}{y['tpot_ms']:>8.2f}{y['tpot_ms'] / x['tpot_ms']:>7.2f}x"
                  f"{x['tok_s']:>11.1f}{y['tok_s']:>8.1f}{y['tok_s'] / x['tok_s']:>7.2f}x{acc:>8}"
                  f"{y['held']:>6.0%}", flush=True)
        if "prefill" in on:
            pf = on["prefill"]
            print(f"{'':<14}the draft's KV for a {pf['tokens']}-token prompt, prefilled on decode: {pf['draft_ms']:.1f} ms "
                  f"(the target's prefill of it: {pf['target_ms']:.1f} ms)", flush=True)
    return 0
