"""Build the compiled CPU kernels once, at install: the package build runs it (setup.py's build_kernels, for
`pip install`, `pip wheel`, `python -m build` and `make venv`'s editable install), and `python -m
trnd_kernels.cpu.build` runs it again in a checkout after csrc/ changed.

The sources (csrc/*.cpp), one shared library per ISA level, each registering its ops in its own
namespace (torch.ops.trnd_avx2, torch.ops.trnd_avx512) so both can be loaded in one process (the tests
compare them). The flags name ISA levels explicitly, never -march=native: a build made on an AVX-512 host
must still run on an AVX2-only one. The AVX-512 build is made on every host (it only needs the compiler),
and is loaded only where kernels/cpuinfo.py finds AVX-512 (kernels/cpu/__init__.py's load_library): building
never loads what it built, since even the op registration that runs at load is compiled for the variant's
ISA (gcc vectorises torch's schema inference with zmm registers: SIGILL on an AVX2-only CPU).

Each library lands in kernels/cpu/build/<name>/ (in a wheel: trnd_kernels/cpu/build/<name>/) with a stamp of the torch version it was built against and a
digest of the sources and flags it was built from; kernels/cpu/__init__.py loads nothing whose stamps do not
match (the C++ ABI is torch's; a build from older sources would run old code, or lack an op, without a word).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE / "csrc"
BUILD = Path(os.environ.get("TRND_KERNELS_BUILD", HERE / "build"))

# name -> compiler flags. avx512 carries avx512bf16 only inside the functions that use it (target attribute).
VARIANTS = {
    "trnd_avx2": ["-mavx2", "-mfma", "-mf16c"],
    "trnd_avx512": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"],
}
SOURCES = ("attention.cpp", "decode_layers.cpp", "elementwise.cpp", "linear.cpp", "linear_f32.cpp", "moe.cpp",
           "prefill_amx.cpp", "prefill_dpbf16.cpp", "prefill_f32.cpp")
# name -> the kernels/cpuinfo.py level a CPU needs to run it
REQUIRES = {"trnd_avx2": "avx2", "trnd_avx512": "avx512"}
COMMON = ["-O3", "-std=c++17", "-fopenmp", "-fno-math-errno", "-ffp-contract=off"]  # no FMA not written as one


def library_path(name: str) -> Path:
    return BUILD / name / f"{name}.so"


def stamp_path(name: str) -> Path:
    return BUILD / name / "torch_version"


def digest_path(name: str) -> Path:
    return BUILD / name / "source_digest"


def source_digest(variant: str, src: Path = SRC) -> str:
    """What a build of `variant` is made of: every file in src (the .cpp and the headers they include) and the
    flags. The stamp beside a build; load_library compares it with the checkout's."""
    h = hashlib.sha256()
    for f in sorted(p for p in src.iterdir() if p.is_file()):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    h.update(" ".join(COMMON + VARIANTS[variant]).encode())
    return h.hexdigest()[:16]


class BuildError(RuntimeError):
    """The kernels cannot be built here: one line saying why (the package build fails with it)."""


def compiler_missing() -> str:
    """"" where torch's cpp_extension finds a C++ compiler ($CXX, else c++), else why not."""
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx.split()[0]) is None:
        return (f"no C++ compiler ({'$CXX=' + cxx if 'CXX' in os.environ else 'c++'} not found): install g++ "
                "(Debian: apt-get install g++) to build trnd's CPU kernels")
    return ""


def is_current(d: Path, name: str) -> bool:
    """d holds a build of `name` made from these sources and flags for the torch running this."""
    import torch

    so, stamp, digest = d / f"{name}.so", d / "torch_version", d / "source_digest"
    return (so.exists() and stamp.exists() and digest.exists() and stamp.read_text().strip() == torch.__version__
            and digest.read_text().strip() == source_digest(name))


def build_into(dest: Path, work: Path | None = None, verbose: bool = False) -> list[Path]:
    """Every variant's library and stamps into dest/<name>/ (a wheel's trnd_kernels/cpu/build): copied from the
    checkout's build where that one is current (is_current: same sources, flags and torch, so the same bytes
    compile again), else compiled in work/<name> (ninja's objects stay there, out of the wheel). Raises
    BuildError where nothing can be compiled; x86-64 only (the variants are x86 ISA levels)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        print(f"trnd_kernels.cpu.build: {platform.machine()} is not x86-64; no CPU kernels (the torch ops run)")
        return []
    out = []
    for name in VARIANTS:
        src_dir = BUILD / name
        if not is_current(src_dir, name):
            if why := compiler_missing():
                raise BuildError(why)
            t = time.monotonic()
            src_dir = (work or BUILD) / name
            build(name, verbose=verbose, out=src_dir)
            print(f"trnd_kernels.cpu.build: compiled {name} ({time.monotonic() - t:.0f} s)")
        d = dest / name
        if d.resolve() != src_dir.resolve():
            d.mkdir(parents=True, exist_ok=True)
            for f in (f"{name}.so", "torch_version", "source_digest"):
                shutil.copy2(src_dir / f, d / f)
        out.append(d / f"{name}.so")
    return out


def build(name: str, verbose: bool = False, variant: str | None = None, src: Path = SRC,
          out: Path | None = None) -> Path:
    """Compile VARIANTS[variant or name] from src into out (default BUILD/name) as ops in torch.ops.<name>.
    Another name, src and out build an earlier revision's sources beside ours (trnd/bench/step_ab.py)."""
    import torch
    from torch.utils import cpp_extension

    # ninja from the venv (the Makefile installs the PyPI wheel there when the system has none)
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    out = out or BUILD / name
    out.mkdir(parents=True, exist_ok=True)
    # cpp_extension.load() would also load the library into this process; its ninja step alone does not
    # (private, but torch is pinned: the Makefile and pyproject name the version).
    cpp_extension._write_ninja_file_and_build_library(
        # an earlier revision may predate a source file; ours must have every one (a missing file fails here)
        name=name, sources=[str(src / f) for f in SOURCES if src == SRC or (src / f).exists()],
        extra_cflags=COMMON + VARIANTS[variant or name] + [f"-DTRND_LIB={name}"], extra_cuda_cflags=[],
        extra_sycl_cflags=[], extra_ldflags=["-fopenmp"], extra_include_paths=[str(src)],
        build_directory=str(out), verbose=verbose, with_cuda=False, with_sycl=False)
    (out / "torch_version").write_text(torch.__version__)
    (out / "source_digest").write_text(source_digest(variant or name, src))
    return out / f"{name}.so"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trnd_kernels.cpu.build", description=__doc__.splitlines()[0])
    ap.add_argument("--clean", action="store_true", help="remove earlier builds first")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    if why := compiler_missing():
        print(f"trnd_kernels.cpu.build: {why}", file=sys.stderr)
        return 1
    if args.clean:
        shutil.rmtree(BUILD, ignore_errors=True)
    try:
        for path in build_into(BUILD, verbose=args.verbose):
            print(f"trnd_kernels.cpu.build: {path}")
    except BuildError as e:
        print(f"trnd_kernels.cpu.build: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
