"""Microbenchmark: the model's bf16 linears as a decode step streams them, csrc/linear.cpp vs oneDNN vs F.linear.

    python -m kernels.cpu.bench_linear [--rows 1 4 16 64 512] [--layers 12]

The `small` checkpoint's shapes (per layer qkv 1280x768, o 768x768, gate_up 4096x768, down 768x2048; the LM head
32000x768), --layers distinct copies so the weights come from DRAM as in a real step (200 MB in all, no cache
holds it). One pass is every linear once at M rows; each figure is the fastest pass of --iters, the three
variants taken in turn (A B C A B C ...) so other work on the shared cores falls on all alike. GB/s is weight
bytes over the pass: what batch 1 is bound by.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from kernels.cpu import load_library
from kernels.cpuinfo import cpu_info

LAYER = [(1280, 768), (768, 768), (4096, 768), (768, 2048)]
HEAD = (32000, 768)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kernels.cpu.bench_linear")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 512])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--iters", type=int, default=10)
    a = ap.parse_args(argv)
    info = cpu_info()
    print(f"CPU: {info.summary()}; torch threads {torch.get_num_threads()}")
    lib, why = load_library("trnd_avx512")
    if lib is None or info.isa != "avx512_bf16":
        raise SystemExit(f"the dpbf16 linear needs the AVX-512 build on an avx512_bf16 CPU: {why or info.summary()}")
    torch.manual_seed(0)
    plain = [torch.randn(n, k).bfloat16() for _ in range(a.layers) for n, k in LAYER] + [torch.randn(*HEAD).bfloat16()]
    ours = [(lib.pack_linear(w), w.shape[0]) for w in plain]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in plain]
    gb = sum(w.numel() * 2 for w in plain) / 1e9
    variants = {
        "trnd dpbf16": lambda xs: [lib.linear(xs[p.shape[1] * 2], p, n) for p, n in ours],
        "trnd AMX": lambda xs: [lib.linear_amx(xs[p.shape[1] * 2], p, n) for p, n in ours],
        "oneDNN prepacked": lambda xs: [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], o, None, "none", [], "")
                                        for w, o in zip(plain, onednn)],
        "F.linear": lambda xs: [F.linear(xs[w.shape[1]], w) for w in plain],
    }
    print(f"weights {gb * 1e3:.0f} MB a pass ({a.layers} layers + LM head)")
    print("| rows | " + " | ".join(f"{v} ms (GB/s)" for v in variants) + " | oneDNN / trnd |")
    print("|---:|" + "---:|" * (len(variants) + 1))
    for m in a.rows:
        xs = {k: torch.randn(m, k).bfloat16() for k in (768, 2048)}
        best = dict.fromkeys(variants, float("inf"))
        for i in range(a.iters + 1):
            for name, fn in variants.items():
                t = time.perf_counter()
                fn(xs)
                if i:  # the first round warms up
                    best[name] = min(best[name], time.perf_counter() - t)
        cells = " | ".join(f"{best[v] * 1e3:.2f} ({gb / best[v]:.1f})" for v in variants)
        print(f"| {m} | {cells} | {best['oneDNN prepacked'] / best['trnd dpbf16']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
