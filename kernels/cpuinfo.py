"""What the running CPU can do, probed once: every CPU fast path is chosen from this, never assumed.

The CPU class changes from host to host (AVX-512 with bf16 on one, AVX2 + FMA only on the next), so a
path is taken only when the running CPU supports it, and each has a fallback that works everywhere.
`TRND_CPU_ISA` caps the level for testing the fallbacks on any host: `avx2` behaves as an AVX2 + FMA
CPU (no AVX-512, no native bf16), `default` as one with neither.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from functools import lru_cache

# Flags that decide a path; everything else in /proc/cpuinfo is noise for us.
RELEVANT = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "amx_bf16",
            "avx_ne_convert")
LEVELS = ("default", "avx2", "avx512", "avx512_bf16")  # lowest first
ISA_ENV = "TRND_CPU_ISA"


@dataclass(frozen=True)
class CpuInfo:
    model: str
    flags: frozenset[str]  # the RELEVANT flags the CPU has (after any TRND_CPU_ISA cap)
    isa: str  # one of LEVELS: the highest the CPU supports (after the cap)
    capped: bool  # TRND_CPU_ISA lowered it

    @property
    def native_bf16(self) -> bool:
        """bf16 dot products in hardware (AVX-512 BF16 or AMX): bf16 compute is fast, not emulated."""
        return self.isa == "avx512_bf16"

    def summary(self) -> str:
        shown = " ".join(f for f in RELEVANT if f in self.flags) or "none"
        cap = f" (capped by {ISA_ENV}={self.isa})" if self.capped else ""
        return f"{self.model}; flags: {shown}; isa {self.isa}{cap}"


@lru_cache(maxsize=1)
def _read_cpuinfo() -> tuple[str, str, frozenset[str]]:
    """(model name with x86 family and model, vendor_id, flags) from /proc/cpuinfo, read once."""
    model, vendor, flags, ids = platform.processor() or platform.machine(), "", set(), {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model in ("", platform.machine(), platform.processor()):
                    model = value.strip()
                elif key == "vendor_id" and not vendor:
                    vendor = value.strip()
                elif key in ("cpu family", "model") and key not in ids:
                    ids[key] = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    if "cpu family" in ids and "model" in ids:
        # A VM's model name can hide the generation ("AMD EPYC" on Zen 3, 4 and 5 alike): family and model
        # tell the CPU classes apart in every figure's cpu line.
        model = f"{model} (family {ids['cpu family']} model {ids['model']})"
    return model, vendor, frozenset(flags)


def _level(flags: set[str]) -> str:
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return "avx512_bf16" if flags & {"avx512_bf16", "amx_bf16"} else "avx512"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return "default"


def _cap(flags: set[str], level: str) -> set[str]:
    """The flags a CPU of `level` would have: the cap removes what that class lacks."""
    if level in ("avx512", "avx512_bf16"):
        return flags if level == "avx512_bf16" else flags - {"avx512_bf16", "amx_bf16", "avx_ne_convert"}
    out = {f for f in flags if not f.startswith(("avx512", "amx")) and f != "avx_ne_convert"}
    return out if level == "avx2" else out - {"avx2", "fma"}


@lru_cache(maxsize=1)
def cpu_info() -> CpuInfo:
    model, _, flags = _read_cpuinfo()
    level = _level(flags)
    want = os.environ.get(ISA_ENV, "").strip().lower()
    capped = False
    if want:
        if want not in LEVELS:
            raise ValueError(f"{ISA_ENV}={want!r}: not one of {', '.join(LEVELS)}")
        if LEVELS.index(want) < LEVELS.index(level):
            flags, level, capped = _cap(flags, want), want, True
    return CpuInfo(model=model, flags=frozenset(f for f in RELEVANT if f in flags), isa=level, capped=capped)


@lru_cache(maxsize=1)
def hardware_isa() -> str:
    """The level the silicon has, whatever TRND_CPU_ISA says: what decides whether a build can be loaded at
    all (the cap only chooses which path runs; a capped AVX-512 host can still load the AVX-512 build)."""
    return _level(_read_cpuinfo()[2])


def vendor() -> str:
    """/proc/cpuinfo's vendor_id (GenuineIntel, AuthenticAMD), "" where there is none."""
    return _read_cpuinfo()[1]


def _onednn_prepack_runs(dtype) -> bool:
    """oneDNN's matmul on a reordered weight of `dtype` runs here and is right: tried on a tiny weight, since
    torch's error message is the only authority on what it needs."""
    import torch

    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.eye(16, dtype=dtype), 1)
        y = torch.ops.mkldnn._linear_pointwise(torch.ones(1, 16, dtype=dtype), w, None, "none", [], "")
        return bool(torch.equal(y, torch.ones(1, 16, dtype=dtype)))
    except RuntimeError:
        return False


@lru_cache(maxsize=1)
def onednn_fp32_prepack() -> bool:
    """fp32 linears go through oneDNN's prepacked matmul, not F.linear: on AMD CPUs, where the BLAS that torch's
    F.linear calls for fp32 (MKL) is slow at decode's few rows. AMD EPYC Zen 3, weights 2304x768, 768x768,
    6144x768, 768x3072 and 32000x768 summed (2 threads): 1 row 11.5 -> 6.6 ms, 4 rows 41.5 -> 16.1, 16 rows
    61.7 -> 27.8, 512 rows (no 32000x768) 145.5 -> 131.8 (docs/RESULTS-history.md, "Serving on an AVX2-only
    AMD EPYC (Zen 3)"). Not measured on Intel, where MKL is at home: F.linear stays there. Tried once."""
    import torch

    return vendor() == "AuthenticAMD" and _onednn_prepack_runs(torch.float32)


@lru_cache(maxsize=1)
def onednn_bf16_prepack() -> bool:
    """oneDNN's bf16 weight reorder runs here: tried once on a tiny weight, since torch's message
    ("bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl and avx512dq") is the only
    authority on what it needs. False under a TRND_CPU_ISA cap below avx512."""
    import torch

    return cpu_info().isa not in ("default", "avx2") and _onednn_prepack_runs(torch.bfloat16)
