"""Tensor-core main loop of the W4A16 GEMM over the fragment layout (``Layout.FRAGMENT``), and the
layout's dequantize kernel (the dequantize + cuBLAS path above ``fragment_cublas_min_m`` tokens).

The weight is the left operand of the MMA (accT [BN, BM] += W[BN, BK] · xT[BK, BM]): on Hopper
the left operand of a wgmma comes from registers, so the dequantized weights go from the load
straight into the MMA and only the activations sit in shared memory.

The layout (layout.py) stores, for each 16 output features x 64 inputs, the 32 lanes' words one
after another, four words a lane (its four k16 chunks): a lane's 16-byte load holds exactly
the codes of its MMA fragments (rows g and g + 8, k-pairs 2q and 2q + 8 of each chunk, for
lane 4g + q). Word nibbles (j, j + 4) are the pair j: rows g (j even) or g + 8 (j odd), k-pair
2q (j < 2) or 2q + 8 (j >= 2). Codes become 16-bit floats in registers: one LOP3 ORs the two
codes of a pair into the mantissas of a float pair whose exponent makes one mantissa step 1
(fp16 1024, bf16 128); one subtraction takes the zero point off exactly; the group's scale is
applied with one product, rounded once as the reference rounds W_hat once (bf16: in fp32,
since (c - z) · s needs 16 bits). ``tl.join``/``tl.permute``/``tl.reshape`` then give each value
its logical (row, k); since the words were loaded where the MMA wants them, that is register
renaming and the tile never passes through shared memory.
"""

from __future__ import annotations

import triton
import triton.language as tl

from spear.kernels._common import _dequant_values, _dot, _halves, _magic


@triton.jit
def _pair16(v, IS_BF16: tl.constexpr):
    """int32 words holding the 16-bit float v (fp32 in) in both halves."""
    if IS_BF16:
        h = v.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    else:
        h = v.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return h | (h << 16)


def _convert_ptx(bf16: bool, grouped: bool) -> str:
    """The PTX of ``_convert_asm`` for one dtype and scale form: $8 the word, $9 / $10 BASE + zero of
    rows g / g + 8 in both halves, $11 / $12 their scales (fp16: in both halves; bf16: fp32)."""
    magic, kind = ("0x43004300", "bf16x2") if bf16 else ("0x64006400", "f16x2")
    lines = ["{", ".reg .b32 t<4>" + (", u, a, b, r;" if bf16 and grouped else ";"), ".reg .b32 s<3>;",
             "shr.u32 s0, $8, 4;", "shr.u32 s1, $8, 8;", "shr.u32 s2, $8, 12;",
             f"lop3.b32 t0, $8, 0x000f000f, {magic}, 0xea;"]
    lines += [f"lop3.b32 t{i}, s{i - 1}, 0x000f000f, {magic}, 0xea;" for i in (1, 2, 3)]
    # pairs 0, 2 are row g's, pairs 1, 3 row g + 8's
    lines += [f"sub.rn.{kind} t{i}, t{i}, ${9 + i % 2};" for i in (0, 1, 2, 3)]
    if grouped and bf16:  # (c - z) exact in bf16, times the scale in fp32, rounded once
        for i in range(4):
            lines += [f"shl.b32 a, t{i}, 16;", f"and.b32 b, t{i}, 0xffff0000;", f"mul.rn.f32 a, a, ${11 + i % 2};",
                      f"mul.rn.f32 b, b, ${11 + i % 2};", "cvt.rn.bf16x2.f32 r, b, a;",
                      f"mov.b32 {{${2 * i}, ${2 * i + 1}}}, r;"]
    else:
        if grouped:
            lines += [f"mul.rn.f16x2 t{i}, t{i}, ${11 + i % 2};" for i in (0, 1, 2, 3)]
        lines += [f"mov.b32 {{${2 * i}, ${2 * i + 1}}}, t{i};" for i in range(4)]
    return "\n".join(lines + ["}"])


# one literal per variant, built once (the kernels take a constexpr string)
_PTX_F16 = tl.constexpr(_convert_ptx(False, False))
_PTX_F16_GROUPED = tl.constexpr(_convert_ptx(False, True))
_PTX_BF16 = tl.constexpr(_convert_ptx(True, False))
_PTX_BF16_GROUPED = tl.constexpr(_convert_ptx(True, True))


