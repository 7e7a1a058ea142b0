"""`trnd points`: what each decode point needs on this machine, for a model, before anything starts.

For every point: its shapes, the model's KV bytes per token in the dtype it would compute in here, the
pool one full-length sequence and the full batch at full length need per rank, what `kv_memory_gb`
really holds (tokens and full-length sequences), and whether the model reaches the point's context.
A role refuses to start where this table says "refused" or "does not fit".
"""

from __future__ import annotations

import argparse
import os
import sys

GIB = 2**30


def _mem_gib(key: str) -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024 / GIB
    except OSError:
        pass
    return 0.0


def rows(model_dir, dtype: str, tp: int, kv_memory_gb: float, kv_cache_dtype: str = "auto") -> list[dict]:
    from trnd.backends import resolve_dtype
    from trnd.engine.runner import kv_page_bytes
    from trnd.model.config import ModelConfig
    from trnd.parallel import TPGroup
    from trnd.points import capacity, check_positions, load_points

    mc = ModelConfig.from_dir(model_dir, resolve_dtype(dtype)[0])
    h0, h1 = TPGroup(0, tp).kv_heads(mc.pool.heads)
    out = []
    for name, p in sorted(load_points().items(), key=lambda kv: kv[1].max_context):
        page_bytes = kv_page_bytes(mc, h1 - h0, p.page_size, kv_cache_dtype)
        pages = int(kv_memory_gb * GIB) // page_bytes
        one = p.pool_pages_needed() * page_bytes
        cap = capacity(p, page_bytes, pages)
        positions = check_positions(p, mc.max_position_embeddings, mc.rope_scaling)
        out.append({"point": name, "max_context": p.max_context, "max_batch": p.max_batch, "page": p.page_size,
                    "kv_per_token": cap.kv_bytes_per_token, "one_seq_gib": one / GIB,
                    "full_batch_gib": one * p.max_batch / GIB, "tokens": cap.tokens,
                    "full_seqs": cap.full_length_sequences, "fits": pages >= p.pool_pages_needed(),
                    "positions": positions})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="trnd points", description="What each decode point needs on this machine "
                                 "(per role and rank), for a model, before anything starts.")
    ap.add_argument("--model", default="small", help="model dir or preset (default small)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel groups of the tp ranks (MoE models; the KV "
                                                     "per rank does not depend on it)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3", "fp8_e5m2"],
                    help="KV page format (fp8: about half the bytes per token, scales included)")
    ap.add_argument("--kv-memory-gb", type=float, default=1.0, help="the role's pool budget per rank (default 1)")
    args = ap.parse_args(argv)
    from trnd.backends import resolve_dtype
    from trnd.model.maker import resolve_model

    model = resolve_model(args.model, say=lambda msg: print(f"trnd: {msg}", file=sys.stderr))
    dtype = resolve_dtype(args.dtype)[0] or "the checkpoint's"
    print(f"model {model}, dtype {dtype}, kv_cache_dtype {args.kv_cache_dtype}, tp {args.tp}, ep {args.ep}, kv_memory_gb {args.kv_memory_gb} per rank; this machine: "
          f"{os.cpu_count()} cores, {_mem_gib('MemTotal'):.1f} GiB RAM, {_mem_gib('MemAvailable'):.1f} GiB available")
    from trnd.model.config import ModelConfig
    from trnd.model.size import model_size

    mc, size = ModelConfig.from_dir(model), model_size(model)
    print(f"weights: {mc.arch}, {size.line()} (split over the ranks)")
    if mc.moe is not None:  # each rank: 1/ep of the experts, 1/(tp/ep) of each one's rows: 1/tp of their bytes
        print(f"experts a rank: {mc.moe.num_experts // args.ep} of {mc.moe.num_experts}, each "
              f"{'whole' if args.ep == args.tp else f'split over {args.tp // args.ep} ranks'}: "
              f"{size.expert_bytes / args.tp / 2**20:.1f} MiB of expert weights a rank")
    print(f"{'point':<6}{'context':>9}{'batch':>6}{'page':>5}{'KV B/tok':>9}{'1 seq GiB':>10}{'batch GiB':>10}"
          f"{'pool tok':>10}{'full seqs':>10}  status")
    for r in rows(model, args.dtype, args.tp, args.kv_memory_gb, args.kv_cache_dtype):
        status = (f"refused: {r['positions']}" if r["positions"] else
                  "does not fit: one full-length sequence needs more than kv_memory_gb" if not r["fits"] else
                  "ok" if r["full_seqs"] >= r["max_batch"] else
                  f"ok in tokens mode: {r['full_seqs']:.2f} full-length sequences, {r['tokens'] // r['max_batch']} "
                  "tokens each at full batch")
        print(f"{r['point']:<6}{r['max_context']:>9}{r['max_batch']:>6}{r['page']:>5}{r['kv_per_token']:>9}"
              f"{r['one_seq_gib']:>10.2f}{r['full_batch_gib']:>10.1f}{r['tokens']:>10}{r['full_seqs']:>10.2f}  {status}")
    print("A prefill + decode pair on one node needs two pools (one per role, per rank) plus each role's weights; "
          "the host tier (host_cache_gb) and a store come on top.")
    return 0
