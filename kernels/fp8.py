"""FP8 KV pages: values in float8 with their scales inside the page, torch reference.

An fp8 pool is kv[page, layer, k|v, kv_head, P*D + 4] in the fp8 dtype: each (page, layer, k|v, head)
block is its [P, D] tile of fp8 values followed by that block's fp32 scale (4 bytes). So a page stays
one contiguous byte range that carries its own scales (the handoff, the host tier and the store move it
as one unit, and a checksum of its bytes covers the scales), and a TP rank's heads stay contiguous with
their scales (transfer/plan.py moves `head_bytes` = P*D + 4 per head). One scale per block, not per
token: 4 bytes per 1 KiB tile at P=16, D=64, so the page is 0.502x a bf16 page.

The scale grows as a block is written (value = fp8 * scale): a write whose |x| passes what the block's
scale can hold raises the scale to amax / FP8_MAX and requantizes the block's earlier slots. A write to
slot 0 starts the block afresh (pages are written from slot 0 up; a recycled page's old scale is dropped).
"""

from __future__ import annotations

import torch

FORMATS = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
KV_CACHE_DTYPES = ("auto", *FORMATS)
SCALE_BYTES = 4


def is_fp8(kv: torch.Tensor) -> bool:
    return kv.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def kv_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's dtype for a `kv_cache_dtype` setting ("auto": the model's)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in FORMATS:
        raise ValueError(f"kv_cache_dtype: {kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    return FORMATS[kv_cache_dtype]


def block_bytes(dtype: torch.dtype, page_size: int, head_dim: int) -> tuple[int, int]:
    """(itemsize, scale bytes) of one (layer, k|v, head) block."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return itemsize, SCALE_BYTES if dtype in FORMATS.values() else 0


def split(kv: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp8 pool -> (values [N, L, 2, Hk, P, D] fp8, scales [N, L, 2, Hk] fp32): views, no copy."""
    pd = kv.shape[-1] - SCALE_BYTES
    values = kv[..., :pd].unflatten(-1, (pd // head_dim, head_dim))
    scales = kv[..., pd:].view(torch.float32)[..., 0]
    return values, scales


def page_size_of(kv: torch.Tensor, head_dim: int) -> int:
    return (kv.shape[-1] - SCALE_BYTES) // head_dim if is_fp8(kv) else kv.shape[4]


def write_kv(kv: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor, page_ids: torch.Tensor,
             offsets: torch.Tensor) -> None:
    """k, v [T, Hk, D] into their slots of an fp8 pool, raising and applying each touched block's scale."""
    write_parts(kv, layer, torch.stack((k, v), dim=1), page_ids, offsets)


def write_parts(kv: torch.Tensor, layer: int, new: torch.Tensor, page_ids: torch.Tensor, offsets: torch.Tensor) -> None:
    """new [T, parts, Hk, D] into their slots of an fp8 pool of any pool kind (K|V: 2 parts; MLA's latent row: 1
    part of 1 head), raising and applying each touched (layer, part, head) block's scale."""
    values, scales = split(kv, new.shape[-1])
    fmax = torch.finfo(kv.dtype).max
    new = new.float()
    pages, inv = torch.unique(page_ids, return_inverse=True)  # [U], [T]
    u, parts, hk = len(pages), new.shape[1], new.shape[2]
    dev = new.device
    amax = torch.zeros(u, parts, hk, device=dev).scatter_reduce_(0, inv[:, None, None].expand(-1, parts, hk),
                                                                 new.abs().amax(-1), "amax")
    fresh = torch.zeros(u, dtype=torch.bool, device=dev).index_put_((inv[offsets == 0],),
                                                                    torch.tensor(True, device=dev))
    old = scales[pages, layer]  # [U, 2, Hk]
    old = torch.where(fresh[:, None, None], torch.zeros_like(old), old)
    scale = torch.maximum(old, amax / fmax)
    ratio = torch.where(scale > 0, old / scale.clamp_min(1e-30), torch.zeros_like(old))
    grow = ((ratio != 1) | fresh[:, None, None]).any(-1).any(-1)  # blocks whose earlier slots change
    if grow.any():
        g = pages[grow]
        blocks = values[g, layer].float() * ratio[grow][..., None, None]
        values[g, layer] = blocks.clamp(-fmax, fmax).to(kv.dtype)
    scales[pages, layer] = scale
    s = scale[inv].clamp_min(1e-30)[..., None]  # [T, parts, Hk, 1]
    q = (new / s).clamp(-fmax, fmax).to(kv.dtype)
    page, slot = page_ids[:, None, None], offsets[:, None, None]
    head = torch.arange(hk, device=dev)
    index = (page, torch.full((), layer, dtype=torch.long, device=dev), torch.arange(parts, device=dev)[:, None], head,
             slot)
    values.index_put_(index, q)


def gather_parts(kv: torch.Tensor, layer: int, pages: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """pages [n] -> [n, parts, Hk, P, width] of one layer in `dtype`, dequantized (any pool kind)."""
    rows = kv.view(kv.shape[0], kv.shape[1], -1)[:, layer]
    values, scales = split(rows.index_select(0, pages).view(len(pages), *kv.shape[2:]), width)
    return (values.float() * scales[..., None, None]).to(dtype)


def gather(kv: torch.Tensor, layer: int, pages: torch.Tensor, head_dim: int, dtype: torch.dtype):
    """pages [..., n] -> k, v [..., Hk, n * P, D] in `dtype`, dequantized (the twin of attention._gather)."""
    x = gather_parts(kv, layer, pages.reshape(-1), head_dim, dtype)  # [N, 2, Hk, P, D]
    x = x.view(*pages.shape, *x.shape[1:])  # [..., n, 2, Hk, P, D]
    n, _, hk, p, d = x.shape[-5:]
    x = x.movedim(-5, -3).reshape(*x.shape[:-5], 2, hk, n * p, d)
    return x[..., 0, :, :, :], x[..., 1, :, :, :]