@triton.jit
def _convert_asm(p, zlo, zhi, slo, shi, IS_BF16: tl.constexpr, GROUPED: tl.constexpr):
    """The eight weights of each word p as 16-bit floats, (pair 0 lo, hi, pair 1 lo, hi, ...).

    zlo / zhi: (BASE + zero) in both halves of a word, for rows g / g + 8. slo / shi: the scales
    (fp16: in both halves of a word; bf16: fp32). GROUPED False: (c - z) only (the per-channel
    scale is applied to the accumulator). PTX: ``_convert_ptx``."""
    if IS_BF16:
        if GROUPED:
            return tl.inline_asm_elementwise(_PTX_BF16_GROUPED, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,f,f",
                                             [p, zlo, zhi, slo, shi], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise(_PTX_BF16, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [p, zlo, zhi],
                                             dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
    else:
        if GROUPED:
            return tl.inline_asm_elementwise(_PTX_F16_GROUPED, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r,r",
                                             [p, zlo, zhi, slo, shi], dtype=(tl.float16,) * 8, is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise(_PTX_F16, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [p, zlo, zhi],
                                             dtype=(tl.float16,) * 8, is_pure=True, pack=1)


@triton.jit
def _wgmma_drain(k):
    """Wait until every wgmma this warpgroup issued has finished (``wgmma.wait_group 0``).

    The weight tile is the wgmma's register operand, and PTX leaves it undefined to write those
    registers while a wgmma that reads them is in flight. Triton 3.6 splits the tile's dot into
    k16 sub-dots and lets the last three run on at the end of an iteration, and the next
    iteration's conversion then reuses their registers: wrong results whenever the MMAs lag
    (seen on the H200 under load: SQNR below 0 dB). One wait per step closes that."""
    return tl.inline_asm_elementwise("wgmma.wait_group.sync.aligned 0;\nmov.b32 $0, $1;", "=r,r", [k],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _convert_portable(p, zclo, zchi, slo, shi, IS_BF16: tl.constexpr, GROUPED: tl.constexpr):
    """``_convert_asm`` in plain Triton (the interpreter, which runs no PTX): same values."""
    magic, _ = _magic(IS_BF16)
    a0, b0 = tl.split(_halves((p & 0x000F000F) | magic, IS_BF16))
    a1, b1 = tl.split(_halves(((p >> 4) & 0x000F000F) | magic, IS_BF16))
    a2, b2 = tl.split(_halves(((p >> 8) & 0x000F000F) | magic, IS_BF16))
    a3, b3 = tl.split(_halves(((p >> 12) & 0x000F000F) | magic, IS_BF16))
    return (_dequant_values(a0, zclo, slo, GROUPED, IS_BF16), _dequant_values(b0, zclo, slo, GROUPED, IS_BF16),
            _dequant_values(a1, zchi, shi, GROUPED, IS_BF16), _dequant_values(b1, zchi, shi, GROUPED, IS_BF16),
            _dequant_values(a2, zclo, slo, GROUPED, IS_BF16), _dequant_values(b2, zclo, slo, GROUPED, IS_BF16),
            _dequant_values(a3, zchi, shi, GROUPED, IS_BF16), _dequant_values(b3, zchi, shi, GROUPED, IS_BF16))


@triton.jit
def _assemble(v0, v1, v2, v3, v4, v5, v6, v7, BN: tl.constexpr, BK: tl.constexpr):
    """[KB, T, 8 (g), 4 (q), 4 (c)] values of (pair j, half h) = v[2j + h] -> the [BN, BK] tile:
    row 16 t + 8 (j % 2) + g, k 64 kb + 16 c + 8 (j // 2) + 2 q + h (the main loop takes one
    64-input block at a time: KB = 1)."""
    e0 = tl.join(v0, v1)   # pair 0: [..., h]
    e1 = tl.join(v2, v3)
    e2 = tl.join(v4, v5)
    e3 = tl.join(v6, v7)
    # tl.join adds its new axis last: [KB, T, G, Q, C, h, j0, j1]
    f = tl.join(tl.join(e0, e1), tl.join(e2, e3))
    f = tl.permute(f, (1, 6, 2, 0, 4, 7, 3, 5))   # [T, j0, G, KB, C, j1, Q, h]
    return tl.reshape(f, (BN, BK))


@triton.jit
def _tile_rows(n0, N, BN: tl.constexpr):
    """Rows g and g + 8 of each 16-row tile of features n0 .. n0 + BN, shaped to broadcast over the
    words [1, T, G, Q, C], and whether each tile is inside the layer; the tiles' indices."""
    T: tl.constexpr = BN // 16
    offs_t = n0 // 16 + tl.arange(0, T)
    t_ok = offs_t < N // 16
    t5 = tl.reshape(offs_t, (1, T, 1, 1, 1))
    g5 = tl.reshape(tl.arange(0, 8), (1, 1, 8, 1, 1))
    row_lo = t5 * 16 + g5
    row_ok = tl.reshape(t_ok, (1, T, 1, 1, 1)) & (g5 >= 0)
    return offs_t, t_ok, row_lo, row_lo + 8, row_ok


@triton.jit
def _rows_pair(ptr, g_off, row_lo, row_hi, row_ok):
    """(values at row_lo, values at row_hi) of a (groups, N) table at group offset g_off, fp32."""
    lo = tl.load(ptr + g_off + row_lo, mask=row_ok, other=0)
    hi = tl.load(ptr + g_off + row_hi, mask=row_ok, other=0)
    return lo.to(tl.float32), hi.to(tl.float32)


@triton.jit
def _group_params(scales_ptr, zeros_ptr, k, kofs, row_lo, row_hi, row_ok, N, base,
                  GROUP: tl.constexpr, SYMMETRIC: tl.constexpr):
    """Scales and BASE + zero points of rows g and g + 8 for the groups of step k (fp32); GROUP 0:
    the per-channel ones."""
    if GROUP > 0:
        g_off = ((k + kofs) // GROUP) * N
    else:
        g_off = kofs * 0
    s_lo, s_hi = _rows_pair(scales_ptr, g_off, row_lo, row_hi, row_ok)
    if SYMMETRIC:
        zc_lo = tl.zeros_like(s_lo) + (base + 8.0)
        zc_hi = zc_lo
    else:
        z_lo, z_hi = _rows_pair(zeros_ptr, g_off, row_lo, row_hi, row_ok)
        zc_lo = base + z_lo
        zc_hi = base + z_hi
    return s_lo, s_hi, zc_lo, zc_hi


@triton.jit
def _weight_tile(p, s_lo, s_hi, zc_lo, zc_hi, IS_BF16: tl.constexpr, GROUPED: tl.constexpr, ASM: tl.constexpr,
               BN: tl.constexpr):
    """The [BN, 64] weight tile of fragment words p [BN / 16, 128] (one 64-input block):
    (c - z) · s (GROUPED) or (c - z), rounded once to the activation dtype; scales and zero points
    as ``_group_params``."""
    p5 = tl.reshape(p, (1, BN // 16, 8, 4, 4))
    if ASM:
        if IS_BF16:
            v0, v1, v2, v3, v4, v5, v6, v7 = _convert_asm(p5, _pair16(zc_lo, True), _pair16(zc_hi, True), s_lo, s_hi,
                                                       True, GROUPED)
        else:
            v0, v1, v2, v3, v4, v5, v6, v7 = _convert_asm(p5, _pair16(zc_lo, False), _pair16(zc_hi, False),
                                                       _pair16(s_lo, False), _pair16(s_hi, False), False, GROUPED)
    else:
        v0, v1, v2, v3, v4, v5, v6, v7 = _convert_portable(p5, zc_lo, zc_hi, s_lo, s_hi, IS_BF16, GROUPED)
    return _assemble(v0, v1, v2, v3, v4, v5, v6, v7, BN, 64)


@triton.jit
def _kofs(GROUP: tl.constexpr):
    """k offsets within a 64-input block of the cells where scales change: one per k16 chunk for
    groups of 32, else one. Those scales are loaded in the words' own shape [1, T, 8, 4, 4] (a
    lane's four chunks), which keeps the compiler's layouts those of the words."""
    if GROUP > 0 and GROUP < 64:
        return tl.arange(0, 4)[None, None, None, None, :] * 16 + tl.arange(0, 4)[None, None, None, :, None] * 0
    else:
        return tl.zeros((1, 1, 1, 1, 1), tl.int32)


@triton.jit
def _fragment_mainloop(x_ptr, qw_ptr, scales_ptr, zeros_ptr, n0, k_lo, k_hi, offs_m, m_mask, N, K, stride_xm,
                       GROUP: tl.constexpr, SYMMETRIC: tl.constexpr, IS_BF16: tl.constexpr, BN: tl.constexpr,
                       BK: tl.constexpr, BM: tl.constexpr, DOT_F32: tl.constexpr, ASM: tl.constexpr):
    """accT [BN, BM] for output features n0 .. n0 + BN over K range [k_lo, k_hi), scales applied
    (module docstring). n0 and BN are multiples of 16, k_lo and k_hi of BK (64, or 128 when a group
    spans a whole step); an empty range (k_lo >= k_hi: the last splits of a K that split-K does not
    divide) gives zeros."""
    GROUPED: tl.constexpr = GROUP > 0
    KB: tl.constexpr = BK // 64
    tl.static_assert(KB == 1 or not GROUPED or GROUP >= BK, "BK 128 needs groups of at least 128 inputs")
    _, base = _magic(IS_BF16)  # the 16-bit float whose mantissa step is 1
    offs_t, t_ok, row_lo, row_hi, row_ok = _tile_rows(n0, N, BN)
    # one [T, 128] load per 64-input block: a lane's four words contiguous, the rows of 16-row
    # tiles split over the warps as the MMA splits them (a wider row lets the compiler put warps
    # along k, and the tile then takes a trip through shared memory)
    offs_w = tl.arange(0, 128)
    w_ptrs = qw_ptr + offs_t[:, None] * (2 * K) + offs_w[None, :]
    w_mask = t_ok[:, None] & (offs_w[None, :] >= 0)
    kofs = _kofs(GROUP)
    # the last step of the range, in bounds even when the range is empty
    k_last = k_hi - BK
    if GROUPED:
        # register prefetch: the scales (2-byte loads, which the shared-memory pipeline does not
        # take) of step k + BK are loaded during step k
        s_lo, s_hi, zc_lo, zc_hi = _group_params(scales_ptr, zeros_ptr, tl.minimum(k_lo, k_last), kofs, row_lo,
                                                 row_hi, row_ok, N, base, GROUP, SYMMETRIC)
    else:
        s_lo = tl.full((1, 1, 1, 1, 1), 1.0, tl.float32)
        s_hi = s_lo
        if SYMMETRIC:
            zc_lo = tl.full((1, 1, 1, 1, 1), base + 8.0, tl.float32)
            zc_hi = zc_lo
        else:
            z_lo, z_hi = _rows_pair(zeros_ptr, 0, row_lo, row_hi, row_ok)
            zc_lo = base + z_lo
            zc_hi = base + z_hi
    x_ptrs = x_ptr + offs_m[None, :] * stride_xm + tl.arange(0, 64)[:, None]
    accT = tl.zeros((BN, BM), tl.float32)
    for k in range(k_lo, k_hi, BK):
        if GROUPED:
            ns_lo, ns_hi, nzc_lo, nzc_hi = _group_params(scales_ptr, zeros_ptr, tl.minimum(k + BK, k_last), kofs,
                                                         row_lo, row_hi, row_ok, N, base, GROUP, SYMMETRIC)
        for kb in tl.static_range(KB):
            p = tl.load(w_ptrs + 2 * k + 128 * kb, mask=w_mask, other=0)
            w = _weight_tile(p, s_lo, s_hi, zc_lo, zc_hi, IS_BF16, GROUPED, ASM, BN)
            xt = tl.load(x_ptrs + k + 64 * kb, mask=m_mask[None, :], other=0.0)
            accT = _dot(w, xt, accT, DOT_F32)
        if ASM:
            _wgmma_drain(k)
        if GROUPED:
            s_lo, s_hi, zc_lo, zc_hi = ns_lo, ns_hi, nzc_lo, nzc_hi
    if not GROUPED:
        offs_n = n0 + tl.arange(0, BN)
        accT = accT * tl.load(scales_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
    return accT


@triton.jit
def _dequant_fragment_kernel(qw_ptr, scales_ptr, zeros_ptr, w_ptr, N, K, stride_wn,
                             GROUP: tl.constexpr, SYMMETRIC: tl.constexpr, IS_BF16: tl.constexpr, BN: tl.constexpr,
                             ASM: tl.constexpr):
    """W_hat (N, K) of the fragment layout, one [BN, 64] tile a program (the dequantize + cuBLAS
    path)."""
    pid = tl.program_id(0)
    k_tiles = K // 64
    n0 = (pid // k_tiles) * BN
    k = (pid % k_tiles) * 64
    _, base = _magic(IS_BF16)  # the 16-bit float whose mantissa step is 1
    offs_t, t_ok, row_lo, row_hi, row_ok = _tile_rows(n0, N, BN)
    offs_w = tl.arange(0, 128)
    p = tl.load(qw_ptr + offs_t[:, None] * (2 * K) + 2 * k + offs_w[None, :], mask=t_ok[:, None], other=0)
    s_lo, s_hi, zc_lo, zc_hi = _group_params(scales_ptr, zeros_ptr, k, _kofs(GROUP), row_lo, row_hi, row_ok, N,
                                             base, GROUP, SYMMETRIC)
    w = _weight_tile(p, s_lo, s_hi, zc_lo, zc_hi, IS_BF16, True, ASM, BN)
    offs_n = n0 + tl.arange(0, BN)
    tl.store(w_ptr + offs_n[:, None] * stride_wn + k + tl.arange(0, 64)[None, :], w, mask=(offs_n < N)[:, None])
