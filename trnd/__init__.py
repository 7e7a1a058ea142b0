"""trnd: an LLM serving daemon (OpenAI API, paged KV cache, disaggregated prefill/decode)."""

import os

# OpenMP (libgomp, torch's CPU runtime) threads wait at barriers between ops: they spin GOMP_SPINCOUNT
# iterations (libgomp counts ~100 a microsecond), then sleep. Served at concurrency 1 (docs/RESULTS.md,
# "OpenMP wait policy"): alone on the cores, 20000 (~0.2 ms) gave TPOT p50 12.7-13.1 ms, 5000 14.8, 1000
# 17.1 (the workers fall asleep in the serial gaps between a step's ops); with other work on the cores,
# 20000 gave 49-59 ms and 1000 or PASSIVE 24-27 ms (a spinning worker holds the core the thread it waits
# for needs). So a role that has its cores spins 20000; processes that compute on shared cores at once (TP
# ranks; a local prefill + decode deployment with share_cores off) are started with GOMP_SPINCOUNT=1000
# (engine/workers.py, roles/local.py); a local deployment's roles take turns by default (engine/corelock.py)
# and keep 20000. Set before torch loads its OpenMP runtime; an operator's own settings win.
# The default is marked (TRND_GOMP_DEFAULT) so that a trnd process started by another (`trnd serve`'s roles,
# `trnd bench`'s servers) does not take the value its parent set for an operator's.
SHARED_CORES_SPINCOUNT = "1000"
_inherited = os.environ.get("GOMP_SPINCOUNT") is not None and os.environ.get("GOMP_SPINCOUNT") == os.environ.get(
    "TRND_GOMP_DEFAULT")
OMP_SET_BY_OPERATOR = "OMP_WAIT_POLICY" in os.environ or ("GOMP_SPINCOUNT" in os.environ and not _inherited)
if not OMP_SET_BY_OPERATOR:
    os.environ["GOMP_SPINCOUNT"] = os.environ["TRND_GOMP_DEFAULT"] = "20000"


def environ_as_started() -> dict[str, str]:
    """This process's environment without the OpenMP default and the malloc tunable trnd set: for programs that
    are not trnd (a peer server or load generator in `trnd bench`), which must run as the operator started them."""
    env = dict(os.environ)
    if env.pop("TRND_GOMP_DEFAULT", None) is not None and not OMP_SET_BY_OPERATOR:
        env.pop("GOMP_SPINCOUNT", None)
    was = env.pop("TRND_GLIBC_TUNABLES_WAS", None)  # the huge-page tunable trnd added (huge_pages_environ)
    if was is not None:
        if was:
            env["GLIBC_TUNABLES"] = was
        else:
            env.pop("GLIBC_TUNABLES", None)
    return env


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

HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"


def huge_pages_environ() -> dict[str, str] | None:
    """The environment to re-exec this process with so that glibc's malloc backs its large blocks with
    transparent huge pages (GLIBC_TUNABLES=glibc.malloc.hugetlb=1: madvise(MADV_HUGEPAGE) on what it maps):
    the weights and the KV pool are then read through 2 MiB pages, not 4 KiB ones, so a decode step's
    streams cross no page boundary every 4 KiB (where the hardware prefetcher stops) and its scattered
    page reads miss the TLB far less. Measured on 2 cores (docs/RESULTS.md, "CPU kernels"): the `small`
    model's decode step at batch 16, 22.8-23.7 -> 20.0-21.1 ms. A tunable is read only at process start,
    hence the re-exec (trnd/cli.py); None when there is nothing to do: TRND_MALLOC_TUNE=0, an operator's
    own glibc.malloc.hugetlb, a glibc before 2.35 (no such tunable) or not glibc, THP off ("never")."""
    if os.environ.get("TRND_MALLOC_TUNE", "1") == "0" or "glibc.malloc.hugetlb" in os.environ.get(
            "GLIBC_TUNABLES", ""):
        return None
    try:
        lib, version = os.confstr("CS_GNU_LIBC_VERSION").split()
        if lib != "glibc" or tuple(int(x) for x in version.split(".")[:2]) < (2, 35):
            return None
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[never]" in f.read():
                return None
    except (ValueError, OSError, AttributeError):  # no confstr name, no THP in this kernel
        return None
    env = dict(os.environ)
    env["TRND_GLIBC_TUNABLES_WAS"] = env.get("GLIBC_TUNABLES", "")  # for environ_as_started: not the peer's
    env["GLIBC_TUNABLES"] = ":".join(filter(None, (env.get("GLIBC_TUNABLES"), HUGE_PAGES_TUNABLE)))
    return env


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
