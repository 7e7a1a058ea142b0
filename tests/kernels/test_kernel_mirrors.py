"""NumPy mirrors of the NKI kernels (kernels/mirrors/) against their torch twins (kernels/*.py), on random
shapes: row counts across 128-row tiles, ragged page tables, GQA groups 1/2/4, contexts that are not a
multiple of the page size, several KV blocks per sequence, prefill chunks after a cached prefix. Also each
kernel's supports() and the torch-side input preparation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trnd_kernels import attention, norm, rotary
from trnd_kernels.mirrors import decode_attention as m_decode
from trnd_kernels.mirrors import prefill_attention as m_prefill
from trnd_kernels.mirrors import rmsnorm as m_norm
from trnd_kernels.mirrors import rotary as m_rotary
from trnd_kernels.nki import decode_attention as k_decode
from trnd_kernels.nki import prefill_attention as k_prefill
from trnd_kernels.nki import rmsnorm as k_norm
from trnd_kernels.nki import rotary as k_rotary
from trnd_kernels.cases import make_decode_case, make_prefill_case
from trnd.check import kernel_cases

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3)}


def close(mirror: np.ndarray, twin: torch.Tensor, dtype) -> None:
    np.testing.assert_allclose(mirror.astype(np.float32), twin.float().numpy(), **TOL[dtype])
    if dtype == torch.float16:
        # Rounding at the twin's points makes fp16 results bit-identical but for rare 1-ulp differences
        # (rsqrt vs 1/sqrt, summation order); rounding elsewhere differs in ~25% of elements.
        assert (mirror != twin.numpy()).mean() < 1e-3


# -- RMSNorm ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n, hidden", [(1, 64), (127, 96), (128, 64), (300, 200)])
def test_rmsnorm_mirror_matches_twin(n, hidden, dtype):
    g = torch.Generator().manual_seed(n * 1000 + hidden)
    x = (torch.randn(n, hidden, generator=g) * 3).to(dtype)
    w = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    close(m_norm.rms_norm(x.numpy(), w.numpy(), 1e-6), norm.rms_norm(x, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_add_rmsnorm_mirror_matches_twin(dtype):
    g = torch.Generator().manual_seed(7)
    x, r = (torch.randn(2, 200, 64, generator=g).to(dtype) for _ in range(2))
    w = torch.rand(64, generator=g).to(dtype)
    out, res = norm.add_rms_norm(x, r, w, 1e-5)
    m_out, m_res = m_norm.add_rms_norm(x.reshape(-1, 64).numpy(), r.reshape(-1, 64).numpy(), w.numpy(), 1e-5)
    close(m_out, out.reshape(-1, 64), dtype)
    close(m_res, res.reshape(-1, 64), dtype)


def test_rmsnorm_supports():
    assert k_norm.supports((300, 4096), (4096,), torch.bfloat16)
    assert k_norm.supports((2, 5, 8192), (8192,), torch.float32)
    assert not k_norm.supports((4, 16384), (16384,), torch.bfloat16)  # over the per-partition budget
    assert not k_norm.supports((4, 64), (32,), torch.bfloat16)
    assert not k_norm.supports((4, 64), (64,), torch.int32)
    assert not k_norm.supports((0, 64), (64,), torch.float32)


# -- rotary -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t, hq, hk, d", [(1, 4, 2, 16), (129, 8, 2, 64), (300, 4, 4, 32)])
def test_rotary_mirror_matches_twin(t, hq, hk, d, dtype):
    g = torch.Generator().manual_seed(t + hq + d)
    q, k = torch.randn(t, hq, d, generator=g).to(dtype), torch.randn(t, hk, d, generator=g).to(dtype)
    pos = torch.randint(0, 4096, (t,), generator=g)
    cos, sin = rotary.cos_sin(pos, rotary.inv_freq(d, 10000.0, None), dtype)
    tq, tk = rotary.apply_rotary(q, k, cos, sin)
    mq, mk = m_rotary.apply_rotary(q.numpy(), k.numpy(), cos.numpy(), sin.numpy())
    close(mq, tq, dtype)
    close(mk, tk, dtype)


def test_rotary_supports():
    assert k_rotary.supports((300, 32, 128), (300, 8, 128), (300, 128), torch.bfloat16)
    assert not k_rotary.supports((300, 128, 128), (300, 8, 128), (300, 128), torch.bfloat16)  # 16384 > budget
    assert not k_rotary.supports((3, 4, 15), (3, 2, 15), (3, 15), torch.float32)  # odd head_dim
    assert not k_rotary.supports((3, 4, 16), (2, 2, 16), (3, 16), torch.float32)


# -- paged decode attention -------------------------------------------------------------------------------

def run_mirror(q, kv, layer, meta, scale, ctx=None):
    n, layers, _, hk, p, d = kv.shape
    rows, ctx32, blocks = k_decode.prepare(meta.decode_pages, meta.decode_ctx if ctx is None else ctx, layer,
                                           layers, p)
    return m_decode.decode_attention(q.numpy(), kv.reshape(n * layers, 2, hk, p, d).numpy(), rows.numpy(),
                                     ctx32.numpy(), blocks.numpy(), scale)


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("page_size, ctxs", [
    (16, [1, 16, 17, 130, 300]),  # 8 pages per 128-token block: up to 3 blocks, partial last pages
    (4, [3, 5, 129, 257]),  # 32 pages per block
    (128, [1, 127, 128, 129, 400]),  # one page per block
    (48, [47, 49, 200]),  # 128 // 48 = 2 pages per 96-token block
])
def test_decode_mirror_matches_twin(group, page_size, ctxs):
    hk, d = 2, 32
    q, kv, meta = make_decode_case(ctxs, hk * group, hk, d, page_size, seed=page_size + group)
    scale = d ** -0.5
    for layer in range(kv.shape[1]):
        twin = attention.decode_attention(q, kv, layer, meta, scale)
        close(run_mirror(q, kv, layer, meta, scale), twin, torch.float32)


def test_decode_mirror_fp16_matches_twin():
    q, kv, meta = make_decode_case([5, 140, 33], 8, 2, 64, 16, dtype=torch.float16, seed=3)
    twin = attention.decode_attention(q, kv, 1, meta, 0.125)
    np.testing.assert_allclose(run_mirror(q, kv, 1, meta, 0.125).astype(np.float32), twin.float().numpy(),
                               rtol=1e-2, atol=1e-2)


def test_decode_comparison_is_sensitive_to_the_mask():
    """One slot too many (ctx + 1 reads a noise slot) must change the answer: the check above can fail."""
    q, kv, meta = make_decode_case([17, 130], 4, 2, 32, 16, seed=9)
    twin = attention.decode_attention(q, kv, 0, meta, 0.2)
    off = run_mirror(q, kv, 0, meta, 0.2, ctx=meta.decode_ctx + 1)
    assert not np.allclose(off, twin.numpy(), rtol=1e-3, atol=1e-3)


def test_prepare_row_ids_and_blocks():
    pages = torch.tensor([[5, 2, 9], [7, 7, 7]])
    rows, ctx, blocks = k_decode.prepare(pages, torch.tensor([40, 3]), layer=1, num_layers=4, page_size=16)
    assert rows.dtype == ctx.dtype == blocks.dtype == torch.int32
    assert rows.shape == (2, 1, 3)  # 3 pages per block (capped by the table width), one block
    assert rows[0, 0].tolist() == [21, 9, 37]  # page * layers + layer
    assert blocks.tolist() == [1, 1]
    rows, _, blocks = k_decode.prepare(torch.arange(20)[None], torch.tensor([300]), 0, 1, page_size=16)
    assert rows.shape == (1, 3, 8)  # 8 pages per 128-token block, padded with the first page
    assert rows[0, 2].tolist() == [16, 17, 18, 19, 0, 0, 0, 0]
    assert blocks.tolist() == [3]


def test_decode_supports():
    kv = (100, 4, 2, 8, 16, 128)
    assert k_decode.supports((32, 32, 128), kv, (32, 64), torch.bfloat16)
    assert not k_decode.supports((32, 32, 256), (100, 4, 2, 8, 16, 256), (32, 64), torch.bfloat16)  # D > 128
    assert not k_decode.supports((32, 30, 128), kv, (32, 64), torch.bfloat16)  # Hq not a multiple of Hk
    assert not k_decode.supports((2, 8, 64), (100, 4, 2, 8, 256, 64), (2, 4), torch.bfloat16)  # page > 128
    assert not k_decode.supports((2, 1024, 64), (100, 4, 2, 1, 16, 64), (2, 4), torch.bfloat16)  # G > 128
    assert not k_decode.supports((3, 8, 64), (100, 4, 2, 8, 16, 64), (2, 4), torch.bfloat16)  # table rows != B


def test_mirror_refuses_shapes_the_kernel_refuses():
    q = np.zeros((1, 4, 256), np.float32)
    kv = np.zeros((4, 2, 2, 16, 256), np.float32)
    with pytest.raises(AssertionError, match="constraints"):
        m_decode.decode_attention(q, kv, np.zeros((1, 1, 1), np.int32), np.array([3]), np.array([1]), 1.0)


@pytest.mark.parametrize("case", [c for c in kernel_cases(torch.float32) if c[1] == "decode_attention"],
                         ids=lambda c: c[0])
def test_decode_mirror_on_the_device_check_cases(case):
    """The shapes `trnd check neuron` sends to the kernel (GQA up to 8, head_dim 128, up to 8 blocks)."""
    _, _, (q, kv, layer, meta, scale) = case
    close(run_mirror(q, kv, layer, meta, scale), attention.decode_attention(q, kv, layer, meta, scale),
          torch.float32)


# -- paged prefill attention ------------------------------------------------------------------------------

@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("prior, q_len, page_size", [
    (0, 1, 16), (0, 37, 16), (5, 1, 16),  # no prefix; a one-token chunk after a prefix
    (100, 200, 16),  # two query tiles, several KV blocks
    (250, 130, 48),  # prefix and chunk both end mid-page; 96-token blocks
    (3, 129, 128),  # one page per block
])
def test_prefill_mirror_matches_twin(group, prior, q_len, page_size):
    hk, d = 2, 32
    q, k_new, v_new, kv, seq = make_prefill_case(prior, q_len, hk * group, hk, d, page_size, seed=prior + group)
    for layer in range(kv.shape[1]):
        twin = attention.prefill_attention(q, k_new, v_new, kv, layer, seq, page_size, d ** -0.5)
        n, layers, _, _, p, _ = kv.shape
        rows, first, blocks = k_prefill.prepare(seq.pages, seq.ctx_len, seq.q_len, layer, layers, p)
        mirror = m_prefill.prefill_attention(q.numpy(), kv.reshape(n * layers, 2, hk, p, d).numpy(), rows.numpy(),
                                             first.numpy(), blocks.numpy(), d ** -0.5)
        close(mirror, twin, torch.float32)


def test_prefill_prepare():
    rows, first, blocks = k_prefill.prepare(torch.arange(20), ctx_len=300, q_len=200, layer=1, num_layers=2,
                                            page_size=16)
    assert rows.shape == (3, 8) and rows[0, :3].tolist() == [1, 3, 5]
    assert first.tolist() == [101, 229]  # prior 100: row 0 of tile 0 sees keys 0..100
    assert blocks.tolist() == [2, 3]  # tile 0's last row is position 227 (2 blocks of 128), tile 1's is 299


def test_prefill_supports():
    assert k_prefill.supports((512, 32, 128), (100, 4, 2, 8, 64, 128), 40, torch.bfloat16)
    assert not k_prefill.supports((512, 32, 256), (100, 4, 2, 8, 64, 256), 40, torch.bfloat16)
    assert not k_prefill.supports((512, 30, 128), (100, 4, 2, 8, 64, 128), 40, torch.bfloat16)


@pytest.mark.parametrize("case", [c for c in kernel_cases(torch.float32) if c[1] == "prefill_attention"],
                         ids=lambda c: c[0])
def test_prefill_mirror_on_the_device_check_cases(case):
    _, _, (q, k_new, v_new, kv, layer, seq, page_size, scale) = case
    n, layers, _, hk, p, d = kv.shape
    rows, first, blocks = k_prefill.prepare(seq.pages, seq.ctx_len, seq.q_len, layer, layers, p)
    mirror = m_prefill.prefill_attention(q.numpy(), kv.reshape(n * layers, 2, hk, p, d).numpy(), rows.numpy(),
                                         first.numpy(), blocks.numpy(), scale)
    close(mirror, attention.prefill_attention(q, k_new, v_new, kv, layer, seq, page_size, scale), torch.float32)
