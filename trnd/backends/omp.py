"""One OpenMP thread team per process: the engine thread's.

libgomp gives every thread that starts a parallel region its own pool of workers, kept until that
thread exits. Once the workers of all pools outnumber the cores, libgomp stops letting them spin
between regions (its throttled spin count), and every torch op pays a futex wake-up: measured on 2
cores, a bf16 768x2048 linear at batch 1 took 47 us from the thread that owned the only pool and
150 us from the engine thread while the main thread (which loaded the model and warmed it up) still
held its pool: a 17 -> 26 ms decode step. So the main thread hands its pool back before the engine
thread starts (`release_threads`, unless OMP_WAIT_POLICY=PASSIVE, where nothing spins anyway), and helper
threads that copy pages stay single-threaded (`single_threaded`) instead of growing pools of their own.
"""

from __future__ import annotations

import ctypes
import functools
import os


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp torch loaded (its own copy in torch/lib), or None (another OpenMP, or none)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libgomp" in line and line.rstrip().endswith(".so.1")}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def release_threads() -> None:
    """Free the calling thread's worker pool (OpenMP 5 omp_pause_resource_all, soft pause); a later
    parallel region on this thread would start a new one. Only where workers spin (the default)."""
    if os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE":
        return  # workers never spin, so there is no throttling to avoid
    lib = _libgomp()
    if lib is not None and hasattr(lib, "omp_pause_resource_all"):
        lib.omp_pause_resource_all(1)  # omp_pause_soft


def single_threaded() -> None:
    """Parallel regions started by the calling thread run on it alone (a thread-local setting)."""
    lib = _libgomp()
    if lib is not None:
        lib.omp_set_num_threads(1)
