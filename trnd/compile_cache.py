"""The offline compile cache of a decode point: `trnd compile` builds every bucket's graph ahead of time; a
role started with `compile_cache = DIR` loads them all before READY and compiles nothing.

The graphs live in torch's own caches, pointed at DIR: TORCHINDUCTOR_CACHE_DIR = DIR/inductor holds
Inductor's FX graph cache and the AOTAutograd cache (both on by default in torch 2.13). A second process
that traces the same graph (same model shapes, bucket, dtype, pool size, torch, CPU ISA) finds each entry by
its key and skips AOTAutograd, Inductor's codegen and the C++ compile; dynamo still traces each bucket's
bytecode, which is what a cache hit costs. torch's counters (fxgraph_cache_hit / _miss) prove it: they are
the "loaded" and "compiled" of the start-up line and of /admin/state `static`.

DIR/manifest.json (msgspec JSON, never pickle) names what the graphs were built for; a role refuses a cache
built for another model, point, dtype, pool, backend, torch, trnd, CPU ISA or thread count with the field and
both values (measured: a cache built at 2 threads is all misses at 1).
The entries themselves are torch's own files (torch pickles them, and loads the shared objects it built):
whoever can write DIR runs code in the role. So DIR is trusted like the weights, built by the operator on a
host they own, never taken from the network, and a role refuses one that someone else could have written
(`trusted`, as ssh refuses a key file others can write): an entry of the tree, or a directory above it, that
is world-writable (a sticky directory such as /tmp above it excepted) or owned by a user other than the
role's own or root: one line naming compile_cache and the path, exit 78.

Backends: CPU (Inductor's C++ codegen) is what runs and is tested here. CUDA would run this very command
(Inductor again, the same two caches; the CUDA graphs are captured at start from the loaded kernels); the
Neuron backend's compiler keeps its NEFFs in its own cache. Neither is available on this host, and nothing
here claims they were run.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from importlib import metadata
from pathlib import Path

import msgspec

from trnd.config import StartupError

log = logging.getLogger("trnd.compile")

MANIFEST = "manifest.json"
FORMAT = 1
COMPILERS = {"cpu": "inductor", "cuda": "inductor", "neuron": "neuron"}  # torch.compile backend per device


class CacheManifest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What a compile cache was built for. The model is its config.json + tokenizer.json hash (the KV
    namespace's key, model/config.py: fingerprint): graphs take the weights as inputs (Inductor's freezing is
    off), so the same architecture with other weights reuses them, and another architecture never does."""
    format: int = FORMAT
    model: str  # fingerprint
    model_dir: str  # where it was built from (shown, not checked)
    point: str
    shape: str  # the point's shape contract: page size, max context, batch, chunk, buckets
    dtype: str
    kv_pages: int  # the pool's page count is a dimension of every graph (kv_memory_gb / page bytes)
    backend: str
    compiler: str
    torch: str
    trnd: str
    cpu_isa: str
    threads: int  # Inductor's C++ kernels are generated for the intra-op thread count (another count misses)
    graphs: list[tuple[str, int, int]]  # ("decode", B, W) / ("prefill", T, W)
    seconds: float = 0.0


CHECKED = ("format", "model", "point", "shape", "dtype", "kv_pages", "backend", "compiler", "torch", "trnd", "cpu_isa",
           "threads")


def trnd_version() -> str:
    try:
        return metadata.version("trnd")
    except metadata.PackageNotFoundError:
        return "unknown"


def describe(engine, point, backend: str, graphs: list | None = None) -> CacheManifest:
    """The manifest this engine's graphs would have."""
    import torch

    from trnd_kernels.cpuinfo import cpu_info
    from trnd.model.config import fingerprint

    p = point
    shape = (f"page_size {p.page_size}, max_context {p.max_context}, max_batch {p.max_batch}, prefill_chunk "
             f"{p.prefill_chunk}, decode_buckets {sorted(p.decode_buckets)}, prefill_buckets {sorted(p.prefill_buckets)}")
    return CacheManifest(model=fingerprint(Path(engine.cfg.model)), model_dir=str(engine.cfg.model), point=p.name,
                         shape=shape, dtype=str(engine.model_config.dtype).removeprefix("torch."),
                         kv_pages=engine.pool.num_pages, backend=backend, compiler=str(engine.runner.compiler),
                         torch=str(torch.__version__), trnd=trnd_version(),
                         cpu_isa=cpu_info().isa if backend == "cpu" else "-", threads=torch.get_num_threads(),
                         graphs=graphs if graphs is not None else engine.runner.buckets())


