"""The decode step with an earlier revision's compiled kernels against the working tree's, in one process.

    python -m trnd.bench.step_ab --rev HEAD~1 [--build trnd_avx512] [--batch 1 4 16] [--ctx 576] [--dtype bfloat16]

Why: on a shared 2-core host two runs of the same step differ by 20-40% (stolen cores), so a kernel change
is measured as the ratio of steps taken back to back, A B B A ..., and the median of those per-pair ratios
is what is reported. REV's kernels/cpu/csrc is compiled under its own op namespace (trnd_ab_<build>) and its
attention and elementwise kernels swapped into the same loaded model; the linears (packed at load,
trnd/model/layers.py) are the working tree's in both.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from trnd_kernels.cpu import CompiledOps, build, compiled, ops_table, runs_here
from trnd_kernels.cpuinfo import cpu_info
from trnd.bench.step import _swap, decode_batch

CSRC = "kernels/cpu/csrc"


def build_rev(rev: str, variant: str, work: Path):
    """torch.ops.trnd_ab_<variant>: the kernels of REV's csrc, compiled as ours are (build.VARIANTS)."""
    if why := runs_here(variant):
        raise SystemExit(f"--build {variant}: {why}")
    root = Path(subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                               check=True).stdout.strip())
    src = work / "csrc"
    src.mkdir()
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:{CSRC}"], cwd=root, capture_output=True,
                           text=True)
    if names.returncode != 0:
        raise SystemExit(f"--rev {rev!r}: no {CSRC} there ({names.stderr.strip()})")
    for name in names.stdout.split():
        blob = subprocess.run(["git", "show", f"{rev}:{CSRC}/{name}"], cwd=root, capture_output=True, check=True)
        (src / name).write_bytes(blob.stdout)
    name = f"trnd_ab_{variant.removeprefix('trnd_')}"
    torch.ops.load_library(str(build.build(name, variant=variant, src=src, out=work / name)))
    return getattr(torch.ops, name)


def main(argv=None) -> int:
    from trnd.model.loader import load_model
    from trnd.model.maker import resolve_model

    ap = argparse.ArgumentParser(prog="python -m trnd.bench.step_ab")
    ap.add_argument("--rev", required=True, help="the git revision whose kernels are A")
    ap.add_argument("--build", default="trnd_avx512", choices=sorted(build.VARIANTS))
    ap.add_argument("--model", default="small")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--ctx", type=int, nargs="+", default=[576])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--steps", type=int, default=80)
    a = ap.parse_args(argv)
    info = cpu_info()
    if a.build == "trnd_avx512" and "avx512f" not in info.flags:
        raise SystemExit(f"--build trnd_avx512: this CPU has no AVX-512 ({info.summary()})")
    dpbf16 = info.isa == "avx512_bf16" and a.build == "trnd_avx512"
    try:
        new = compiled(a.build, dpbf16)
    except RuntimeError as e:  # not built here: why, in one line
        raise SystemExit(str(e)) from None
    with tempfile.TemporaryDirectory() as tmp:
        old = ops_table(CompiledOps(build_rev(a.rev, a.build, Path(tmp)), dpbf16))
    print(f"CPU: {info.summary()}; torch threads {torch.get_num_threads()}; A = {a.rev}'s {a.build}, "
          f"B = the working tree's")
    print("| dtype | batch | ctx | A median ms | B median ms | A / B, median of per-pair ratios (p25-p75) |")
    print("|---|---:|---:|---:|---:|---|")
    model, cfg = load_model(resolve_model(a.model), a.dtype, prepack=True)
    for b in a.batch:
        for ctx in a.ctx:
            runner, x = decode_batch(model, cfg, b, ctx, a.page)
            ts = {"A": [], "B": []}
            for i in range(a.steps + 1):
                for name, ops in ((("A", old), ("B", new)) if i % 2 else (("B", new), ("A", old))):
                    _swap(model, ops)
                    t = time.perf_counter()
                    runner.forward(x)
                    if i:  # the first round warms up
                        ts[name].append(time.perf_counter() - t)
            r = sorted(ta / tb for ta, tb in zip(ts["A"], ts["B"]))
            med = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in ts.items()}
            print(f"| {a.dtype} | {b} | {ctx} | {med['A']:.2f} | {med['B']:.2f} | {r[len(r) // 2]:.3f} "
                  f"({r[len(r) // 4]:.3f}-{r[3 * len(r) // 4]:.3f}) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
