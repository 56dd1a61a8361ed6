"""The end of a W4A16 column tile (w4a16.py): the split-K sum of its partials by the program that
counted last (``_finish_tile``), then bias, the v-epilogue EC, SiLU·mul and the store
(``_epilogue``); ``_b_times_v`` is alpha · B_tile v for the EC forms that add it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from spear.kernels._common import _dot, _sigmoid, _sum_partials


@triton.jit
def _finish_tile(wt, offs_m, m_mask, lock_base, bias_ptr, out_ptr, part_ptr, locks_ptr, b_ptr, v_ptr, alpha,
                 M, N, stride_om, N_PARTS: tl.constexpr, HAS_BIAS: tl.constexpr, EC_MODE: tl.constexpr,
                 R: tl.constexpr, BN: tl.constexpr, DOT_F32: tl.constexpr, MV: tl.constexpr, ACT: tl.constexpr):
    """Column tile ``wt`` once its N_PARTS partials are in the workspace and this program counted
    last: their sum, the counter re-armed, the epilogue."""
    BM: tl.constexpr = offs_m.shape[0]
    offs_n = wt * BN + tl.arange(0, BN)
    n_mask = offs_n < N
    out_mask = n_mask[:, None] & m_mask[None, :]
    mn_offs = offs_m[None, :] * N + offs_n[:, None]
    accT = _sum_partials(part_ptr + mn_offs, M * N, out_mask, tl.zeros((BN, BM), tl.float32), N_PARTS, 4)
    tl.atomic_xchg(locks_ptr + lock_base + wt, 0)
    _epilogue(accT, offs_m, m_mask, offs_n, n_mask, offs_n % N, bias_ptr, out_ptr, b_ptr, v_ptr, alpha, stride_om,
              HAS_BIAS, EC_MODE, R, DOT_F32, MV, ACT, wt, N)


@triton.jit
def _epilogue(accT, offs_m, m_mask, offs_n, n_mask, n_ld, bias_ptr, out_ptr, b_ptr, v_ptr, alpha, stride_om,
              HAS_BIAS: tl.constexpr, EC_MODE: tl.constexpr, R: tl.constexpr, DOT_F32: tl.constexpr, MV: tl.constexpr,
              ACT: tl.constexpr, wt, N):
    """Bias, the v-epilogue EC (EC_MODE 2), SiLU·mul (ACT 1) and the store of one [BN, BM] tile."""
    offs_r = tl.arange(0, R)
    if EC_MODE == 2:
        bt = tl.load(b_ptr + n_ld[:, None] * R + offs_r[None, :])
        accT += alpha * _b_times_v(bt, v_ptr, offs_m, m_mask, offs_r, accT, R, MV, DOT_F32, "")
    if HAS_BIAS:
        accT += tl.load(bias_ptr + n_ld).to(tl.float32)[:, None]
    if ACT == 1:
        # rows 2i, 2i + 1 of the tile are gate and up of output feature wt * BN/2 + i: SiLU·mul
        # on the fp32 sums, so the (gate, up) intermediate never reaches memory
        BN: tl.constexpr = accT.shape[0]
        BM: tl.constexpr = accT.shape[1]
        g, u = tl.split(tl.permute(tl.reshape(accT, (BN // 2, 2, BM)), (0, 2, 1)))
        offs_h = wt * (BN // 2) + tl.arange(0, BN // 2)
        tl.store(out_ptr + offs_m[None, :] * stride_om + offs_h[:, None],
                 (g * _sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=(2 * offs_h < N)[:, None] & m_mask[None, :])
    else:
        tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], accT.to(out_ptr.dtype.element_ty),
                 mask=n_mask[:, None] & m_mask[None, :])


@triton.jit
def _b_times_v(bt, v_ptr, offs_m, m_mask, offs_r, accT, R: tl.constexpr, MV: tl.constexpr, DOT_F32: tl.constexpr,
               CACHE: tl.constexpr):
    """B_tile [BN, R] . v [R, tokens] as an [BN, BM] tile. At decode (MV tokens): one FMA row sum per
    token on B's tile as loaded (the tensor-core dot's operand layouts would cost a round trip
    through shared memory for a product of a few thousand FMAs); else a dot. CACHE ".cg" reads v
    at L2, where another program of this launch wrote it ("" for the default)."""
    if MV > 0:
        cols = tl.arange(0, accT.shape[1])[None, :]
        bv = tl.zeros_like(accT)
        bf = bt.to(tl.float32)
        m = tl.sum(m_mask.to(tl.int32))  # the decode loop has one m-tile: tokens 0 .. M - 1
        for t in tl.static_range(MV):
            vt = tl.load(v_ptr + t * R + offs_r, mask=(offs_r * 0 + t) < m, other=0.0, cache_modifier=CACHE)
            bv += tl.where(cols == t, tl.sum(bf * vt.to(tl.float32)[None, :], axis=1)[:, None], 0.0)
        return bv
    else:
        vT = tl.load(v_ptr + offs_m[None, :] * R + offs_r[:, None], mask=m_mask[None, :], other=0.0,
                     cache_modifier=CACHE)
        return _dot(bt, vT.to(bt.dtype), tl.zeros_like(accT), DOT_F32)
