"""Microbenchmark: the model's linears as a decode step streams them, ours (csrc/linear.cpp for bf16,
csrc/linear_f32.cpp for fp32) vs oneDNN's prepacked matmul vs F.linear.

    python -m trnd_kernels.cpu.bench_linear [--rows 1 4 16 64 512] [--layers 12] [--dtype bfloat16|float32]
                                       [--build trnd_avx2|trnd_avx512]

The `small` checkpoint's shapes (per layer qkv 1280x768, o 768x768, gate_up 4096x768, down 768x2048; the LM head
32000x768), --layers distinct copies so the weights come from DRAM as in a real step (200 MB in bf16, 400 MB in
fp32: no cache holds it). One pass is every linear once at M rows; each figure is the fastest pass of --iters,
the variants taken in turn (A B C A B C ...) so other work on the shared cores falls on all alike. GB/s is weight
bytes over the pass: what batch 1 is bound by. fp32 runs the build for this CPU, or --build's (the AVX2 one on
an AVX-512 host; to stand in for an AVX2-only CPU, cap oneDNN and MKL too: ONEDNN_MAX_CPU_ISA=AVX2
MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from trnd_kernels.cpu import load_library, variant_for
from trnd_kernels.cpuinfo import cpu_info

LAYER = [(1280, 768), (768, 768), (4096, 768), (768, 2048)]
HEAD = (32000, 768)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trnd_kernels.cpu.bench_linear")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 512])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--build", choices=["trnd_avx2", "trnd_avx512"], help="fp32: the build to run (default: this CPU's)")
    a = ap.parse_args(argv)
    info = cpu_info()
    dtype = getattr(torch, a.dtype)
    print(f"CPU: {info.summary()}; torch threads {torch.get_num_threads()}; ATen CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}")
    name = a.build or variant_for(info) if a.dtype == "float32" else "trnd_avx512"
    lib, why = load_library(name) if name else (None, f"no build for {info.summary()}")
    if lib is None or (a.dtype == "bfloat16" and info.isa != "avx512_bf16"):
        raise SystemExit(f"our {a.dtype} linear does not run here: {why or info.summary()}")
    torch.manual_seed(0)
    # bf16 values, as a bf16 checkpoint's weights are in any compute dtype (fp32 packs them at half the bytes too)
    plain = [torch.randn(*s).to(torch.bfloat16).to(dtype) for s in [*LAYER * a.layers, HEAD]]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in plain]
    gb = sum(w.numel() * w.element_size() for w in plain) / 1e9
    if a.dtype == "float32":
        ours = [(lib.pack_linear_f32(w), w.shape[0]) for w in plain]
        halves = [(lib.pack_linear_f32(w, True), w.shape[0]) for w in plain]
        variants = {f"trnd {name} fp32": lambda xs: [lib.linear_f32(xs[p.shape[1]], p, n) for p, n in ours],
                    f"trnd {name} fp32, bf16-packed": lambda xs: [lib.linear_f32(xs[p.shape[1]], p, n)
                                                                 for p, n in halves]}
    else:
        ours = [(lib.pack_linear(w), w.shape[0]) for w in plain]
        variants = {"trnd dpbf16": lambda xs: [lib.linear(xs[p.shape[1] * 2], p, n) for p, n in ours]}
        if lib.amx_ready() and "amx_bf16" in info.flags:
            variants["trnd AMX"] = lambda xs: [lib.linear_amx(xs[p.shape[1] * 2], p, n) for p, n in ours]
    variants |= {
        "oneDNN prepacked": lambda xs: [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], o, None, "none", [], "")
                                        for w, o in zip(plain, onednn)],
        "F.linear": lambda xs: [F.linear(xs[w.shape[1]], w) for w in plain],
    }
    first = next(iter(variants))
    print(f"weights {gb * 1e3:.0f} MB a pass ({a.layers} layers + LM head)")
    print("| rows | " + " | ".join(f"{v} ms (GB/s)" for v in variants) + " | oneDNN / trnd |")
    print("|---:|" + "---:|" * (len(variants) + 1))
    for m in a.rows:
        xs = {k: torch.randn(m, k).to(dtype) for k in (768, 2048)}
        best = dict.fromkeys(variants, float("inf"))
        for i in range(a.iters + 1):
            for name, fn in variants.items():
                t = time.perf_counter()
                fn(xs)
                if i:  # the first round warms up
                    best[name] = min(best[name], time.perf_counter() - t)
        cells = " | ".join(f"{best[v] * 1e3:.2f} ({gb / best[v]:.1f})" for v in variants)
        print(f"| {m} | {cells} | {best['oneDNN prepacked'] / best[first]:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
