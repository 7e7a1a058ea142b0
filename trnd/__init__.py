"""trnd: an LLM serving daemon (OpenAI API, paged KV cache, disaggregated prefill/decode)."""

import os

# OpenMP (libgomp, torch's CPU runtime) threads wait at barriers between ops. Measured on the 2-core
# CI machine, bf16 1x768 @ 768x2048: spinning forever (OMP_WAIT_POLICY=ACTIVE-like default) is fast
# alone (143 us) but 47x slower when another process wants the cores (6.7 ms); sleeping at once
# (PASSIVE) survives sharing (282 us) but adds ~100 us per op alone. A short spin covers the gaps
# between one step's ops (a few us of Python each) without holding a core through the gap between steps
# or while another process wants it: 1000 iterations (~50 us). Served at concurrency 1 while other work
# shared the cores (load 3-9), the aggregated server's TPOT p50 was 49-59 ms with 20000 iterations and
# 24-27 ms with 1000 or PASSIVE (docs/RESULTS.md). Processes that know they share the cores (a local
# prefill + decode deployment, TP ranks) are started with PASSIVE. Set before torch loads its OpenMP
# runtime; an operator's own settings win.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "1000")


def _keep_large_blocks() -> None:
    """glibc serves every allocation above 128 KiB-32 MiB with a fresh mmap and returns it with munmap,
    so each step's large temporaries (the pages a decode batch attends over: 36 MB for 32 x 1100
    tokens of the small model) are page-faulted in again, every layer, every step. Measured: that
    gather 18.6 ms per layer with mmap'd blocks, 4.5 ms when blocks are reused from the heap. vLLM's
    CPU docs preload tcmalloc for the same reason; this keeps glibc and asks it to reuse (raise the
    mmap threshold to 1 GiB and never trim below 2 GiB). TRND_MALLOC_TUNE=0 leaves glibc as it is."""
    if os.environ.get("TRND_MALLOC_TUNE", "1") == "0" or not os.path.exists("/proc/self/maps"):
        return
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        libc.mallopt(m_mmap_threshold, 1 << 30)
        libc.mallopt(m_trim_threshold, 2 << 30)
    except (OSError, AttributeError):  # not glibc (musl has no mallopt tunables): nothing to do
        pass


_keep_large_blocks()


def _cap_cpu_isa() -> None:
    """TRND_CPU_ISA=avx2 (or default) makes this process behave as a CPU of that class, torch included:
    oneDNN and ATen's vectorized kernels are capped too (set before torch loads), so the fallbacks that
    an AVX2-only host takes (no bf16 prepack, fp32 compute) run, and fail, as they would there. How CI
    tests the older CPU class on an AVX-512 machine. An operator's own ONEDNN_/ATEN_ settings win."""
    level = os.environ.get("TRND_CPU_ISA", "").strip().lower()
    if level == "avx2":
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")
        os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
    elif level == "default":
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "SSE41")
        os.environ.setdefault("ATEN_CPU_CAPABILITY", "default")


_cap_cpu_isa()
