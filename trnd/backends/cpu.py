"""The default backend: the CPU. Always available; what CI runs.

Every CPU fast path is chosen from what the running CPU supports (kernels/cpuinfo.py), never from
what the build machine had: bf16 compute only where the CPU has bf16 dot products in hardware, fp32
linears in our own kernel's layout wherever the compiled kernels run, bf16
linears in our dpbf16 kernel's layout where the CPU has avx512_bf16 (on AMX tiles from 8 rows where it has
those), else oneDNN prepacking
where its bf16 reorder runs, the compiled kernels of kernels/cpu/ in the build for this
CPU's ISA where they are built (else the torch twins in kernels/; trnd_kernels.cpu.cpu_ops says which in one
log line, a WARNING where this CPU could run them).
"""

from functools import cached_property

from trnd_kernels import Ops
from trnd_kernels.cpu import LINEAR_AMX_MIN_ROWS, kernels_status, linear_amx, linear_f32_lib, linear_lib
from trnd_kernels.cpuinfo import RELEVANT, cpu_info, onednn_bf16_prepack, onednn_fp32_prepack
from trnd.backends.base import Backend


class CPUBackend(Backend):
    name = "cpu"
    device = "cpu"

    @cached_property
    def ops(self) -> Ops:
        from trnd_kernels.cpu import cpu_ops

        return cpu_ops()

    def pick_dtype(self, requested: str | None) -> tuple[str | None, str]:
        """`auto` keeps a bf16 checkpoint in bf16 where the CPU computes bf16 natively (AVX-512 BF16 or
        AMX) and loads it as float32 elsewhere: on an AVX2 + FMA CPU bf16 matmuls are emulated, measured
        4-8x slower than float32 (docs/RESULTS.md, "Compute dtype by CPU class")."""
        if requested not in (None, "auto"):
            return requested, "requested"
        if cpu_info().native_bf16:
            return None, "auto: the checkpoint's dtype (this CPU has native bf16)"
        return "float32", "auto: float32 (this CPU has no native bf16 dot products; bf16 would be emulated)"


def cpu_paths(dtype: str, why: str) -> dict[str, str]:
    """The CPU fast paths this process takes, for the start-up log line, `trnd check cpu` and bench tables."""
    info = cpu_info()
    if dtype == "float32" and linear_f32_lib() is not None:
        prepack = f"compiled {linear_f32_lib().__name__} fp32 (packed at load, bf16-valued weights at 2 bytes)"
    elif dtype == "float32" and onednn_fp32_prepack():
        prepack = "oneDNN float32 prepacked"
    elif dtype != "bfloat16":
        prepack = f"F.linear ({dtype})"
    elif linear_lib() is not None:
        amx = f", AMX from {LINEAR_AMX_MIN_ROWS} rows" if linear_amx() else ""
        prepack = f"compiled {linear_lib().__name__} dpbf16{amx} (packed at load)"
    else:
        prepack = "oneDNN bf16 prepacked" if onednn_bf16_prepack() else "F.linear (no oneDNN bf16 reorder on this CPU)"
    return {"cpu": info.model, "flags": " ".join(f for f in RELEVANT if f in info.flags) or "none", "isa": info.isa,
            "dtype": f"{dtype} ({why})", "linears": prepack, "attention": _attention_path()}


def _attention_path() -> str:
    from trnd_kernels import TORCH_OPS
    from trnd_kernels.cpu import cpu_ops

    ops = cpu_ops()
    if ops is TORCH_OPS:
        return "torch ops (gather + SDPA; RMSNorm, rotary, SiLU as torch ops)"
    c = ops.decode_attention.__self__
    return f"compiled {c.lib.__name__}" + (" with dpbf16" if c.dpbf16 else "") + \
        " (and RMSNorm, rotary, SiLU-and-mul)"


def describe(dtype: str, why: str) -> str:
    """One line: the CPU, its relevant flags and the paths chosen."""
    p = cpu_paths(dtype, why)
    return f"cpu: {cpu_info().summary()}; dtype {p['dtype']}; linears {p['linears']}; attention {p['attention']}"


def report() -> list[str]:
    """`trnd check cpu`: what this CPU is and which path each choice takes here (nothing is run but the
    probes). Figures from two CPU classes are not comparable: benches print this beside theirs."""
    import torch

    info = cpu_info()
    dtype, why = CPUBackend().pick_dtype("auto")
    paths = cpu_paths("bfloat16" if dtype is None else dtype, why)
    bf16 = cpu_paths("bfloat16", "requested")
    return [
        f"cpu:          {info.model}",
        f"flags:        {paths['flags']}",
        f"isa level:    {info.isa}" + (" (capped by TRND_CPU_ISA)" if info.capped else ""),
        f"torch:        {torch.__version__}, ATen CPU capability {torch.backends.cpu.get_cpu_capability()}, "
        f"{torch.get_num_threads()} threads",
        f"dtype:        {why}",
        f"bf16 linears: {bf16['linears']}",
        f"fp32 linears: {cpu_paths('float32', 'requested')['linears']}",
        f"attention:    {paths['attention']}",
        f"kernels:      {kernels_line()}",
    ]


def kernels_line() -> str:
    k = kernels_status()
    if k.loaded:
        return f"compiled {k.build} loaded"
    if k.slow_path:
        return f"NOT LOADED: {k.why}; the torch ops run at about half the speed"
    return f"not used: {k.why}"
