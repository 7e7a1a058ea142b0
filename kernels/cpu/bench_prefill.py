"""Microbenchmark: fp32 prefill attention, ours (csrc/prefill_f32.cpp) vs torch's flash kernel (the fallback, with
the context gathered out of the pages as kernels/attention.py does).

    python -m trnd_kernels.cpu.bench_prefill [--q-len 512] [--prior 0 1536] [--build trnd_avx2|trnd_avx512]

The `small` checkpoint's attention shape (12 query heads, 4 KV heads, head_dim 64), one chunk of --q-len queries
after --prior cached tokens, over the 12 layers of one pool (pages shuffled over it, as in serving). Each figure is
the fastest of --iters passes, the two taken in turn (A B A B ...) so other work on the shared cores falls on both
alike. GFLOP/s counts the causal products only (4 * heads * head_dim * visible keys summed over the queries).
To stand in for an AVX2-only CPU on an AVX-512 host, run --build trnd_avx2 with ATEN_CPU_CAPABILITY=avx2 (torch's
flash kernel follows ATen's capability).
"""

from __future__ import annotations

import argparse
import time

import torch

from trnd_kernels import attention
from trnd_kernels.cases import make_prefill_case
from trnd_kernels.cpu import load_library, variant_for
from trnd_kernels.cpuinfo import cpu_info

HQ, HK, D, LAYERS, PAGE = 12, 4, 64, 12, 16


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trnd_kernels.cpu.bench_prefill")
    ap.add_argument("--q-len", type=int, default=512)
    ap.add_argument("--prior", type=int, nargs="+", default=[0, 1536])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--build", choices=["trnd_avx2", "trnd_avx512"], help="the build to run (default: this CPU's)")
    a = ap.parse_args(argv)
    info = cpu_info()
    name = a.build or variant_for(info)
    lib, why = load_library(name) if name else (None, f"no build for {info.summary()}")
    if lib is None or not hasattr(lib, "prefill_attention_f32"):
        raise SystemExit(f"our fp32 prefill attention does not run here: {why or name + ' has no such op'}")
    print(f"CPU: {info.summary()}; torch threads {torch.get_num_threads()}; ATen CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}; build {name}")
    print("| prior | queries | ours ms (GFLOP/s) | torch flash ms (GFLOP/s) | flash / ours |")
    print("|---:|---:|---:|---:|---:|")
    for prior in a.prior:
        q, k_new, v_new, kv, seq = make_prefill_case(prior, a.q_len, HQ, HK, D, PAGE, layers=LAYERS)
        scale = D ** -0.5
        variants = {
            "ours": lambda: [lib.prefill_attention_f32(q, kv, i, seq.pages, prior, scale) for i in range(LAYERS)],
            "flash": lambda: [attention.prefill_attention(q, k_new, v_new, kv, i, seq, PAGE, scale)
                              for i in range(LAYERS)]}
        best = {k: float("inf") for k in variants}
        for _ in range(a.iters):
            for k, f in variants.items():
                t = time.perf_counter()
                f()
                best[k] = min(best[k], time.perf_counter() - t)
        flops = 4 * HQ * D * sum(prior + i + 1 for i in range(a.q_len)) * LAYERS / 1e9
        print(f"| {prior} | {a.q_len} | {best['ours'] * 1e3:.1f} ({flops / best['ours']:.0f}) | "
              f"{best['flash'] * 1e3:.1f} ({flops / best['flash']:.0f}) | {best['flash'] / best['ours']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
