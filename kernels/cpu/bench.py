"""Microbenchmark: the compiled CPU kernels vs their torch references, one layer's call at a time.

    python -m trnd_kernels.cpu.bench [--batch 16] [--ctx 512 1024] [--dtype float32 bfloat16] [--layers 12]

Shapes default to the `small` checkpoint (12 query heads, 4 KV heads, head_dim 64, page 16). Prints the
CPU model and flags first; each time is the fastest of --iters calls (other sessions share the cores: they
only add time, so the minimum is the least noisy figure).
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch

from trnd_kernels import attention
from trnd_kernels.attention import AttnMeta, PrefillSeq
from trnd_kernels.cpu import amx_usable, compiled, load_library
from trnd_kernels.cpuinfo import cpu_info


def _time(fn, iters: int) -> float:
    fn()
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return min(ts) * 1e3  # the least disturbed call: other work on the shared cores only adds time


def _pool(b: int, ctx: int, hk: int, p: int, d: int, dt, layers: int = 2):
    per = -(-ctx // p)
    kv = torch.randn(b * per + 1, layers, 2, hk, p, d).to(dt)
    pages = torch.randperm(b * per)[: b * per].view(b, per)  # scattered pages, as after a while of serving
    return kv, pages


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m trnd_kernels.cpu.bench")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--ctx", type=int, nargs="+", default=[512, 1024],
                    help="decode contexts, and the cached prefix of each prefill chunk (0: none, prefill only)")
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--prefill", type=int, nargs="*", default=[1, 8, 32, 128],
                    help="chunk lengths for prefill attention after a --ctx prefix")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--layers", type=int, default=1,
                    help="decode calls take these pool layers in turn: 1 stays in cache, the model's 12 (small) "
                         "are read from DRAM as in a model step")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    info = cpu_info()
    print(f"CPU: {info.summary()}; torch threads {torch.get_num_threads()}")
    builds = [("avx2", "trnd_avx2", False)]
    if info.isa in ("avx512", "avx512_bf16"):
        builds.append(("avx512", "trnd_avx512", False))
    if info.isa == "avx512_bf16":
        builds.append(("avx512+dpbf16", "trnd_avx512", True))
    loaded = {name: load_library(name)[0] for _, name, _ in builds}
    amx = amx_usable(info, "trnd_avx512", loaded.get("trnd_avx512"))
    builds = [(label, compiled(name, dp, amx=amx and dp)) for label, name, dp in builds if loaded[name] is not None]
    hq, hk, d, p = a.heads, a.kv_heads, a.head_dim, a.page
    scale = d ** -0.5
    head = "| op | dtype | batch | ctx | torch ms | " + " | ".join(f"{lb} ms" for lb, _ in builds) + " | best x |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for dname in a.dtype:
        dt = getattr(torch, dname)
        for b in a.batch:
            for ctx in (c for c in a.ctx if c > 0):  # a decode row attends at least itself; 0 is a prefill prefix
                kv, pages = _pool(b, ctx, hk, p, d, dt, a.layers + 1)
                turn = itertools.cycle(range(1, a.layers + 1))  # layer 0 stays unread, as before --layers
                q = torch.randn(b, hq, d).to(dt)
                meta = AttnMeta(None, None, b, pages, torch.full((b,), ctx), [])
                ref = _time(lambda: attention.decode_attention(q, kv, next(turn), meta, scale), a.iters)
                got = [_time(lambda o=o: o.decode_attention(q, kv, next(turn), meta, scale), a.iters)
                       for _, o in builds]
                print(f"| decode_attention | {dname} | {b} | {ctx} | {ref:.3f} | "
                      + " | ".join(f"{g:.3f}" for g in got) + f" | {ref / min(got):.1f} |")
                k, v = torch.randn(b, hk, d).to(dt), torch.randn(b, hk, d).to(dt)
                wmeta = AttnMeta(pages[:, -1].contiguous(), torch.full((b,), (ctx - 1) % p), b, None, None, [])
                ref = _time(lambda: attention.write_kv(kv, 1, k, v, wmeta), a.iters)
                got = [_time(lambda o=o: o.write_kv(kv, 1, k, v, wmeta), a.iters) for _, o in builds]
                print(f"| write_kv | {dname} | {b} | 1 token each | {ref:.3f} | "
                      + " | ".join(f"{g:.3f}" for g in got) + f" | {ref / min(got):.1f} |")
        for ctx in a.ctx:
            for n in a.prefill:
                kv, pages = _pool(1, ctx + n, hk, p, d, dt)
                seq = PrefillSeq(0, n, ctx + n, pages[0])
                q, kn, vn = torch.randn(n, hq, d).to(dt), torch.randn(n, hk, d).to(dt), torch.randn(n, hk, d).to(dt)
                ref = _time(lambda: attention.prefill_attention(q, kn, vn, kv, 1, seq, p, scale), a.iters)
                got = [_time(lambda o=o: o.lib.decode_attention(
                    q, kv, 1, seq.pages[None].expand(n, -1), torch.arange(ctx + 1, ctx + n + 1), scale, 0,
                    o.dpbf16 and dt == torch.bfloat16), a.iters) for _, o in _raw(builds)]
                print(f"| prefill (rows) | {dname} | {n} q | {ctx} prefix | {ref:.3f} | "
                      + " | ".join(f"{g:.3f}" for g in got) + f" | {ref / min(got):.1f} |")
                tiles = [o for _, o in _raw(builds) if o.dpbf16 and not o.amx]
                if tiles and dt == torch.bfloat16 and d % 64 == 0:  # the dpbf16 tiles kernel (no AMX), one build
                    t = _time(lambda: tiles[0].lib.prefill_attention_dpbf16(q, kv, 1, seq.pages, ctx, scale), a.iters)
                    print(f"| prefill (dpbf16 tiles) | {dname} | {n} q | {ctx} prefix | {ref:.3f} | {t:.3f} | "
                          f"{ref / t:.1f} |")
                amx = [o for _, o in _raw(builds) if o.amx]
                if amx and dt == torch.bfloat16:  # the chunk on AMX tiles: one column, the kernel has one build
                    t = _time(lambda: amx[0].lib.prefill_attention_amx(q, kv, 1, seq.pages, ctx, scale), a.iters)
                    print(f"| prefill (AMX tiles) | {dname} | {n} q | {ctx} prefix | {ref:.3f} | {t:.3f} | "
                          f"{ref / t:.1f} |")


def _raw(builds):
    """The CompiledOps behind each table (prefill is timed through the kernel whatever PREFILL_MAX_Q says)."""
    return [(lb, o.decode_attention.__self__) for lb, o in builds]


if __name__ == "__main__":
    main()
