"""One decode step of the model: the torch ops, the compiled attention alone, and every compiled kernel,
interleaved in one process.

    python -m trnd.bench.step [--model small] [--batch 1 16] [--ctx 576 1024] [--dtype bfloat16 float32]

The three tables (kernels.TORCH_OPS; cpu_ops() with the torch RMSNorm, rotary and SiLU; kernels.cpu.cpu_ops())
are swapped into the same loaded model and timed in alternation, A B C A B C ..., so load from other work on
the shared cores falls on all alike; each figure is the fastest step of --iters. The step is ModelRunner.forward on a decode batch of B sequences
with ctx tokens of context each (their pages scattered over the pool), as the engine runs it (linears
prepacked as the eager CPU engine loads them).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch

from trnd_kernels import TORCH_OPS, Ops
from trnd_kernels.cpu import cpu_ops
from trnd_kernels.cpuinfo import cpu_info


def _swap(model, ops: Ops) -> None:
    for m in model.modules():
        if hasattr(m, "ops"):
            m.ops = ops


def decode_batch(model, cfg, b: int, ctx: int, page: int):
    """A runner over a pool of noise and a decode batch of b sequences with ctx tokens each, every page of
    them distinct and scattered over the pool (read from DRAM, as in serving)."""
    from trnd.engine.runner import ModelRunner, StepInputs, alloc_kv

    per = -(-(ctx + 1) // page)
    kv = alloc_kv(cfg, cfg.num_kv_heads, b * per + 1, page)
    kv.normal_()
    tables = torch.randperm(b * per).view(b, per).tolist()
    x = StepInputs(ids=[7] * b, positions=[ctx] * b, page_ids=[t[ctx // page] for t in tables],
                   offsets=[ctx % page] * b, decode_pages=tables, decode_ctx=[ctx + 1] * b, prefill=[],
                   sample_rows=list(range(b)))
    return ModelRunner(model, cfg, kv), x


def main(argv=None) -> int:
    from trnd.model.loader import load_model
    from trnd.model.maker import resolve_model

    ap = argparse.ArgumentParser(prog="python -m trnd.bench.step")
    ap.add_argument("--model", default="small")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--ctx", type=int, nargs="+", default=[576, 1024])
    ap.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args(argv)
    compiled = cpu_ops()
    if compiled is TORCH_OPS:
        raise SystemExit("the compiled CPU kernels are not in use here (see the log line above): nothing to compare")
    attention_only = replace(compiled, rms_norm=TORCH_OPS.rms_norm, add_rms_norm=TORCH_OPS.add_rms_norm,
                             apply_rotary=TORCH_OPS.apply_rotary, silu_and_mul=TORCH_OPS.silu_and_mul,
                             qk_norm_rotary=TORCH_OPS.qk_norm_rotary)
    variants = (("torch", TORCH_OPS), ("attention", attention_only), ("compiled", compiled))
    print(f"CPU: {cpu_info().summary()}; torch threads {torch.get_num_threads()}")
    print("| dtype | batch | ctx | torch ops ms | compiled attention ms | all compiled ms | torch / all | "
          "attention / all |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    path = resolve_model(a.model)
    for dname in a.dtype:
        model, cfg = load_model(path, dname, prepack=True)  # as the engine loads it on the CPU
        for b in a.batch:
            for ctx in a.ctx:
                runner, x = decode_batch(model, cfg, b, ctx, a.page)
                best = {name: float("inf") for name, _ in variants}
                outs = {}
                for i in range(a.iters + 1):
                    for name, ops in variants:
                        _swap(model, ops)
                        t = time.perf_counter()
                        outs[name] = runner.forward(x)
                        if i:  # the first round warms up
                            best[name] = min(best[name], time.perf_counter() - t)
                agree = (outs["torch"].argmax(-1) == outs["compiled"].argmax(-1)).float().mean().item()
                print(f"| {dname} | {b} | {ctx} | {best['torch'] * 1e3:.1f} | {best['attention'] * 1e3:.1f} | "
                      f"{best['compiled'] * 1e3:.1f} | {best['torch'] / best['compiled']:.2f} | "
                      f"{best['attention'] / best['compiled']:.2f} |  (argmax agrees on {agree:.0%} of rows)")
        del model
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
