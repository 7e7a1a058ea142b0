"""`trnd bench longctx`: the long-context cost curve on a decode point (default `1m`), measured, not assumed.

    trnd bench longctx [--point 1m] [--lengths 8192,16384,...] [--max-seconds 600] [--decode-steps 16]

The model is the `tiny` preset (Llama layout) with llama3 RoPE scaling, factor 128 over 8192 original
positions = 1,048,576: the role's position check (trnd/points.py) passes because the config really reaches
the point, and the rotary frequencies used are the scaled ones (kernels/rotary.py). The engine is the one a
prefill role builds for the point (roles/common.py: build_engine: page size, chunk and batch from the point,
a pool of one full-length sequence, after the same position check), on the eager path.

One prompt is served in growing prefixes: the request for length L finds the previous length's pages in the
prefix cache and computes only the new tokens, in the point's chunks, then decodes --decode-steps tokens at
context L. So the cumulative prefill time to L is what one prompt of L tokens costs chunk by chunk (chunk
boundaries also at each earlier length), and each row's decode step runs at that context (batch 1). The run
stops before a length whose predicted cost (quadratic in the context, from the last increment) would pass
--max-seconds; the table says where it stopped and why.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

ORIGINAL = 8192  # llama3 scaling's original_max_position_embeddings


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--point", default="1m", help="decode point (default 1m)")
    p.add_argument("--model", help="model dir (default: the tiny preset made with RoPE scaling to the point)")
    p.add_argument("--lengths", default="8192,16384,32768,65536,131072,262144,524288,1048576",
                   help="context lengths, ascending (the longest that fits --max-seconds is served)")
    p.add_argument("--decode-steps", type=int, default=16, help="decode steps timed at each length")
    p.add_argument("--max-seconds", type=float, default=600.0, help="stop before a length predicted past this")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=None)


def long_model(max_context: int) -> Path:
    """The tiny Llama with llama3 RoPE scaling reaching max_context (made once, cached like the presets)."""
    from trnd.model.maker import cache_dir, make_model

    factor = max(1, -(-max_context // ORIGINAL))
    out = cache_dir() / f"tiny-llama-rope{factor * ORIGINAL}"
    if not (out / "config.json").is_file():
        scaling = {"rope_type": "llama3", "factor": float(factor), "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": ORIGINAL}
        make_model(out, preset="tiny", arch="llama", seed=0, overrides={"rope_scaling": scaling})
    return out


def _engine(model_dir: Path, point_name: str, dtype: str, threads: int | None):
    """The engine a prefill role builds for the point (roles/common.py: build_engine): page size, chunk and
    batch from the point, a pool for one full-length sequence, after the same position check."""
    from trnd.backends import resolve_dtype
    from trnd.engine.build import EngineConfig, build
    from trnd.engine.engine import Engine
    from trnd.model.config import ModelConfig
    from trnd.points import check_positions, get_point

    point = get_point(point_name)
    mc = ModelConfig.from_dir(model_dir, resolve_dtype(dtype)[0])
    why = check_positions(point, mc.max_position_embeddings, mc.rope_scaling)
    if why is not None:
        raise SystemExit(why)
    engine = Engine(build(EngineConfig(model=str(model_dir), dtype=dtype, page_size=point.page_size,
                                       num_pages=point.pool_pages_needed() + 64, max_model_len=point.max_context,
                                       max_batch=point.max_batch, token_budget=point.prefill_chunk,
                                       chunk_size=point.prefill_chunk, threads=threads, role="bench")))
    return engine, point


def run_curve(engine, lengths: list[int], decode_steps: int, max_seconds: float, seed: int = 0) -> tuple[list, str]:
    """Rows (one per length served) and why the run ended."""
    import torch

    from trnd.engine.request import SamplingParams

    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, vocab, (lengths[-1],), generator=g).tolist()
    rows, cum, prev, last_inc, t_start = [], 0.0, 0, None, time.perf_counter()
    ended = "every length served"
    for L in lengths:
        if last_inc is not None and prev:
            predicted = last_inc[1] * (L * L - prev * prev) / max(1, prev * prev - last_inc[0] ** 2)
            spent = time.perf_counter() - t_start
            if spent + predicted > max_seconds:
                ended = (f"stopped before {L}: predicted {predicted:.0f} s more, past --max-seconds {max_seconds:.0f} "
                         f"({spent:.0f} s spent)")
                break
        engine.add(prompt[:L], SamplingParams(max_tokens=decode_steps + 1, temperature=0.0, ignore_eos=True),
                   rid=f"longctx-{L}")
        req = engine.scheduler.find(f"longctx-{L}")
        prefill_s, decode_ms = 0.0, []
        while engine.has_work:
            prefilling = req.num_output == 0
            t0 = time.perf_counter()
            engine.step()
            dt = time.perf_counter() - t0
            if prefilling:
                prefill_s += dt
            else:
                decode_ms.append(dt * 1e3)
        computed, cached = L - req.num_cached, req.num_cached
        cum += prefill_s
        rows.append({"context": L, "cached": cached, "computed": computed, "prefill_s": round(prefill_s, 3),
                     "cum_prefill_s": round(cum, 3), "cum_tok_s": round(L / cum, 1),
                     "inc_tok_s": round(computed / prefill_s, 1) if prefill_s else None,
                     "decode_ms": round(statistics.median(decode_ms), 3) if decode_ms else None,
                     "decode_steps": len(decode_ms)})
        print(f"  {L}: +{computed} tokens in {prefill_s:.2f} s, cumulative {cum:.1f} s; decode step "
              f"{rows[-1]['decode_ms']} ms", flush=True)
        last_inc, prev = (prev, prefill_s), L
    return rows, ended


def table(rows: list[dict]) -> str:
    out = ["| context | prefill to here s | prefill tok/s (to here) | this increment tok/s | decode step ms (batch 1) |",
           "|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['context']} | {r['cum_prefill_s']:.1f} | {r['cum_tok_s']:.0f} | {r['inc_tok_s']:.0f} | "
                   f"{r['decode_ms']:.2f} |")
    return "\n".join(out)


def main(args) -> int:
    import torch

    from trnd.bench import cpu_line
    from trnd.points import get_point

    point = get_point(args.point)
    top = point.max_context - args.decode_steps - 1  # the prompt and its decoded tokens within the point
    lengths = sorted({min(int(x), top) for x in args.lengths.split(",") if x.strip()})
    if not lengths or lengths[0] < 1:
        raise SystemExit(f"--lengths: give context lengths from 1 to {top} (the point's max_context less "
                         "--decode-steps + 1)")
    model_dir = Path(args.model) if args.model else long_model(point.max_context)
    print(cpu_line(), flush=True)
    engine, point = _engine(model_dir, args.point, args.dtype, args.threads)
    try:
        dtype = str(engine.model_config.dtype).removeprefix("torch.")
        print(f"point {point.name} (page {point.page_size}, chunk {point.prefill_chunk}), model {model_dir.name} "
              f"({dtype}, {engine.pool.num_pages} pages), torch threads {torch.get_num_threads()}", flush=True)
        rows, ended = run_curve(engine, lengths, args.decode_steps, args.max_seconds)
        engine.check_integrity()
    finally:
        engine.close()
    print(table(rows))
    print(ended)
    return 0
