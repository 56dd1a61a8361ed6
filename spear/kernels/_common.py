"""Triton building blocks shared by the W4 GEMM and the compensator kernels.

Tiles are kept transposed (output features along dim 0, tokens along dim 1): the weight
tile is then the left dot operand, which Hopper's tensor cores can read from registers,
so the dequantized weights never take a round trip through shared memory.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

# Triton's CPU interpreter (TRITON_INTERPRET=1, what CI runs) multiplies bf16 dot operands
# as their raw 16-bit patterns, and does bf16 elementwise math on them as integers. Under
# it, dots take fp32 copies of their operands; products of fp16/bf16 values are exact in
# fp32, so this computes what the tensor cores compute.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


# Programmatic dependent launch (Hopper): a kernel launched with it may start while the kernel
# before it in the stream still runs, as that kernel's programs exit; it must wait
# (griddepcontrol.wait) before it reads or writes anything the earlier kernel touches. The decode
# kernels use the time to load their weights. Each launcher takes the level (0 off, 1 on) from
# its caller (KernelPolicy.pdl_level), so a CUDA graph captures the level it was recorded with.
try:
    from triton.language.extra.cuda import gdc_wait
    PDL_AVAILABLE = not INTERPRET
except ImportError:  # a Triton without griddepcontrol
    PDL_AVAILABLE = False


def pdl_args(level: int) -> dict:
    """The ``PDL`` constexpr and launch option of a decode kernel's launch at ``level`` (0 or 1)."""
    if level not in (0, 1):
        raise ValueError(f"the PDL level is 0 (off) or 1 (wait), got {level!r}")
    if level and not PDL_AVAILABLE:
        raise ValueError("programmatic dependent launch needs Triton's griddepcontrol and a GPU (not the interpreter)")
    return dict(PDL=1, launch_pdl=True) if level else dict(PDL=0)


@triton.jit
def _pdl_wait(PDL: tl.constexpr):
    """Wait until the kernel before this one has finished and its writes are visible."""
    if PDL:
        gdc_wait()


@triton.jit
def _dot(a, b, acc, DOT_F32: tl.constexpr):
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _halves(m, IS_BF16: tl.constexpr):
    """Split int32 words holding two 16-bit float bit patterns into two float tensors."""
    lo = m.to(tl.int16)
    hi = (m >> 16).to(tl.int16)
    if IS_BF16:
        return tl.join(lo.to(tl.bfloat16, bitcast=True), hi.to(tl.bfloat16, bitcast=True))
    else:
        return tl.join(lo.to(tl.float16, bitcast=True), hi.to(tl.float16, bitcast=True))


@triton.jit
def _unpack_w4(p, BN: tl.constexpr, BK: tl.constexpr, IS_BF16: tl.constexpr):
    """N-major [BN, BK/8] int32 words -> [BN, BK] floats equal to BASE + code, exactly.

    Each code is OR-ed into the mantissa of a float whose exponent makes one mantissa
    step equal 1 (fp16 0x6400 = 1024, bf16 0x4300 = 128), so no int->float conversion
    is needed. The mask 0x000F000F takes two codes per 32-bit operation (nibbles i and
    i+4); the join tree then puts nibble i at its k-offset NIBBLE_K[i] (layout.py).
    ``tl.join`` adds the new axis innermost and the reshape reads the last axes in row-major
    order, so the order of the joins decides the k order.
    """
    if IS_BF16:
        magic = 0x43004300
    else:
        magic = 0x64006400
    t0 = _halves((p & 0x000F000F) | magic, IS_BF16)
    t1 = _halves(((p >> 4) & 0x000F000F) | magic, IS_BF16)
    t2 = _halves(((p >> 8) & 0x000F000F) | magic, IS_BF16)
    t3 = _halves(((p >> 12) & 0x000F000F) | magic, IS_BF16)
    w = tl.join(tl.join(t0, t1), tl.join(t2, t3))
    return tl.reshape(w, (BN, BK))


