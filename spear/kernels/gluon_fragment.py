"""Gluon pieces of the warp-specialized W4A16 GEMM (gluon_w4.py) that work on the fragment
layout's values: the codes of a fragment word turned into the wgmma's 16-bit register operand
(``_fragment._convert_asm``'s PTX), the scales and zero points of a block read from the stage ring's
shared memory, and the compensator's epilogue wgmma. Hopper (sm_90) only; nothing here runs under
Triton's interpreter."""

from __future__ import annotations

from spear.kernels._fragment import _convert_ptx

try:  # Gluon ships inside Triton 3.5+; absent or partial elsewhere
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait
    HAVE_GLUON = True
except Exception:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False

if HAVE_GLUON:
    # shared_memory_descriptor.reinterpret is public from Triton 3.7 on, ``_reinterpret`` before
    _PUBLIC_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))
    # the partition barrier ``barrier`` (``thread_barrier`` before)
    _barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
    _PTX = {(bf16, grouped): gl.constexpr(_convert_ptx(bf16, grouped)) for bf16 in (False, True)
            for grouped in (False, True)}
    _PTX_F16, _PTX_F16_G = _PTX[(False, False)], _PTX[(False, True)]
    _PTX_BF16, _PTX_BF16_G = _PTX[(True, False)], _PTX[(True, True)]

    @gluon.jit
    def _pair16(v, IS_BF16: gl.constexpr):
        """int32 words holding the 16-bit float v (fp32 in) in both halves (``_fragment._pair16``: a Gluon
        function cannot call a triton.jit one)."""
        if IS_BF16:
            h = v.to(gl.bfloat16).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
        else:
            h = v.to(gl.float16).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
        return h | (h << 16)

    @gluon.jit
    def _convert(p, zlo, zhi, slo, shi, IS_BF16: gl.constexpr, GROUPED: gl.constexpr):
        """The eight 16-bit weights of each fragment word p (``_fragment._convert_asm``'s PTX)."""
        if IS_BF16:
            if GROUPED:
                return gl.inline_asm_elementwise(_PTX_BF16_G, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,f,f",
                                                 [p, zlo, zhi, slo, shi], dtype=(gl.bfloat16,) * 8, is_pure=True,
                                                 pack=1)
            else:
                return gl.inline_asm_elementwise(_PTX_BF16, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [p, zlo, zhi],
                                                 dtype=(gl.bfloat16,) * 8, is_pure=True, pack=1)
        else:
            if GROUPED:
                return gl.inline_asm_elementwise(_PTX_F16_G, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r,r",
                                                 [p, zlo, zhi, slo, shi], dtype=(gl.float16,) * 8, is_pure=True,
                                                 pack=1)
            else:
                return gl.inline_asm_elementwise(_PTX_F16, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [p, zlo, zhi],
                                                 dtype=(gl.float16,) * 8, is_pure=True, pack=1)

    @gluon.jit
    def _a_tile(p, zlo, zhi, slo, shi, a_layout: gl.constexpr, IS_BF16: gl.constexpr, GROUPED: gl.constexpr,
                BNC: gl.constexpr):
        """Words p [T, 8 (g), 4 (q), 4 (c)] -> the [BNC, 64] register operand of the wgmma: value
        (pair j, half h) of word (t, g, q, c) is row 16t + 8(j % 2) + g, input 16c + 8(j // 2) +
        2q + h. The words sit where the MMA wants their values, so this is register renaming
        (checked: convert_layout(assert_trivial=True))."""
        v0, v1, v2, v3, v4, v5, v6, v7 = _convert(p, zlo, zhi, slo, shi, IS_BF16, GROUPED)
        f = gl.join(gl.join(gl.join(v0, v1), gl.join(v2, v3)), gl.join(gl.join(v4, v5), gl.join(v6, v7)))
        # [t, g, q, c, h, j0, j1] -> [t, j0, g | c, j1, q, h]
        f = gl.permute(f, (0, 5, 1, 3, 6, 2, 4))
        return gl.convert_layout(gl.reshape(f, [BNC, 64]), a_layout, assert_trivial=True)

    @gluon.jit
    def _plain(buf, dtype: gl.constexpr, STAGES: gl.constexpr, GS: gl.constexpr, BN: gl.constexpr):
        """A stage ring [STAGES, GS, BN] of TMA boxes without swizzle, seen as the plain row-major
        [STAGES * GS, BN / 16, 16] it is: one row per (stage, group), one line per 16-row tile."""
        layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])  # of the indexed rows
        if _PUBLIC_REINTERPRET:
            return buf.reinterpret(dtype, [STAGES * GS, BN // 16, 16], layout)
        else:
            return buf._reinterpret(dtype, [STAGES * GS, BN // 16, 16], layout)

    @gluon.jit
    def _rows16(plain, row, t0: gl.constexpr, T: gl.constexpr, rows_layout: gl.constexpr):
        """Values of rows g and g + 8 of 16-row tiles t0 .. t0 + T in row ``row`` of a ``_plain``
        view, as fp32 [T, 8] each."""
        v = plain.index(row).slice(t0, T)
        lo = v.slice(0, 8, dim=1).load(rows_layout).to(gl.float32)
        return lo, v.slice(8, 8, dim=1).load(rows_layout).to(gl.float32)

    @gluon.jit
    def _block_params(s_plain, z_plain, r0, kb: gl.constexpr, t0: gl.constexpr, rows_layout: gl.constexpr,
                      c_layout: gl.constexpr, base, T: gl.constexpr, GROUP: gl.constexpr,
                      SYMMETRIC: gl.constexpr):
        """Scales and BASE + zero points of rows g, g + 8 for 64-input block kb of a stage, shaped to
        broadcast over the words [T, 8, 4, 4] (groups of 32: per k16 chunk c); r0 is the stage's first
        row in the ``_plain`` views."""
        if GROUP >= 64:
            gi: gl.constexpr = (64 * kb) // GROUP
            s_lo, s_hi = _rows16(s_plain, r0 + gi, t0, T, rows_layout)
            if SYMMETRIC:
                z_lo = gl.full([T, 8], 8.0, gl.float32, rows_layout)
                z_hi = z_lo
            else:
                z_lo, z_hi = _rows16(z_plain, r0 + gi, t0, T, rows_layout)
            s_lo = gl.expand_dims(gl.expand_dims(s_lo, 2), 3)
            s_hi = gl.expand_dims(gl.expand_dims(s_hi, 2), 3)
            z_lo = gl.expand_dims(gl.expand_dims(z_lo, 2), 3)
            z_hi = gl.expand_dims(gl.expand_dims(z_hi, 2), 3)
        else:  # groups of 32: chunks 0, 1 take row 2kb, chunks 2, 3 row 2kb + 1
            a_lo, a_hi = _rows16(s_plain, r0 + 2 * kb, t0, T, rows_layout)
            b_lo, b_hi = _rows16(s_plain, r0 + 2 * kb + 1, t0, T, rows_layout)
            first = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.arange(0, 4, c_layout) < 2, 0), 0), 0)
            s_lo = gl.where(first, gl.expand_dims(gl.expand_dims(a_lo, 2), 3), gl.expand_dims(gl.expand_dims(b_lo, 2), 3))
            s_hi = gl.where(first, gl.expand_dims(gl.expand_dims(a_hi, 2), 3), gl.expand_dims(gl.expand_dims(b_hi, 2), 3))
            if SYMMETRIC:
                z_lo = gl.expand_dims(gl.expand_dims(gl.full([T, 8], 8.0, gl.float32, rows_layout), 2), 3)
                z_hi = z_lo
            else:
                za_lo, za_hi = _rows16(z_plain, r0 + 2 * kb, t0, T, rows_layout)
                zb_lo, zb_hi = _rows16(z_plain, r0 + 2 * kb + 1, t0, T, rows_layout)
                z_lo = gl.where(first, gl.expand_dims(gl.expand_dims(za_lo, 2), 3), gl.expand_dims(gl.expand_dims(zb_lo, 2), 3))
                z_hi = gl.where(first, gl.expand_dims(gl.expand_dims(za_hi, 2), 3), gl.expand_dims(gl.expand_dims(zb_hi, 2), 3))
        return s_lo, s_hi, z_lo + base, z_hi + base

    @gluon.jit
    def _ec_epilogue(acc, b_ptr, v_ptr, alpha, rows, r_ok, m0, M, v_smem, a_layout: gl.constexpr, dtype: gl.constexpr,
                     BM: gl.constexpr, R: gl.constexpr):
        """acc [BNC, BM] + (alpha B)[rows, :R] · v[m0 .. m0 + BM, :R]ᵀ: alpha B rounded once to the
        activation dtype (the register operand), v through shared memory (B operand), fp32 sums."""
        BNC: gl.constexpr = acc.shape[0]
        bl: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        cols_r = gl.arange(0, R, gl.SliceLayout(0, bl))
        rows_b = gl.convert_layout(rows, gl.SliceLayout(1, bl))
        ok_b = gl.convert_layout(r_ok, gl.SliceLayout(1, bl))
        bt = gl.load(b_ptr + gl.expand_dims(rows_b, 1) * R + gl.expand_dims(cols_r, 0), mask=gl.expand_dims(ok_b, 1),
                     other=0.0)
        bt = gl.convert_layout((bt.to(gl.float32) * alpha).to(dtype), a_layout)
        vr = m0 + gl.arange(0, BM, gl.SliceLayout(1, bl))
        vt = gl.load(v_ptr + gl.expand_dims(vr, 1) * R + gl.expand_dims(cols_r, 0), mask=gl.expand_dims(vr < M, 1),
                     other=0.0)
        _barrier()  # every warp is done with the last tile's v
        v_smem.store(vt)
        fence_async_shared()
        _barrier()
        acc = warpgroup_mma(bt, v_smem.permute((1, 0)), acc, is_async=True)
        acc, bt = warpgroup_mma_wait(num_outstanding=0, deps=(acc, bt))
        return acc
