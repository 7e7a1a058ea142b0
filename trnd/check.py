"""`trnd check neuron|cuda`: the one command an operator runs on a device host.

1. Each op of the backend against its torch twin on the CPU, on shapes inside the kernels' constraints
   (so on Neuron the NKI kernels run, not the fallbacks): ragged page tables, GQA, several KV blocks,
   prefill chunks after a cached prefix.
2. A short greedy generation through `trnd.llm.LLM(model, backend=...)` against the same on the CPU.
Prints one line per comparison and PASS or FAIL. Exit status: 0 all matched, 1 a mismatch or an error,
69 (EX_UNAVAILABLE) the backend cannot run here (the message says what to install).

`trnd check cpu` prints the CPU and the paths chosen; it exits 1 where this CPU could run trnd's compiled
kernels and they do not load (an install without them serves at about half the speed).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import traceback
from dataclasses import dataclass

import torch

from trnd_kernels import TORCH_OPS
from trnd_kernels.attention import AttnMeta, PrefillSeq
from trnd_kernels.cases import make_decode_case, make_prefill_case
from trnd.backends import NAMES, Backend, BackendUnavailable, get_backend

EX_UNAVAILABLE = 69
# Initial tolerances, not yet calibrated on hardware: bf16 holds ~3 significant digits, and the Scalar
# Engine's exp/rsqrt are piecewise-polynomial approximations.
TOL = {torch.bfloat16: dict(rtol=2e-2, atol=2e-2), torch.float32: dict(rtol=2e-3, atol=2e-3)}


@dataclass
class Result:
    name: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"{'ok  ' if self.ok else 'FAIL'} {self.name}: {self.detail}"


def _to(x, device: str):
    """A case argument on the device: tensors, and the tensors inside AttnMeta / PrefillSeq."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, AttnMeta):
        return AttnMeta(x.page_ids.to(device), x.offsets.to(device), x.num_decode, x.decode_pages.to(device),
                        x.decode_ctx.to(device), x.prefill)
    if isinstance(x, PrefillSeq):
        return PrefillSeq(x.q_start, x.q_len, x.ctx_len, x.pages.to(device))
    return x


def _compare(name: str, got, want, dtype) -> Result:
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    errs = []
    for g, w in zip(got, want, strict=True):
        g, w = g.detach().cpu().float(), w.float()
        if g.shape != w.shape:
            return Result(name, False, f"shape {tuple(g.shape)} != twin's {tuple(w.shape)}")
        errs.append(((g - w).abs().max().item(), torch.allclose(g, w, **TOL[dtype])))
    worst = max(e for e, _ in errs)
    return Result(name, all(ok for _, ok in errs), f"max |device - twin| = {worst:.3g} ({dtype})")


def kernel_cases(dtype):
    """(name, op name, args built on the CPU) with shapes inside the NKI kernels' supports()."""
    g = torch.Generator().manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    from trnd_kernels.rotary import cos_sin, inv_freq

    cases = []
    for n, h in ((1, 256), (130, 512)):
        w = (torch.rand(h, generator=g) + 0.5).to(dtype)
        cases.append((f"rms_norm [{n}, {h}]", "rms_norm", (rnd(n, h, scale=3.0), w, 1e-6)))
        cases.append((f"add_rms_norm [{n}, {h}]", "add_rms_norm", (rnd(n, h), rnd(n, h), w, 1e-6)))
    for t, hq, hk, d in ((1, 8, 2, 64), (130, 16, 4, 128)):
        cos, sin = cos_sin(torch.randint(0, 32768, (t,), generator=g), inv_freq(d, 1e6, None), dtype)
        cases.append((f"apply_rotary T={t} Hq={hq} Hk={hk} D={d}", "apply_rotary",
                      (rnd(t, hq, d), rnd(t, hk, d), cos, sin)))
    for group, page_size, ctxs in ((1, 16, [1, 17, 300, 129]), (4, 16, [5, 140, 33]), (2, 128, [1, 129, 400]),
                                   (8, 64, [64, 65, 1000])):
        hk, d = 2, 128
        q, kv, meta = make_decode_case(ctxs, hk * group, hk, d, page_size, dtype=dtype, seed=page_size + group)
        cases.append((f"decode_attention G={group} P={page_size} ctx={ctxs}", "decode_attention",
                      (q, kv, 1, meta, d ** -0.5)))
    for group, page_size, prior, q_len in ((1, 16, 0, 37), (4, 64, 100, 200), (2, 128, 250, 130)):
        hk, d = 2, 128
        q, k_new, v_new, kv, seq = make_prefill_case(prior, q_len, hk * group, hk, d, page_size, dtype=dtype,
                                                     seed=prior + group)
        cases.append((f"prefill_attention G={group} P={page_size} prefix={prior} chunk={q_len}",
                      "prefill_attention", (q, k_new, v_new, kv, 1, seq, page_size, d ** -0.5)))
    return cases