@triton.jit
def _dequant(w, zc, s, GROUPED: tl.constexpr, IS_BF16: tl.constexpr):
    """w = BASE + code [BN, BK]; zc = BASE + zero and s = scale, [BN] fp32.

    Returns (code - zero) * scale (GROUPED) or (code - zero) in the activation dtype,
    rounded once, as the reference dequantization rounds W_hat once. fp16: the subtraction
    is exact in fp16 and the product rounds once. bf16 (whose elementwise math the
    interpreter cannot do): w*s and zc*s are exact in fp32, so the fp32 difference is the
    exact (code - zero) * scale, rounded once to bf16.
    """
    if IS_BF16:
        wf = w.to(tl.float32)
        if GROUPED:
            wf = wf * s[:, None] - (zc * s)[:, None]
        else:
            wf = wf - zc[:, None]
        return wf.to(tl.bfloat16)
    else:
        w = w - zc.to(tl.float16)[:, None]
        if GROUPED:
            w = w * s.to(tl.float16)[:, None]
        return w


@triton.jit
def _sigmoid(z):
    # exp of a non-positive argument only: no overflow for large |z|
    e = tl.exp(-tl.abs(z))
    return tl.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


@triton.jit
def _tanh(z):
    e = tl.exp(-2.0 * tl.abs(z))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(z >= 0, t, -t)


@triton.jit
def _gate_params(w1_ptr, b1_ptr, w2_ptr, b2_ptr, R: tl.constexpr, H: tl.constexpr):
    """The gate MLP's weights, transposed for ``_gate_apply``: w1ᵀ [R, H], b1 [H], w2ᵀ [H, R], b2 [R]
    (stored as w1 (H, R) and w2 (R, H), layout.py)."""
    offs_r = tl.arange(0, R)
    offs_h = tl.arange(0, H)
    w1t = tl.load(w1_ptr + offs_r[:, None] + offs_h[None, :] * R)
    b1 = tl.load(b1_ptr + offs_h)
    w2t = tl.load(w2_ptr + offs_h[:, None] + offs_r[None, :] * H)
    b2 = tl.load(b2_ptr + offs_r)
    return w1t, b1, w2t, b2


@triton.jit
def _gate_apply(uT, w1t, b1, w2t, b2, bound, H: tl.constexpr, BM: tl.constexpr, R: tl.constexpr,
                DOT_F32: tl.constexpr):
    """v = gamma(u) ⊙ u on a transposed tile uT [R, BM] fp32 (ranks x tokens), the gate's weights
    given (``_gate_params``). The two small dots take the gate input in the parameter dtype
    (tensor cores); the nonlinearities and the product with u stay in fp32.

    The dots are token-major, [BM, R] · [R, H] and [BM, H] · [H, R]: the token tile is their M.
    With the ranks as M instead (W1 [H, R] · uT [R, BM]), a 64-wide gate makes a Hopper wgmma of
    N = BM = 16 whose shared-memory operand Triton 3.6 addresses out of bounds (compute-sanitizer:
    invalid __shared__ reads; illegal-address faults in the engine at rank or gate width >= 64).
    A token tile below 64 is an mma.sync product, which needs no shared-memory operand."""
    u = tl.trans(uT)
    h = _dot(u.to(w1t.dtype), w1t, tl.zeros((BM, H), tl.float32), DOT_F32)
    h = h + b1.to(tl.float32)[None, :]
    h = h * _sigmoid(h)
    g = _dot(h.to(w2t.dtype), w2t, tl.zeros((BM, R), tl.float32), DOT_F32)
    g = g + b2.to(tl.float32)[None, :]
    return tl.trans((1.0 + bound * _tanh(g)) * u)


@triton.jit
def _ec_gate(uT, w1_ptr, b1_ptr, w2_ptr, b2_ptr, bound,
             R: tl.constexpr, H: tl.constexpr, BM: tl.constexpr, GATE: tl.constexpr, DOT_F32: tl.constexpr):
    """v = gamma(u) ⊙ u on a transposed tile uT [R, BM] fp32 (ranks x tokens); GATE False: v = u."""
    if GATE:
        w1t, b1, w2t, b2 = _gate_params(w1_ptr, b1_ptr, w2_ptr, b2_ptr, R, H)
        return _gate_apply(uT, w1t, b1, w2t, b2, bound, H, BM, R, DOT_F32)
    else:
        return uT


