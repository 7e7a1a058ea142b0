"""Which bytes of which source rank's page go to which destination rank's page.

Within a page on one rank the layout is [layer, k|v, kv_head, slot, head_dim] (kernels/attention.py),
so for every (layer, k|v) block one rank's heads are contiguous. Any pool kind (model/config.py PoolKind) is
[layer, part, head, slot, width]: `parts` blocks per layer (2 for K|V, 1 for MLA's latent + rope row) of `width`
values per slot; a latent pool has one head that every rank holds (rank_heads (0, 1) each), so a plan copies it
from the first source rank to every destination rank. A plan is made once per (source
layout, destination layout) pair: for each destination rank and each of its heads, the first source
rank that holds that head; runs of heads become one segment per (layer, k|v) block, and segments
that are contiguous on both sides merge (equal layouts give one segment per page and rank pair).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Layout:
    num_layers: int
    page_size: int
    head_dim: int
    itemsize: int
    rank_heads: tuple[tuple[int, int], ...]  # [start, end) KV heads of each rank
    scale_bytes: int = 0  # fp8 pages: each head's block ends with its scale (kernels/fp8.py), moved with it
    parts: int = 2  # blocks per layer: K and V; 1 for the latent pool (head_dim is then its row width)
    kind: str = "gqa"  # the pool kind's name (model/config.py PoolKind): "gqa" or "latent"

    @property
    def head_bytes(self) -> int:  # one head's slots in one (layer, k|v) block, and its scale
        return self.page_size * self.head_dim * self.itemsize + self.scale_bytes

    def page_bytes(self, rank: int) -> int:
        h0, h1 = self.rank_heads[rank]
        return self.num_layers * self.parts * (h1 - h0) * self.head_bytes

    def canonical(self) -> "Layout":
        """The same pages at tp=1, every KV head in one page: what an L3 store keeps, whatever the writer's TP."""
        heads = max(h1 for _, h1 in self.rank_heads)
        return Layout(self.num_layers, self.page_size, self.head_dim, self.itemsize, ((0, heads),), self.scale_bytes,
                      self.parts, self.kind)


@dataclass(frozen=True)
class Segment:
    src_rank: int
    dst_rank: int
    src_off: int  # bytes from the start of the page on the source rank
    dst_off: int
    length: int


def make_plan(src: Layout, dst: Layout) -> list[Segment]:
    if (src.num_layers, src.page_size, src.head_dim, src.itemsize, src.scale_bytes, src.parts, src.kind) != (
            dst.num_layers, dst.page_size, dst.head_dim, dst.itemsize, dst.scale_bytes, dst.parts, dst.kind):
        raise ValueError("layouts differ in page shape: no byte-for-byte handoff is possible")
    src_heads = {h for h0, h1 in src.rank_heads for h in range(h0, h1)}
    dst_heads = {h for h0, h1 in dst.rank_heads for h in range(h0, h1)}
    if src_heads != dst_heads:
        raise ValueError(f"source holds KV heads {sorted(src_heads)}, destination needs {sorted(dst_heads)}")
    owner = {}
    for r, (h0, h1) in enumerate(src.rank_heads):
        for h in range(h0, h1):
            owner.setdefault(h, r)
    hb = src.head_bytes
    segs: list[Segment] = []
    for s, (d0, d1) in enumerate(dst.rank_heads):
        for layer in range(src.num_layers):
            for kv in range(src.parts):
                for h in range(d0, d1):
                    r = owner[h]
                    s0 = src.rank_heads[r][0]
                    src_block = (layer * src.parts + kv) * (src.rank_heads[r][1] - s0) * hb
                    dst_block = (layer * src.parts + kv) * (d1 - d0) * hb
                    segs.append(Segment(r, s, src_block + (h - s0) * hb, dst_block + (h - d0) * hb, hb))
    return _merge(segs)


def _merge(segs: list[Segment]) -> list[Segment]:
    out: list[Segment] = []
    for g in sorted(segs, key=lambda g: (g.src_rank, g.dst_rank, g.src_off)):
        last = out[-1] if out else None
        if (last and last.src_rank == g.src_rank and last.dst_rank == g.dst_rank
                and last.src_off + last.length == g.src_off and last.dst_off + last.length == g.dst_off):
            out[-1] = Segment(last.src_rank, last.dst_rank, last.src_off, last.dst_off, last.length + g.length)
        else:
            out.append(g)
    return out


def descriptors(plan: list[Segment], src: Layout, dst: Layout, src_base: list[int], dst_base: list[int],
                src_pages: list[int], dst_pages: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(addr, len, dev) rows for both sides of one batched transfer, segment by segment and within a
    segment page by page, coalesced: a row that continues the previous one on both sides joins it. Pages the allocator handed out in a run (a fresh pool hands out ascending ids) go as one
    descriptor per run instead of one per page: NIXL's cost is per descriptor (LMCache PR #4161 saw
    0.7 GB/s at 1 KiB descriptors against 12-24 GB/s at 64 MiB)."""
    s, d = page_rows(plan, src, dst, src_base, dst_base, src_pages, dst_pages)
    return coalesce(*by_segment(s, d, len(plan)))


def page_rows(plan: list[Segment], src: Layout, dst: Layout, src_base: list[int], dst_base: list[int],
              src_pages: list[int], dst_pages: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Uncoalesced rows, page-major: every segment of the first page, then of the next (the order the
    digest hashes in, transfer/digest.py: the same however the pages are split into chunks)."""
    sp = np.asarray(src_pages, dtype=np.uint64)
    dp = np.asarray(dst_pages, dtype=np.uint64)
    n, k = len(sp), len(plan)
    s = np.zeros((n, k, 3), dtype=np.uint64)
    d = np.zeros((n, k, 3), dtype=np.uint64)
    for j, g in enumerate(plan):
        s[:, j, 0] = np.uint64(src_base[g.src_rank] + g.src_off) + sp * np.uint64(src.page_bytes(g.src_rank))
        d[:, j, 0] = np.uint64(dst_base[g.dst_rank] + g.dst_off) + dp * np.uint64(dst.page_bytes(g.dst_rank))
        s[:, j, 1] = d[:, j, 1] = g.length
    return s.reshape(n * k, 3), d.reshape(n * k, 3)


def by_segment(src: np.ndarray, dst: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """page_rows' rows reordered segment-major (a segment's pages next to each other: what coalesces
    when the pages run on both sides, one rank pair after another); k: the plan's segments."""
    return (src.reshape(-1, k, 3).transpose(1, 0, 2).reshape(-1, 3),
            dst.reshape(-1, k, 3).transpose(1, 0, 2).reshape(-1, 3))



def coalesce(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge each row into the one before it where both sides continue it (same device, addresses
    adjacent): the bytes and their pairing are unchanged, the descriptor count drops."""
    if len(src) < 2:
        return src, dst
    end_s, end_d = src[:-1, 0] + src[:-1, 1], dst[:-1, 0] + dst[:-1, 1]
    joins = (src[1:, 0] == end_s) & (dst[1:, 0] == end_d) & (src[1:, 2] == src[:-1, 2]) & (dst[1:, 2] == dst[:-1, 2])
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    lengths = np.add.reduceat(src[:, 1], starts)
    s, d = src[starts].copy(), dst[starts].copy()
    s[:, 1] = d[:, 1] = lengths
    return s, d
