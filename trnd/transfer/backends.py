"""Which NIXL backend moves the KV pages: `ucx` (the default; TCP or shared memory here, verbs where
there is RDMA) or `libfabric` (the EFA path on Trainium hosts; its `tcp` provider anywhere else).

UCX ships inside the nixl wheel. NIXL's LIBFABRIC plugin does not bring its libraries along: it links
libfabric.so.1 built with symbol version FABRIC_1.10 (nixl 1.5.1's plugin: libfabric 2.7, newer than
Debian's 1.17/2.1 and than the 2.6 release), libhwloc.so.15, and CUDA's libcuda.so.1 and
libcudart.so.N even in a DRAM-only process. `prepare("libfabric")` makes the plugin loadable or says in
one line why it cannot be:
- libfabric.so.1: $TRND_LIBFABRIC (the library, or a directory holding it), else the EFA installer's
  /opt/amazon/efa/lib, else the system's; loaded process-wide before NIXL opens its plugin.
- libcuda.so.1 / libcudart.so.N where no CUDA is installed: transfer/nocuda.c, built with the C compiler
  into $XDG_CACHE_HOME/trnd/nocuda (every call answers "no device"; DRAM transfers make none).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

from trnd.config import StartupError

BACKENDS = ("ucx", "libfabric")
EFA_LIB = "/opt/amazon/efa/lib"
_prepared: set[str] = set()


class BackendUnavailable(StartupError):
    """The named backend cannot load here; the message is the one line to show (exit 78, trnd/cli.py)."""


def nixl_name(backend: str) -> str:
    return {"ucx": "UCX", "libfabric": "LIBFABRIC"}[backend]


def prepare(backend: str) -> None:
    """Make `backend` loadable in this process (once), or raise BackendUnavailable."""
    if backend not in BACKENDS:
        raise BackendUnavailable(f"transfer_backend = {backend!r}: choose one of {', '.join(BACKENDS)}")
    if backend in _prepared or backend == "ucx":
        _prepared.add(backend)
        return
    plugin = plugin_path("LIBFABRIC")
    if plugin is None:
        raise BackendUnavailable("transfer_backend = libfabric: this nixl install has no LIBFABRIC plugin "
                                 "(libplugin_LIBFABRIC.so)")
    fabric = _load_libfabric()
    for _ in range(4):  # each round supplies one missing library the plugin names
        try:
            ctypes.CDLL(str(plugin), mode=os.RTLD_LAZY | os.RTLD_LOCAL)
            break
        except OSError as e:
            why = str(e)
        missing = re.search(r"(lib[\w.+-]+\.so[\w.]*): cannot open shared object", why)
        if missing and re.fullmatch(r"libcuda\.so\.1|libcudart\.so\.\d+", missing.group(1)):
            _load_nocuda(missing.group(1))
            continue
        if "FABRIC_" in why or (missing and missing.group(1) == "libfabric.so.1"):
            have = f"{fabric} lacks it" if fabric else "none was found"
            ver = re.search(r"FABRIC_[\d.]+", why)
            raise BackendUnavailable(
                f"transfer_backend = libfabric: NIXL's LIBFABRIC plugin needs libfabric.so.1 with "
                f"{ver.group(0) if ver else 'FABRIC_1.10'} (libfabric >= 2.7) and {have}; install it (the EFA "
                f"installer's {EFA_LIB} on EFA hosts) or point TRND_LIBFABRIC at one")
        raise BackendUnavailable(f"transfer_backend = libfabric: NIXL's LIBFABRIC plugin cannot load: "
                                 f"{why.splitlines()[0]}")
    else:
        raise BackendUnavailable(f"transfer_backend = libfabric: NIXL's LIBFABRIC plugin cannot load: {why}")
    _prepared.add(backend)


def plugin_path(name: str) -> Path | None:
    """The plugin NIXL itself loads: beside the nixl package the `nixl` meta-package resolves to."""
    import importlib

    try:
        api = importlib.import_module("nixl._api")
    except ImportError:
        return None
    env = os.environ.get("NIXL_PLUGIN_DIR")
    pkg = Path(api.__file__).parent
    for d in ([Path(env)] if env else []) + [pkg.parent / f".{pkg.name}.mesonpy.libs" / "plugins",
                                             pkg.parent / f"{pkg.name}.libs" / "plugins"]:
        p = d / f"libplugin_{name}.so"
        if p.exists():
            return p
    return None


def _load_libfabric() -> str | None:
    """Load the first libfabric.so.1 found process-wide (the plugin's NEEDED entry then binds to it)."""
    want = os.environ.get("TRND_LIBFABRIC")
    cands = []
    if want:
        p = Path(want)
        cands.append(p / "libfabric.so.1" if p.is_dir() else p)
    cands += [Path(EFA_LIB) / "libfabric.so.1", "libfabric.so.1"]
    for c in cands:
        try:
            lib = ctypes.CDLL(str(c), mode=os.RTLD_GLOBAL)
        except OSError:
            if want and c == cands[0]:
                raise BackendUnavailable(f"transfer_backend = libfabric: TRND_LIBFABRIC = {want}: no loadable "
                                         f"libfabric.so.1 there") from None
            continue
        return _path_of(lib) or str(c)
    return None


def _path_of(lib: ctypes.CDLL) -> str | None:
    """Where the dynamic linker found a loaded library (its handle's link_map)."""
    class LinkMap(ctypes.Structure):
        _fields_ = [("l_addr", ctypes.c_void_p), ("l_name", ctypes.c_char_p)]
    try:
        lm = ctypes.POINTER(LinkMap)()
        libdl = ctypes.CDLL(None)
        if libdl.dlinfo(ctypes.c_void_p(lib._handle), 2, ctypes.byref(lm)) == 0:  # RTLD_DI_LINKMAP
            return lm.contents.l_name.decode()
    except (AttributeError, OSError, ValueError):
        pass
    return None


def _load_nocuda(soname: str) -> None:
    src = Path(__file__).with_name("nocuda.c")
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trnd" / "nocuda"
    tag = hashlib.sha256(src.read_bytes()).hexdigest()[:12]
    out = cache / tag / soname
    if not out.exists():
        cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
        if cc is None:
            raise BackendUnavailable(f"transfer_backend = libfabric: NIXL's LIBFABRIC plugin links {soname} and "
                                     f"this host has neither it nor a C compiler to build trnd's no-device stand-in")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f"{soname}.{os.getpid()}.tmp")
        ver = ["-Wl,--default-symver"] if soname.startswith("libcudart") else []  # the plugin binds cudart@soname
        r = subprocess.run([cc, "-shared", "-fPIC", "-O2", f"-Wl,-soname,{soname}", *ver, "-o", str(tmp), str(src)],
                           capture_output=True, text=True)
        if r.returncode:
            raise BackendUnavailable(f"transfer_backend = libfabric: building the {soname} stand-in failed: "
                                     f"{(r.stderr.strip().splitlines() or ['?'])[-1]}")
        tmp.replace(out)
    ctypes.CDLL(str(out), mode=os.RTLD_GLOBAL)