# Packed words against their activations, in PTX: Triton cannot view a 32-bit register as two
# fp16 lanes, which is what the conversion needs to cost one LOP3 per two codes.
# Per word (two per call, so the fp32 conversion is paid once per pair): the mask 0x000F000F
# OR-ed with fp16x2 1024 takes nibbles (0, 4) as 1024 + code, the
# mask 0x00F000F0 takes nibbles (1, 5) as 1024 + 16 code without a shift, and the same two
# masks take (2, 6) and (3, 7) from the word shifted by 8. One FMA each turns them into
# (code - zero) / 16 exactly: (1024 + c) / 16 - (1024 + z) / 16 and (1024 + 16 c) / 256 -
# (64 + z) / 16. The four fp16x2 activation pairs match the four code pairs; products and
# partial sums are fp16x2.
# Only for fp16 activations on CUDA; the interpreter cannot run PTX.
@triton.jit
def _word2_dot(p, q, zn, zn16, x0, x1, x2, x3, y0, y1, y2, y3):
    """Sum over two words' 16 codes of (code - zero)/16 * x, elementwise over int32 tensors; fp32.

    p against the activation pairs x0..x3, q against y0..y3, in one fp16x2 accumulator (8
    products per lane before the single conversion to fp32). zn, zn16: ``_neg_zero_pairs`` of
    the zero points. The assembly is a literal here rather than a module-level constant:
    torch.compile copies user Triton kernels with the jit functions they call, not with their
    global constants.
    """
    return tl.inline_asm_elementwise("""{
.reg .b32 t0, t1, t2, t3, s, acc, c16, c256;
.reg .f16 lo, hi;
.reg .f32 flo, fhi;
mov.b32 c16, 0x2c002c00;
mov.b32 c256, 0x1c001c00;
shr.u32 s, $1, 8;
lop3.b32 t0, $1, 0x000f000f, 0x64006400, 0xea;
lop3.b32 t1, $1, 0x00f000f0, 0x64006400, 0xea;
lop3.b32 t2, s, 0x000f000f, 0x64006400, 0xea;
lop3.b32 t3, s, 0x00f000f0, 0x64006400, 0xea;
fma.rn.f16x2 t0, t0, c16, $3;
fma.rn.f16x2 t1, t1, c256, $4;
fma.rn.f16x2 t2, t2, c16, $3;
fma.rn.f16x2 t3, t3, c256, $4;
mul.rn.f16x2 acc, t0, $5;
fma.rn.f16x2 acc, t1, $6, acc;
fma.rn.f16x2 acc, t2, $7, acc;
fma.rn.f16x2 acc, t3, $8, acc;
shr.u32 s, $2, 8;
lop3.b32 t0, $2, 0x000f000f, 0x64006400, 0xea;
lop3.b32 t1, $2, 0x00f000f0, 0x64006400, 0xea;
lop3.b32 t2, s, 0x000f000f, 0x64006400, 0xea;
lop3.b32 t3, s, 0x00f000f0, 0x64006400, 0xea;
fma.rn.f16x2 t0, t0, c16, $3;
fma.rn.f16x2 t1, t1, c256, $4;
fma.rn.f16x2 t2, t2, c16, $3;
fma.rn.f16x2 t3, t3, c256, $4;
fma.rn.f16x2 acc, t0, $9, acc;
fma.rn.f16x2 acc, t1, $10, acc;
fma.rn.f16x2 acc, t2, $11, acc;
fma.rn.f16x2 acc, t3, $12, acc;
mov.b32 {lo, hi}, acc;
cvt.f32.f16 flo, lo;
cvt.f32.f16 fhi, hi;
add.f32 $0, flo, fhi;
}""", "=f,r,r,r,r,r,r,r,r,r,r,r,r", [p, q, zn, zn16, x0, x1, x2, x3, y0, y1, y2, y3],
                                     dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _signal(ptr):
    """Add 1 to the int32 at ``ptr`` from the program's first thread without waiting for the
    result (a ``red``, not an ``atom``): ``tl.atomic_add`` hands its result to every thread
    through shared memory, which puts a round trip on the program's path even when the result is
    not needed. CUDA only (inline PTX). Call it after a barrier when every warp must have passed
    what the signal stands for."""
    tl.inline_asm_elementwise("""{
        .reg .pred p;
        .reg .b32 t;
        mov.u32 t, %tid.x;
        setp.eq.u32 p, t, 0;
        @p red.relaxed.gpu.global.add.s32 [$1], 1;
        mov.u32 $0, 0;
    }""", "=r,l", [ptr], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _wait_above(ptr, level, PORTABLE: tl.constexpr):
    """Spin until the int32 at ``ptr`` exceeds ``level``; the load that sees it has acquire
    semantics, so what the releasing program wrote before is visible after. On the GPU each
    thread polls with ``ld.acquire.gpu`` (one round trip for the last poll); PORTABLE (the
    interpreter, which has no inline PTX): volatile polls, then one acquiring atomic, a second
    round trip."""
    if PORTABLE:
        while tl.load(ptr, volatile=True) <= level:
            pass
        tl.atomic_add(ptr, 0, sem="acquire")
    else:
        while tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                        is_pure=False, pack=1) <= level:
            pass


@triton.jit
def _half_pair(v):
    """int32 words holding fp16(v) in both halves."""
    h = v.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return h | (h << 16)


@triton.jit
def _neg_zero_pairs(z):
    """``_word2_dot``'s offsets for zero points z: fp16x2 -(1024 + z) / 16 and -(64 + z) / 16 (exact)."""
    return _half_pair(-(1024.0 + z) * 0.0625), _half_pair(-(64.0 + z) * 0.0625)


@triton.jit
def _column0(acc, BM: tl.constexpr):
    """accT [BN, BM] of one token: column 0 holds acc's row sums, the others zeros."""
    return tl.where(tl.arange(0, BM)[None, :] == 0, tl.sum(acc, axis=1)[:, None], 0.0)


@triton.jit
def _magic(IS_BF16: tl.constexpr):
    """(two 16-bit floats whose mantissa step is 1, as an int32 OR mask; that float's value)."""
    if IS_BF16:
        return 0x43004300, 128.0
    else:
        return 0x64006400, 1024.0


@triton.jit
def _sum_partials(ptrs, part_stride, mask, acc, N_PARTS: tl.constexpr, CHUNK: tl.constexpr):
    """acc + the sum of N_PARTS fp32 partial tiles at ptrs + i * part_stride, in index order.
    CHUNK loads are in flight at a time: one L2 round trip per CHUNK partials, and registers for
    CHUNK tiles only (for the [BN, BM] output tiles a full unroll of 16 raised the kernel to ~190
    registers, so they take 4; u's [R, BM] partials take up to 4096 values per round trip: all 16 at rank 16)."""
    for s0 in range(0, N_PARTS, CHUNK):
        for j in tl.static_range(CHUNK):
            if j < N_PARTS:
                # .cg: read at L2, where the other programs' writes are
                acc += tl.load(ptrs + (s0 + j) * part_stride, mask=mask & (s0 + j < N_PARTS), other=0.0,
                               cache_modifier=".cg")
    return acc


# The interpreter's fp32 -> bf16 cast truncates; under it, bf16 is rounded to nearest even
# with integer ops first (the GPU's cast already rounds so).
_SOFT_BF16: tl.constexpr = tl.constexpr(INTERPRET)


@triton.jit
def _to(x, dt: tl.constexpr):
    """fp32 ``x`` rounded to nearest even in ``dt``."""
    if _SOFT_BF16 and dt == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        return tl.where(x == x, b.to(tl.float32, bitcast=True), x).to(dt)
    else:
        return x.to(dt)


@triton.jit
def _dequant_values(v, zc, s, GROUPED: tl.constexpr, IS_BF16: tl.constexpr):
    """(c - z) · s (GROUPED) or (c - z) of BASE + c values ``v``, rounded once to the activation
    dtype, elementwise with broadcast fp32 ``zc`` (BASE + z) and ``s``. fp16: the subtraction is
    exact in fp16 and the product rounds once; bf16: exact in fp32, rounded once to bf16 (to
    nearest even, the interpreter too)."""
    if IS_BF16:
        vf = v.to(tl.float32)
        if GROUPED:
            vf = vf * s - zc * s
        else:
            vf = vf - zc
        return _to(vf, tl.bfloat16)
    else:
        w = v - zc.to(tl.float16)
        if GROUPED:
            w = w * s.to(tl.float16)
        return w

