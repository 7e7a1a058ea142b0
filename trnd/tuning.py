"""How an engine process tunes itself before torch loads: the OpenMP spin, glibc's malloc, the CPU ISA cap,
and the huge-page re-exec. Called once by the commands that run an engine (cli.py `tune_for`) and by the
test suite's conftest; `trnd top`, the router and a plain `import trnd` leave the process as it is.
"""

from __future__ import annotations

import os

# OpenMP (libgomp, torch's CPU runtime) threads wait at barriers between ops: they spin GOMP_SPINCOUNT
# iterations (libgomp counts ~100 a microsecond), then sleep. Alone on its cores a role spins longer
# than processes that compute on shared cores at once (TP ranks; a local prefill + decode deployment
# with share_cores off), which are started with SHARED_CORES_SPINCOUNT (engine/workers.py,
# roles/local.py); a local deployment's roles take turns by default (engine/corelock.py) and keep the
# longer spin. Measured in docs/RESULTS.md, "OpenMP wait policy". Set before torch loads its OpenMP
# runtime; an operator's own settings win. The default is marked (TRND_GOMP_DEFAULT) so that a trnd
# process started by another (`trnd serve`'s roles, `trnd bench`'s servers) does not take the value its
# parent set for an operator's.
ALONE_SPINCOUNT = "20000"
SHARED_CORES_SPINCOUNT = "1000"
HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"


def omp_set_by_operator() -> bool:
    """The operator chose OpenMP's wait policy (not a value trnd set in this process or a parent)."""
    spin = os.environ.get("GOMP_SPINCOUNT")
    inherited = spin is not None and spin == os.environ.get("TRND_GOMP_DEFAULT")
    return "OMP_WAIT_POLICY" in os.environ or (spin is not None and not inherited)


def tune() -> None:
    """The engine process's tuning: the OpenMP spin, malloc's large blocks kept, the ISA cap."""
    if not omp_set_by_operator():
        os.environ["GOMP_SPINCOUNT"] = os.environ["TRND_GOMP_DEFAULT"] = ALONE_SPINCOUNT
    keep_large_blocks()
    cap_cpu_isa()


def environ_as_started() -> dict[str, str]:
    """This process's environment without the OpenMP default and the malloc tunable trnd set: for programs that
    are not trnd (a peer server or load generator in `trnd bench`), which must run as the operator started them."""
    env = dict(os.environ)
    if env.pop("TRND_GOMP_DEFAULT", None) is not None and not omp_set_by_operator():
        env.pop("GOMP_SPINCOUNT", None)
    was = env.pop("TRND_GLIBC_TUNABLES_WAS", None)  # the huge-page tunable trnd added (huge_pages_environ)
    if was is not None:
        if was:
            env["GLIBC_TUNABLES"] = was
        else:
            env.pop("GLIBC_TUNABLES", None)
    return env


def keep_large_blocks() -> None:
    """glibc serves every allocation above 128 KiB-32 MiB with a fresh mmap and returns it with munmap,
    so each step's large temporaries (the pages a decode batch attends over) are page-faulted in again,
    every layer, every step (docs/RESULTS.md, "Engine: trnd vs transformers"). vLLM's CPU docs preload
    tcmalloc for the same reason; this keeps glibc and asks it to reuse (raise the mmap threshold to 1 GiB and never trim below
    2 GiB). TRND_MALLOC_TUNE=0 leaves glibc as it is."""
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


def huge_pages_environ() -> dict[str, str] | None:
    """The environment to re-exec this process with so that glibc's malloc backs its large blocks with
    transparent huge pages (GLIBC_TUNABLES=glibc.malloc.hugetlb=1: madvise(MADV_HUGEPAGE) on what it maps):
    the weights and the KV pool are then read through 2 MiB pages, not 4 KiB ones, so a decode step's
    streams cross no page boundary every 4 KiB (where the hardware prefetcher stops) and its scattered
    page reads miss the TLB far less (docs/RESULTS.md, "CPU kernels"). A tunable is read only at process
    start, hence the re-exec (trnd/cli.py); None when there is nothing to do: TRND_MALLOC_TUNE=0, an
    operator's own glibc.malloc.hugetlb, a glibc before 2.35 (no such tunable) or not glibc, THP off."""
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


def cap_cpu_isa() -> None:
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