def use(cache_dir: str | Path) -> Path:
    """Point torch's compile caches at DIR (before anything compiles in this process)."""
    d = Path(os.path.expandvars(str(cache_dir))).resolve()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(d / "inductor")
    os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "1"
    os.environ["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "1"
    return d


def _untrusted(path: str, st: os.stat_result, above: bool) -> str | None:
    if st.st_uid not in (os.geteuid(), 0):
        return f"{path} is owned by uid {st.st_uid}, not by this role's user ({os.geteuid()}) or root"
    if st.st_mode & stat.S_IWOTH and not (above and stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX):
        return f"{path} is writable by every user (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def trusted(cache_dir: str | Path) -> None:
    """Raise StartupError unless only this role's user (or root) can have written DIR's tree: every entry under
    it (a link judged by what it points to) and every directory above it (ssh's rule for key files)."""
    root = Path(os.path.expandvars(str(cache_dir))).resolve()
    why = None
    for up in reversed(root.parents):
        if why := _untrusted(str(up), os.stat(up), above=True):
            break
    if why is None and root.exists():
        for top, dirs, files in os.walk(root):
            for name in [None, *dirs, *files]:
                path = top if name is None else os.path.join(top, name)
                try:
                    st = os.stat(path)
                except OSError:  # a dangling link: nothing to load
                    continue
                if why := _untrusted(path, st, above=False):
                    break
            if why:
                break
    if why:
        raise StartupError(f"compile_cache = {str(cache_dir)!r}: refused: {why}; torch loads pickles and shared "
                           f"objects from it (chmod o-w / chown it, or rebuild it with trnd compile)")


def read(cache_dir: str | Path) -> CacheManifest:
    """DIR's manifest, or one line saying why there is none to trust."""
    trusted(cache_dir)
    path = Path(os.path.expandvars(str(cache_dir))) / MANIFEST
    try:
        return msgspec.json.decode(path.read_bytes(), type=CacheManifest)
    except FileNotFoundError:
        raise StartupError(f"compile_cache = {str(cache_dir)!r}: no {MANIFEST} there (build it with "
                           "`trnd compile --point NAME --model M --out DIR`)") from None
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise StartupError(f"compile_cache = {str(cache_dir)!r}: {MANIFEST} is not a trnd compile manifest: "
                           f"{e}".replace("\n", " ")) from None


HINTS = {"kv_pages": " (the pool's pages follow kv_memory_gb: give trnd compile the roles' --kv-memory-gb)",
         "cpu_isa": " (trnd check cpu; TRND_CPU_ISA caps it)",
         "threads": " (give trnd compile the roles' --threads)"}


def mismatch(built: CacheManifest, ours: CacheManifest) -> str | None:
    for field in CHECKED:
        a, b = getattr(built, field), getattr(ours, field)
        if a != b:
            return f"{field} = {a!r} in the cache, {b!r} in this role{HINTS.get(field, '')}"
    return None


def load(engine, point, cache_dir: str | Path, built: CacheManifest) -> tuple[int, int]:
    """Check the cache against this engine, then run every bucket once (on padding that writes only the
    scratch page): each graph comes from the cache. Returns (loaded, compiled)."""
    why = mismatch(built, describe(engine, point, engine.cfg.backend))
    if why is not None:
        raise StartupError(f"compile_cache = {str(cache_dir)!r} was built for another setup: {why} (rebuild it "
                           "with trnd compile, or start without compile_cache)")
    t0 = time.perf_counter()
    engine.runner.warmup()
    loaded, compiled = engine.runner.counts()
    engine.compile_cache = str(cache_dir)
    line = (f"compile cache {cache_dir}: {loaded} graphs loaded, {compiled} compiled "
            f"({len(built.graphs)} in the manifest, {time.perf_counter() - t0:.1f} s)")
    (log.warning if compiled else log.info)(line)
    return loaded, compiled
