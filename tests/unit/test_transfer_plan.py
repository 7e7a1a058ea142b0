"""Descriptor coalescing and the handoff digest (transfer/plan.py, transfer/digest.py)."""

import numpy as np
import torch

from trnd.transfer import digest
from trnd.transfer.plan import Layout, by_segment, coalesce, descriptors, make_plan, page_rows


def _layouts(src_tp: int, dst_tp: int):
    def heads(tp):
        return tuple((r * 4 // tp, (r + 1) * 4 // tp) for r in range(tp))
    return Layout(2, 4, 8, 2, heads(src_tp)), Layout(2, 4, 8, 2, heads(dst_tp))


def test_pages_in_runs_on_both_sides_go_as_one_descriptor_per_run():
    src, dst = _layouts(1, 1)
    plan = make_plan(src, dst)
    pb = src.page_bytes(0)
    s, d = descriptors(plan, src, dst, [1000], [50_000], [3, 4, 5, 9, 10], [7, 8, 9, 10, 2])
    # runs on both sides: (3,4,5 -> 7,8,9), (9 -> 10), (10 -> 2)
    assert s[:, 0].tolist() == [1000 + 3 * pb, 1000 + 9 * pb, 1000 + 10 * pb]
    assert d[:, 0].tolist() == [50_000 + 7 * pb, 50_000 + 10 * pb, 50_000 + 2 * pb]
    assert s[:, 1].tolist() == d[:, 1].tolist() == [3 * pb, pb, pb]


def test_coalescing_keeps_every_byte_pairing():
    """Whatever merges, byte i of the source stream still lands at byte i of the destination stream."""
    rng = np.random.default_rng(0)
    for src_tp, dst_tp in ((1, 1), (1, 2), (2, 1), (4, 2)):
        src, dst = _layouts(src_tp, dst_tp)
        plan = make_plan(src, dst)
        sp = rng.permutation(20)[:12].tolist()
        dp = sorted(rng.permutation(30)[:12].tolist())
        sb, db = [r * 10_000_000 for r in range(src_tp)], [10**9 + r * 10_000_000 for r in range(dst_tp)]
        rs, rd = page_rows(plan, src, dst, sb, db, sp, dp)
        cs, cd = coalesce(*by_segment(rs, rd, len(plan)))
        assert len(cs) <= len(rs) and int(cs[:, 1].sum()) == int(rs[:, 1].sum())

        def pairs(s, d):
            return [(a + i, b + i) for (a, n, _), (b, _, _) in zip(s.tolist(), d.tolist()) for i in range(0, n, 8)]
        assert sorted(pairs(cs, cd)) == sorted(pairs(rs, rd))


def test_a_fresh_pools_pages_coalesce_to_one_descriptor():
    src, dst = _layouts(2, 2)
    s, d = descriptors(make_plan(src, dst), src, dst, [0, 10**6], [10**8, 10**9], list(range(8)), list(range(8, 16)))
    assert len(s) == 2  # one per rank pair


def test_digest_is_the_same_however_the_bytes_are_chunked_and_catches_a_wrong_byte():
    src, dst = _layouts(1, 1)
    plan = make_plan(src, dst)
    a = torch.randint(0, 255, (32 * src.page_bytes(0),), dtype=torch.uint8)
    b = a.clone()
    ma, mb = digest.Memory([a]), digest.Memory([b])
    pages = [5, 6, 7, 2, 3, 11]
    whole = digest.new()
    ma.update(whole, page_rows(plan, src, dst, [a.data_ptr()], [0], pages, [0] * 6)[0])
    chunked = digest.new()
    for part in (pages[:2], pages[2:5], pages[5:]):
        mb.update(chunked, page_rows(plan, src, dst, [b.data_ptr()], [0], part, [0] * len(part))[0])
    assert whole.digest() == chunked.digest()
    b[2 * src.page_bytes(0) + 17] ^= 1  # page 2
    again = digest.new()
    mb.update(again, page_rows(plan, src, dst, [b.data_ptr()], [0], pages, [0] * 6)[0])
    assert again.digest() != whole.digest()
