"""The compiled CPU kernels (csrc/, built at install by build.py) as entries of the CPU backend's Ops table.

`cpu_ops()` picks the build for the running CPU (kernels/cpuinfo.py: AVX-512 where present, with dpbf16
where avx512_bf16 is, else AVX2 + FMA) and says in one log line what it uses, or why it falls back to the
torch ops (no build, a build for another torch, a CPU below AVX2, TRND_CPU_KERNELS=0). Each entry also
falls back to its torch twin for inputs the kernel does not take (another dtype, device or head_dim), so
the table is always complete.

`linear_lib()` is the bf16 linears' kernel (csrc/linear.cpp) and `linear_f32_lib()` the fp32 linears'
(csrc/linear_f32.cpp), not Ops entries: a linear owns its weight, packed into the kernel's layout at load (trnd/model/layers.py), so the
choice is made once there.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from functools import lru_cache

import torch

from trnd_kernels import TORCH_OPS, Ops, activation, attention, moe, norm, rotary, sampling
from trnd_kernels.cpuinfo import LEVELS, CpuInfo, cpu_info, hardware_isa

log = logging.getLogger("trnd.kernels")

ENV = "TRND_CPU_KERNELS"  # "0" turns the compiled kernels off (to measure or bisect against the torch ops)
MAX_HEAD_DIM = MAX_PAGE = 256  # csrc/attention.cpp's MAX_D, MAX_P
MAX_ROW = 16384  # csrc/elementwise.cpp's MAX_ROW
MAX_HEAD = 512  # csrc/elementwise.cpp's MAX_HEAD (qk_norm_rotary)
# Chunks up to this many query tokens go through the decode kernel (one row per query token); longer ones
# to the AMX kernel where the CPU has AMX, else to the dpbf16 tiles kernel where the CPU has avx512_bf16, else
# to torch's flash kernel, which tiles the queries (measured in docs/RESULTS.md).
PREFILL_MAX_Q = 8
# A bf16 chunk the tiles kernel does not take (head_dim not a multiple of 64) whose whole context is at most
# this long also goes through the decode kernel's dpbf16 rows: faster than torch's flash kernel there (AMD
# Zen 4, one layer: 512 queries, no prefix 3.80 vs 6.17 ms; after 512 cached 10.3 vs 13.8), slower past it (512
# after 2048 31.1 vs 28.7), as each row reads its whole context while flash shares a block's K/V loads.
ROWS_MAX_CTX = 1024
# The AMX, dpbf16 and fp32 tiles prefill kernels copy the context's K/V (fp32: K) into their operands' order first
# (csrc/prefill_amx.cpp, csrc/prefill_dpbf16.cpp, csrc/prefill_f32.cpp): contexts whose copy would be larger go to
# torch's flash kernel.
AMX_MAX_LAYOUT_BYTES = 64 * 2**20
# The fp32 tiles prefill kernel against torch's flash kernel (`python -m trnd_kernels.cpu.bench_prefill`, AMD Zen 4, the
# `small` model's 12 layers, 512 queries): the AVX-512 build 1.0-1.9x at every cached prefix up to 3584; the AVX2
# build (flash at ATen's AVX2) 1.15-1.68x while the prefix is at most the chunk, 0.86-0.93x past it (flash's blocked
# GEMMs win the square part; ours, the causal triangle it skips). Past this prefix/chunk ratio the AVX2 build
# leaves the chunk to flash.
F32_TILES_AVX2_MAX_PRIOR = 1.0
# A linear of at least this many rows runs on AMX tiles (csrc/linear.cpp's linear_amx) where the CPU has them;
# fewer go to the dpbf16 tiles, which the weight stream bounds there. Intel Sapphire Rapids, the `small`
# model's linears (kernels.cpu.bench_linear): dpbf16 15.6 / AMX 20.7 ms at 1 row, 20.2 / 20.3 at 8, 32.6 /
# 20.3 at 16.
LINEAR_AMX_MIN_ROWS = 8


def variant_for(info: CpuInfo) -> str | None:
    if info.isa in ("avx512", "avx512_bf16"):
        return "trnd_avx512"
    if info.isa == "avx2":
        return "trnd_avx2"
    return None


def amx_usable(info: CpuInfo, name: str, lib) -> bool:
    """The AMX prefill kernel can run: the AVX-512 build loaded, the CPU has amx_bf16, Linux grants the tiles."""
    return name == "trnd_avx512" and lib is not None and "amx_bf16" in info.flags and lib.amx_ready()


def runs_here(variant: str) -> str:
    """"" if this CPU can run a build of `variant` (build.VARIANTS), else why not: loading one it cannot run
    dies of SIGILL at once (its op registration is compiled for that ISA too), with no Python error to catch."""
    from trnd_kernels.cpu import build

    need, have = build.REQUIRES[variant], hardware_isa()
    if LEVELS.index(have) >= LEVELS.index(need):
        return ""
    return f"{variant} needs a CPU with {need}; this one is {have} ({cpu_info().model})"


# Why a build did not load, by kind (KernelsStatus.kind). The first three are a CPU that could run compiled
# kernels running the torch ops instead (the "slow path": a WARNING at start, /metrics, trnd check cpu fails);
# a build for another torch is refused at start (a wheel installed beside the wrong torch: reinstall).
MISSING, STALE, BROKEN, OTHER_TORCH = "missing", "stale", "broken", "other_torch"
SLOW_PATH = (MISSING, STALE, BROKEN, OTHER_TORCH)


def _load(name: str) -> tuple[object | None, str, str]:
    """(torch.ops.<name> with its ops loaded, "", "loaded") or (None, why not, its kind)."""
    from trnd_kernels.cpu import build

    path, stamp = build.library_path(name), build.stamp_path(name)
    if why := runs_here(name):
        return None, why, "unsupported"
    if not path.exists():
        return None, (f"{path} is not built (the package build makes it: `pip install`, `make venv`; in a "
                      "checkout `python -m trnd_kernels.cpu.build`)"), MISSING
    built_for = stamp.read_text().strip() if stamp.exists() else "an unknown torch"
    if built_for != torch.__version__:
        return None, (f"{path} was built for torch {built_for}, this is torch {torch.__version__}: install the trnd "
                      f"built for this torch (or rebuild it)"), OTHER_TORCH
    digest = build.digest_path(name)
    if build.SRC.is_dir() and (not digest.exists() or digest.read_text().strip() != build.source_digest(name)):
        return None, (f"{path} was built from other sources than {build.SRC} (changed since): rebuild it "
                      "(`python -m trnd_kernels.cpu.build`; `make venv` does)"), STALE
    try:
        torch.ops.load_library(str(path))
    except OSError as e:
        return None, f"{path} does not load ({e})", BROKEN
    _register_fakes(name)
    return getattr(torch.ops, name), "", "loaded"


def load_library(name: str) -> tuple[object | None, str]:
    """torch.ops.<name> with its ops loaded, or None and why not."""
    lib, why, _ = _load(name)
    return lib, why


_FAKES: set[str] = set()


def _register_fakes(name: str) -> None:
    """Shapes for tracing (engine/static.py compiles the model with dynamo): the ops are opaque there."""
    if name in _FAKES:
        return
    _FAKES.add(name)
    torch.library.register_fake(f"{name}::decode_attention")(
        lambda q, kv, layer, pages, ctx, scale, split_pages, dpbf16: q.new_empty(q.shape))
    torch.library.register_fake(f"{name}::write_kv")(lambda kv, layer, k, v, page_ids, offsets: None)
    torch.library.register_fake(f"{name}::rms_norm")(lambda x, w, eps: x.new_empty(x.shape))
    torch.library.register_fake(f"{name}::add_rms_norm")(lambda x, r, w, eps: (x.new_empty(x.shape), x.new_empty(x.shape)))
    torch.library.register_fake(f"{name}::apply_rotary")(lambda q, k, cos, sin: (q.new_empty(q.shape), k.new_empty(k.shape)))
    torch.library.register_fake(f"{name}::silu_and_mul")(
        lambda x: x.new_empty((x.shape[0], x.shape[1] // 2)))
    torch.library.register_fake(f"{name}::prefill_attention_amx")(
        lambda q, kv, layer, pages, prior, scale: q.new_empty(q.shape))
    if name == "trnd_avx512":  # the AVX-512 build's own ops
        torch.library.register_fake(f"{name}::prefill_attention_dpbf16")(
            lambda q, kv, layer, pages, prior, scale: q.new_empty(q.shape))
        # The bf16 linears (csrc/linear.cpp): a traced model with packed weights calls them at every Linear.
        for op in ("linear", "linear_amx"):
            torch.library.register_fake(f"{name}::{op}")(lambda x, packed, n: x.new_empty((x.shape[0], n)))
    if hasattr(getattr(torch.ops, name), "linear_f32"):  # a build older than csrc/linear_f32.cpp has none
        torch.library.register_fake(f"{name}::linear_f32")(lambda x, packed, n: x.new_empty((x.shape[0], n)))
    if hasattr(getattr(torch.ops, name), "prefill_attention_f32"):  # nor one older than csrc/prefill_f32.cpp
        torch.library.register_fake(f"{name}::prefill_attention_f32")(
            lambda q, kv, layer, pages, prior, scale: q.new_empty(q.shape))
    if hasattr(getattr(torch.ops, name), "argmax_rows"):  # nor one older than the argmax
        torch.library.register_fake(f"{name}::argmax_rows")(lambda x: x.new_empty((x.shape[0],), dtype=torch.long))
    if hasattr(getattr(torch.ops, name), "moe_route"):  # nor one older than csrc/moe.cpp
        torch.library.register_fake(f"{name}::moe_route")(
            lambda logits, k, softmax_first, renormalize: (logits.new_empty((logits.shape[0], k), dtype=torch.int32),
                                                           logits.new_empty((logits.shape[0], k), dtype=torch.float32)))
        torch.library.register_fake(f"{name}::moe_experts")(
            lambda x, ids, weights, w13, s13, w2, s2, b13, b2, first, inter, fmt, group, act, alpha, limit:
            x.new_empty(x.shape))
        torch.library.register_fake(f"{name}::qlinear")(
            lambda x, packed, scales, n, fmt, group: x.new_empty((x.shape[0], n)))
    torch.library.register_fake(f"{name}::qk_norm_rotary")(
        lambda q, k, qw, kw, eps, cos, sin: (q.new_empty(q.shape), k.new_empty(k.shape)))


class CompiledOps:
    """The Ops entries over one build's torch ops; the torch twin where the kernel does not apply."""

    def __init__(self, lib, dpbf16: bool, amx: bool = False):
        self.lib, self.dpbf16, self.amx = lib, dpbf16, amx
        # known once, not asked per chunk: a build without the fp32 tiles, and the AVX2 build's prefix rule
        self.f32_tiles = hasattr(lib, "prefill_attention_f32")
        self.name = lib.__name__.removeprefix("torch.ops.")  # trnd_avx2 | trnd_avx512
        self.avx2 = self.name == "trnd_avx2"
        self.moe = hasattr(lib, "moe_route")  # a build older than csrc/moe.cpp has none

    def _dpbf16(self, kv: torch.Tensor) -> bool:
        """The attention kernels dot bf16 pages with dpbf16 (where the CPU has it)."""
        return self.dpbf16 and kv.dtype == torch.bfloat16

    @staticmethod
    def takes(q: torch.Tensor, kv: torch.Tensor) -> bool:
        return (q.device.type == "cpu" and q.dtype == kv.dtype and kv.dtype in (torch.float32, torch.bfloat16)
                and kv.shape[5] % 16 == 0 and kv.shape[5] <= MAX_HEAD_DIM and kv.shape[4] <= MAX_PAGE)

    def takes_amx(self, q: torch.Tensor, kv: torch.Tensor, seq) -> bool:
        """The AMX prefill kernel takes it: a bf16 pool (not fp8: its pages are another shape), head_dim a multiple
        of 32, pages of whole 16-key tiles, a context whose V fits the kernel's copy."""
        if not (self.amx and kv.dtype == torch.bfloat16 and self.takes(q, kv)):
            return False
        d = kv.shape[5]
        return d % 32 == 0 and kv.shape[4] % 16 == 0 and 2 * seq.ctx_len * kv.shape[3] * d <= AMX_MAX_LAYOUT_BYTES

    @staticmethod
    def rows(x: torch.Tensor, width: int) -> bool:
        """An elementwise kernel takes it: CPU, fp32/bf16, rows a multiple of 16 wide (both builds' lanes)."""
        return (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and x.stride(-1) == 1
                and width % 16 == 0 and width <= MAX_ROW)

    def rms_norm(self, x, weight, eps):
        if not (self.rows(x, x.shape[-1]) and weight.dtype == x.dtype):
            return norm.rms_norm(x, weight, eps)
        return self.lib.rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        if not (self.rows(x, x.shape[-1]) and residual.dtype == weight.dtype == x.dtype):
            return norm.add_rms_norm(x, residual, weight, eps)
        return self.lib.add_rms_norm(x, residual, weight, eps)

    def apply_rotary(self, q, k, cos, sin):
        if not (q.dim() == 3 and self.rows(q, q.shape[-1] // 2) and k.stride(-1) == 1
                and k.dtype == cos.dtype == sin.dtype == q.dtype):
            return rotary.apply_rotary(q, k, cos, sin)
        return self.lib.apply_rotary(q, k, cos, sin)

    def qk_norm_rotary(self, q, k, q_weight, k_weight, eps, cos, sin):
        if not (q.dim() == 3 and self.rows(q, q.shape[-1] // 2) and k.stride(-1) == 1 and q.shape[-1] <= MAX_HEAD
                and k.dtype == cos.dtype == sin.dtype == q_weight.dtype == k_weight.dtype == q.dtype):
            return rotary.qk_norm_rotary(q, k, q_weight, k_weight, eps, cos, sin, self.rms_norm, self.apply_rotary)
        return self.lib.qk_norm_rotary(q, k, q_weight, k_weight, eps, cos, sin)

    def silu_and_mul(self, gate_up):
        if not (gate_up.dim() == 2 and self.rows(gate_up, gate_up.shape[-1] // 2)):
            return activation.silu_and_mul(gate_up)
        return self.lib.silu_and_mul(gate_up)

    def moe_route(self, logits, top_k, router, renormalize):
        """Top k and gating in one pass over each token's router logits (csrc/moe.cpp)."""
        if not (self.moe and logits.device.type == "cpu" and logits.dim() == 2 and logits.is_contiguous()
                and logits.dtype in (torch.float32, torch.bfloat16) and logits.shape[1] <= 1024):
            return moe.route(logits, top_k, router, renormalize)
        return self.lib.moe_route(logits, top_k, router == "softmax_topk", renormalize)

    def argmax(self, logits):
        if not (logits.device.type == "cpu" and logits.dim() == 2 and logits.dtype in (torch.float32, torch.bfloat16)
                and logits.shape[1] > 0 and logits.stride(1) == 1):
            return sampling.argmax(logits)
        return self.lib.argmax_rows(logits)

    def write_kv(self, kv, layer, k, v, meta) -> None:
        if not self.takes(k, kv):
            return attention.write_kv(kv, layer, k, v, meta)
        self.lib.write_kv(kv, layer, k, v, meta.page_ids, meta.offsets)

    def decode_attention(self, q, kv, layer, meta, scale, sinks=None, window=0):
        if sinks is not None or window or not self.takes(q, kv):  # the kernels have no sinks nor windows yet
            return attention.decode_attention(q, kv, layer, meta, scale, sinks, window)
        return self.lib.decode_attention(q, kv, layer, meta.decode_pages, meta.decode_ctx, scale, 0,
                                         self._dpbf16(kv))

    def takes_tiles(self, q: torch.Tensor, kv: torch.Tensor, seq) -> bool:
        """The dpbf16 tiles prefill kernel takes it: avx512_bf16 without AMX, a bf16 pool, head_dim a multiple
        of 64, a context whose K and V copies fit."""
        if not (self.dpbf16 and not self.amx and kv.dtype == torch.bfloat16 and self.takes(q, kv)):
            return False
        d = kv.shape[5]
        return d % 64 == 0 and 4 * seq.ctx_len * kv.shape[3] * d <= AMX_MAX_LAYOUT_BYTES

    def takes_f32_tiles(self, q: torch.Tensor, kv: torch.Tensor, seq) -> bool:
        """The fp32 tiles prefill kernel (csrc/prefill_f32.cpp, both builds) takes it: an fp32 pool, head_dim a
        multiple of 32, a context whose laid-out K fits, and on the AVX2 build a cached prefix no longer than the
        chunk (F32_TILES_AVX2_MAX_PRIOR); a build older than the kernel has none."""
        if not (kv.dtype == torch.float32 and self.f32_tiles and self.takes(q, kv)):
            return False
        d = kv.shape[5]
        if self.avx2 and seq.ctx_len - seq.q_len > F32_TILES_AVX2_MAX_PRIOR * seq.q_len:
            return False
        return d % 32 == 0 and 4 * seq.ctx_len * kv.shape[3] * d <= AMX_MAX_LAYOUT_BYTES

    def takes_rows(self, kv: torch.Tensor, seq) -> bool:
        """A chunk the decode kernel runs fastest as one row per query: a short one, or (dpbf16, bf16 pool)
        one of a short context."""
        return seq.q_len <= PREFILL_MAX_Q or (self._dpbf16(kv) and seq.ctx_len <= ROWS_MAX_CTX)

    def prefill_attention(self, q, k_new, v_new, kv, layer, seq, page_size, scale, sinks=None, window=0):
        """A chunk after its K/V are in the pages (the model writes before it attends): a longer one on AMX
        tiles where the CPU has them, else on dpbf16 tiles where it has avx512_bf16, or on fp32 tiles from an
        fp32 pool; a short one, or one of a short context on a bf16 pool (dpbf16), as decode rows (query i of
        the chunk attends the sequence's pages up to its own position); else torch's flash kernel. Sinks and
        sliding windows (GPT-OSS) take the torch reference."""
        if sinks is not None or window:
            return attention.prefill_attention(q, k_new, v_new, kv, layer, seq, page_size, scale, sinks, window)
        if seq.q_len > PREFILL_MAX_Q and self.takes_amx(q, kv, seq):
            return self.lib.prefill_attention_amx(q, kv, layer, seq.pages, seq.ctx_len - seq.q_len, scale)
        if seq.q_len > PREFILL_MAX_Q and self.takes_tiles(q, kv, seq):
            return self.lib.prefill_attention_dpbf16(q, kv, layer, seq.pages, seq.ctx_len - seq.q_len, scale)
        if seq.q_len > PREFILL_MAX_Q and self.takes_f32_tiles(q, kv, seq):
            return self.lib.prefill_attention_f32(q, kv, layer, seq.pages, seq.ctx_len - seq.q_len, scale)
        if not self.takes(q, kv) or not self.takes_rows(kv, seq):
            return attention.prefill_attention(q, k_new, v_new, kv, layer, seq, page_size, scale)
        prior = seq.ctx_len - seq.q_len
        ctx = torch.arange(prior + 1, seq.ctx_len + 1, dtype=torch.long)
        pages = seq.pages[None].expand(seq.q_len, -1)
        return self.lib.decode_attention(q, kv, layer, pages, ctx, scale, 0, self._dpbf16(kv))

    def decode_layers_refuses(self, dtype: torch.dtype, hidden: int, head_dim: int, intermediate: int) -> str:
        """Why decode_layers' chain of kernels does not take a model of these widths ("" if it does): the same
        conditions the entries above check per call (rows, takes), decided once for the model."""
        if dtype not in (torch.float32, torch.bfloat16):
            return f"no compiled kernels for {dtype}"
        if head_dim % 32 or head_dim > min(MAX_HEAD_DIM, MAX_HEAD) or hidden % 16 or hidden > MAX_ROW:
            return f"head_dim {head_dim}, hidden {hidden}: not what the kernels take"
        if intermediate % 16 or intermediate > MAX_ROW:
            return f"intermediate size {intermediate}: not what the kernels take"
        return ""

    def linear_name(self, op) -> str | None:
        """The name of a packed linear's op (trnd/model/layers.py PackedLinear) if it is this build's, else None."""
        ns, _, name = getattr(op, "_qualified_op_name", "").partition("::")
        return name if ns == self.name and name in ("linear", "linear_amx", "linear_f32") else None

    def decode_layers(self, x, weights, widths, linear, cos, sin, kv, meta, num_heads, num_kv_heads, scale, eps):
        """Every decoder layer of a decode-only step, the kernels above called from C++ in the model's order
        (csrc/decode_layers.cpp); the caller (trnd/model/llama.py) has checked that each of them takes its
        inputs. Returns (x, residual) after the last layer."""
        return self.lib.decode_layers(x, weights, widths, linear, cos, sin, kv, meta.page_ids, meta.offsets,
                                      meta.decode_pages, meta.decode_ctx, num_heads, num_kv_heads, scale, eps,
                                      self._dpbf16(kv))


def compiled(name: str, dpbf16: bool = False, amx: bool = False) -> Ops:
    """The Ops table with one build's kernels in (raises if it is not loadable): tests load each build.
    amx: prefill attention on AMX tiles (the AVX-512 build, where the CPU has amx_bf16)."""
    lib, why = load_library(name)
    if lib is None:
        raise RuntimeError(why)
    if amx and not lib.amx_ready():
        raise RuntimeError(f"{name}: no AMX tile state granted here")
    return ops_table(CompiledOps(lib, dpbf16, amx))


def ops_table(c: CompiledOps) -> Ops:
    """The torch ops with every entry a build has swapped for its kernel (the rest stay torch's)."""
    return replace(TORCH_OPS, rms_norm=c.rms_norm, add_rms_norm=c.add_rms_norm, apply_rotary=c.apply_rotary,
                   silu_and_mul=c.silu_and_mul, qk_norm_rotary=c.qk_norm_rotary, write_kv=c.write_kv,
                   decode_attention=c.decode_attention, prefill_attention=c.prefill_attention,
                   decode_layers=c.decode_layers if hasattr(c.lib, "decode_layers") else None,
                   argmax=c.argmax if hasattr(c.lib, "argmax_rows") else sampling.argmax, moe_route=c.moe_route)


def _turned_off() -> bool:
    return os.environ.get(ENV, "1").strip() == "0"


def linear_wanted(info: CpuInfo) -> bool:
    """csrc/linear.cpp runs the bf16 linears: the CPU has avx512_bf16 (with AMX too, its tiles take the linears
    of LINEAR_AMX_MIN_ROWS rows and more), the compiled kernels are on."""
    return info.isa == "avx512_bf16" and not _turned_off()


@lru_cache(maxsize=1)
def linear_lib():
    """The AVX-512 build, whose `pack_linear`/`linear` run the CPU engine's bf16 linears, or None (oneDNN's
    prepacked matmul or F.linear then: trnd/model/layers.py). Against oneDNN on AMD Zen 4, the model's linears
    in one pass over 200 MB (kernels.cpu.bench_linear): 1.75x faster at 1 row, 1.2x at 16, equal at 512; the
    batch-1 decode step 1.41x (docs/RESULTS.md, "Linears without AMX"); with `linear_amx` on Intel Sapphire
    Rapids, 1.5x at 1 row, 1.24x at 16, equal at 512 (docs/RESULTS.md, "Linears on AMX")."""
    if not linear_wanted(cpu_info()):
        return None
    lib, why = load_library("trnd_avx512")
    if lib is None:
        log.info("cpu kernels: bf16 linears not compiled (%s); oneDNN runs them", why)
    return lib


@lru_cache(maxsize=1)
def linear_f32_lib():
    """The build for this CPU (AVX2 or AVX-512, as cpu_ops picks), whose `pack_linear_f32`/`linear_f32` run the
    CPU engine's fp32 linears, or None (oneDNN's prepacked matmul on AMD, else F.linear: trnd/model/layers.py).
    It streams each weight from DRAM once per call whatever the rows; the model's linears in one pass over 400 MB
    on AMD Zen 4 (kernels.cpu.bench_linear --dtype float32; the AVX2 build with oneDNN and MKL capped at AVX2, and
    the AVX-512 build): 1.6-1.7x oneDNN's speed at 1 row, 1.8-2.1x at 4 and 8, 1.6-1.7x at 16, 1.25-1.3x at 64,
    1.03-1.08x at 512 (docs/RESULTS.md, "fp32 linears of our own")."""
    lib, _ = _cpu_build()  # cpu_ops logs why, where there is none
    if lib is None:
        return None
    if not hasattr(lib, "linear_f32"):  # a build of sources older than csrc/linear_f32.cpp (`make venv` rebuilds)
        log.info("cpu kernels: %s has no linear_f32 (an older build: `python -m trnd_kernels.cpu.build`)", lib.__name__)
        return None
    return lib


@lru_cache(maxsize=1)
def linear_amx() -> bool:
    """linear_lib()'s `linear_amx` runs here: the CPU has amx_bf16 and Linux grants the tile state."""
    lib = linear_lib()
    return lib is not None and "amx_bf16" in cpu_info().flags and lib.amx_ready()


@dataclass(frozen=True)
class KernelsStatus:
    """Whether this process runs the compiled CPU kernels, and if not why: the start-up line, /metrics
    (trnd:cpu_kernels_loaded), /admin/state, trnd top and `trnd check cpu` all say the same."""
    build: str | None  # the build for this CPU: trnd_avx2 | trnd_avx512 (None: the CPU has no AVX2 + FMA)
    kind: str  # loaded | off (TRND_CPU_KERNELS=0) | unsupported (the CPU) | one of SLOW_PATH
    why: str = ""  # "" when loaded

    @property
    def loaded(self) -> bool:
        return self.kind == "loaded"

    @property
    def slow_path(self) -> bool:
        """A CPU that could run the compiled kernels runs the torch ops, and nobody asked for that."""
        return self.kind in SLOW_PATH

    def line(self) -> str:
        if self.loaded:
            return f"cpu kernels: {self.build}"
        return f"{NOT_USED} ({self.why}); the torch ops run"


@lru_cache(maxsize=1)
def _cpu_build() -> tuple[object | None, KernelsStatus]:
    """This CPU's build (variant_for) loaded, or None; and the status: what cpu_ops and linear_f32_lib run."""
    info = cpu_info()
    name = variant_for(info)
    if _turned_off():
        return None, KernelsStatus(name, "off", f"{ENV}=0")
    if name is None:
        return None, KernelsStatus(None, "unsupported", f"the CPU has no AVX2 + FMA ({info.summary()})")
    lib, why, kind = _load(name)
    return lib, KernelsStatus(name, kind, why)


def kernels_status() -> KernelsStatus:
    """Whether the compiled CPU kernels run in this process (loading them the first time)."""
    return _cpu_build()[1]


NOT_USED = "cpu kernels: not used"  # what a process that runs the torch ops logs (trnd/bench/servers.py reads it)


@lru_cache(maxsize=1)
def cpu_ops() -> Ops:
    """The CPU backend's table: the compiled kernels for this CPU where they load, else the torch ops. A CPU
    that could run them but runs the torch ops says so in one WARNING: the torch ops serve at about half the
    speed (docs/RESULTS.md, "Installed vs checkout")."""
    info = cpu_info()
    name = variant_for(info)
    lib, status = _cpu_build()
    if not status.loaded:
        (log.warning if status.slow_path else log.info)(status.line())
        return TORCH_OPS
    dpbf16 = info.isa == "avx512_bf16"
    amx = amx_usable(info, name, lib)
    log.info("cpu kernels: %s%s%s on %s", name, " with dpbf16" if dpbf16 else "", " and AMX prefill" if amx else "",
             info.summary())
    return ops_table(CompiledOps(lib, dpbf16, amx))  # the build _cpu_build loaded (compiled() would load it again)