def compare_kernels(backend: Backend, dtypes=(torch.bfloat16, torch.float32)) -> list[Result]:
    results = []
    for dtype in dtypes:
        for name, op, args in kernel_cases(dtype):
            want = getattr(TORCH_OPS, op)(*args)
            dev_args = tuple(_to(a, backend.device) for a in args)
            try:
                got = getattr(backend.ops, op)(*dev_args)
            except Exception as e:  # report and go on: one broken kernel should not hide the others
                results.append(Result(name, False, f"{type(e).__name__}: {e} ({dtype})"))
                continue
            results.append(_compare(name, got, want, dtype))
    return results


PROMPTS = ["The quick brown fox", "Trainium and Inferentia are", "1, 2, 3, 4,", "Once upon a time there"]


def compare_generation(backend: Backend, model_dir: str, tokens: int = 16, dtype: str | None = None) -> Result:
    """Greedy tokens on the device vs the CPU, prompt by prompt."""
    from trnd.sampling_params import SamplingParams
    from trnd.llm import LLM

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    outs = {}
    for name in ("cpu", backend.name):
        try:
            llm = LLM(str(model_dir), backend=name, dtype=dtype, num_pages=256, page_size=16, seed=0)
            outs[name] = [c.token_ids for c in llm.generate(PROMPTS, params)]
            llm.engine.close()
        except Exception as e:
            return Result(f"generate on {name}", False, f"{type(e).__name__}: {e}")
    same = [a == b for a, b in zip(outs["cpu"], outs[backend.name])]
    first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
             for a, b in zip(outs["cpu"], outs[backend.name])]
    detail = f"{sum(same)}/{len(same)} prompts identical over {tokens} greedy tokens"
    if not all(same):
        detail += f"; first differing token per prompt: {first}"
    return Result(f"greedy generation {backend.name} vs cpu", all(same), detail)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="trnd check", description="Check a device backend against the CPU: "
                                "its kernels against their torch twins, then a short greedy generation.")
    p.add_argument("backend", choices=list(NAMES), help="cpu: print the CPU, its flags and the paths chosen")
    p.add_argument("--model", metavar="DIR", help="model directory (default: a tiny random model made in a "
                                                  "temporary directory)")
    p.add_argument("--tokens", type=int, default=16, help="greedy tokens per prompt (default 16)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], help="model dtype (default: the checkpoint's)")
    if argv[:1] == ["cpu"]:  # the CPU at hand: flags and the paths chosen (nothing to compare against)
        from trnd.backends.cpu import kernels_status, report

        print("\n".join(report()))
        # exit 1 where this CPU could run the compiled kernels and they do not load: the install is broken
        return 1 if kernels_status().slow_path else 0
    args = p.parse_args(argv)
    try:
        backend = get_backend(args.backend)
    except BackendUnavailable as e:
        print(f"trnd check {args.backend}: {e}", file=sys.stderr)
        return EX_UNAVAILABLE
    ok = True
    try:
        for r in compare_kernels(backend):
            print(r.line(), flush=True)
            ok &= r.ok
        with tempfile.TemporaryDirectory(prefix="trnd-check-") as tmp:
            model = args.model
            if model is None:
                from trnd.model.maker import make_model

                model = str(make_model(f"{tmp}/tiny", preset="tiny", arch="qwen3", seed=0, dtype="float32"))
            r = compare_generation(backend, model, args.tokens, args.dtype)
            print(r.line(), flush=True)
            ok &= r.ok
    except Exception:
        traceback.print_exc()
        ok = False
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
