"""Triton building blocks shared by the W4 GEMM and the compensator kernels.

Tiles are kept transposed (output features along dim 0, tokens along dim 1): the weight
tile is then the left dot operand, which Hopper's tensor cores can read from registers,
so the dequantized weights never take a round trip through shared memory.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Triton's CPU interpreter (TRITON_INTERPRET=1, what CI runs) multiplies bf16 dot operands
# as their raw 16-bit patterns, and does bf16 elementwise math on them as integers. Under
# it, dots take fp32 copies of their operands; products of fp16/bf16 values are exact in
# fp32, so this computes what the tensor cores compute.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def alloc(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """Every output and workspace buffer of the launchers; tests swap it for a NaN-filled one."""
    return torch.empty(shape, dtype=dtype, device=device)


# Programmatic dependent launch (Hopper): a kernel launched with it may start while the kernel
# before it in the stream still runs, once every program of that one has started; it must wait
# (griddepcontrol.wait) before it reads or writes anything the earlier kernel touches. The decode
# kernels use the time to load their weights. Off by default; ``set_pdl`` turns it on for the
# kernels of the decode step (W4 GEMM, RMSNorm, rotary + KV write, SiLU·mul, paged attention).
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    PDL_AVAILABLE = True
except ImportError:  # a Triton without griddepcontrol
    PDL_AVAILABLE = False
_PDL = [False]


def set_pdl(on: bool) -> None:
    """Launch the decode kernels with programmatic dependent launch (CUDA, Hopper or newer)."""
    if on and (INTERPRET or not PDL_AVAILABLE):
        raise ValueError("programmatic dependent launch needs Triton's griddepcontrol and a GPU "
                         "(not the interpreter)")
    _PDL[0] = bool(on)


def pdl() -> dict:
    """The ``PDL`` constexpr and launch option of a decode kernel's launch."""
    return dict(PDL=True, launch_pdl=True) if _PDL[0] else dict(PDL=False)


@triton.jit
def _pdl_start(PDL: tl.constexpr):
    """Let the next kernel's programs start (they wait for this kernel before touching its data)."""
    if PDL:
        gdc_launch_dependents()


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
def _unpack_w4(p, BN: tl.constexpr, BK: tl.constexpr, IS_BF16: tl.constexpr, KMAJOR: tl.constexpr = False):
    """[BN, BK/8] int32 words -> [BN, BK] floats equal to BASE + code, exactly.

    Each code is OR-ed into the mantissa of a float whose exponent makes one mantissa
    step equal 1 (fp16 0x6400 = 1024, bf16 0x4300 = 128), so no int->float conversion
    is needed. The mask 0x000F000F takes two codes per 32-bit operation (nibbles i and
    i+4); the join tree then puts nibble i at its k-offset: NIBBLE_K[i] for the N-major
    words, KMAJOR_NIBBLE_K[i] (= 2i, and 2i+1 for nibble i+4) for the K-major ones
    (layout.py). ``tl.join`` adds the new axis innermost and the reshape reads the last
    axes in row-major order, so the order of the joins decides the k order.
    """
    if IS_BF16:
        magic = 0x43004300
    else:
        magic = 0x64006400
    t0 = _halves((p & 0x000F000F) | magic, IS_BF16)
    t1 = _halves(((p >> 4) & 0x000F000F) | magic, IS_BF16)
    t2 = _halves(((p >> 8) & 0x000F000F) | magic, IS_BF16)
    t3 = _halves(((p >> 12) & 0x000F000F) | magic, IS_BF16)
    if KMAJOR:
        # tree over [i // 2, i % 2, lo/hi]: position 4 (i // 2) + 2 (i % 2) + h = 2i + h
        l0, h0 = tl.split(t0)
        l1, h1 = tl.split(t1)
        l2, h2 = tl.split(t2)
        l3, h3 = tl.split(t3)
        w = tl.join(tl.join(tl.join(l0, l2), tl.join(l1, l3)), tl.join(tl.join(h0, h2), tl.join(h1, h3)))
    else:
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
def _ec_gate(uT, w1_ptr, b1_ptr, w2_ptr, b2_ptr, bound,
             R: tl.constexpr, H: tl.constexpr, BM: tl.constexpr, GATE: tl.constexpr, DOT_F32: tl.constexpr):
    """v = gamma(u) ⊙ u on a transposed tile uT [R, BM] fp32 (ranks x tokens).

    The two small dots take the gate input in the parameter dtype (tensor cores); the
    nonlinearities and the product with u stay in fp32.
    """
    if GATE:
        offs_r = tl.arange(0, R)
        offs_h = tl.arange(0, H)
        w1 = tl.load(w1_ptr + offs_h[:, None] * R + offs_r[None, :])
        hT = _dot(w1, uT.to(w1.dtype), tl.zeros((H, BM), tl.float32), DOT_F32)
        hT = hT + tl.load(b1_ptr + offs_h).to(tl.float32)[:, None]
        hT = hT * _sigmoid(hT)
        w2 = tl.load(w2_ptr + offs_r[:, None] * H + offs_h[None, :])
        gT = _dot(w2, hT.to(w2.dtype), tl.zeros((R, BM), tl.float32), DOT_F32)
        gT = gT + tl.load(b2_ptr + offs_r).to(tl.float32)[:, None]
        return (1.0 + bound * _tanh(gT)) * uT
    else:
        return uT


# Packed words against their activations, in PTX: Triton cannot view a 32-bit register as two
# fp16 lanes, which is what the conversion needs to cost one LOP3 per two codes.
# Per word (two per call, so the fp32 conversion is paid once per pair): the mask 0x000F000F OR-ed with fp16x2 1024 takes nibbles (0, 4) as 1024 + code, the
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
def _ld_v4(ptr):
    """Four int32 words at each 16-byte-aligned address of ``ptr`` (int32 pointers), one
    vector load each: Triton splits loads of 1-D tensors broadcast across a tile into words."""
    return tl.inline_asm_elementwise("ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", [ptr],
                                     dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)


@triton.jit
def _x_pair(base, lo: tl.constexpr, hi: tl.constexpr, m):
    """fp16 activations at base + lo and base + hi as one int32 (lo in the low half)."""
    a = tl.load(base + lo, mask=m, other=0.0).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    b = tl.load(base + hi, mask=m, other=0.0).to(tl.int16, bitcast=True).to(tl.int32)
    return a | (b << 16)


@triton.jit
def _ptx_token(acc, x_ptr, i, stride_xm, k, offs_w, p, q, zn, zn16, M, HALF: tl.constexpr):
    """acc [BN, BK/16] += (W - zero)/16 · x for token i: word columns w (p) and w + HALF (q) per
    ``_word2_dot``."""
    m = (offs_w * 0 + i) < M
    base = x_ptr + i * stride_xm + k + 8 * offs_w
    shape: tl.constexpr = p.shape
    # nibble pairs (0,4), (1,5), (2,6), (3,7) hold k-offsets (0,4), (2,6), (1,5), (3,7) (NIBBLE_K)
    x0 = tl.broadcast_to(_x_pair(base, 0, 4, m)[None, :], shape)
    x1 = tl.broadcast_to(_x_pair(base, 2, 6, m)[None, :], shape)
    x2 = tl.broadcast_to(_x_pair(base, 1, 5, m)[None, :], shape)
    x3 = tl.broadcast_to(_x_pair(base, 3, 7, m)[None, :], shape)
    base = base + 8 * HALF
    y0 = tl.broadcast_to(_x_pair(base, 0, 4, m)[None, :], shape)
    y1 = tl.broadcast_to(_x_pair(base, 2, 6, m)[None, :], shape)
    y2 = tl.broadcast_to(_x_pair(base, 1, 5, m)[None, :], shape)
    y3 = tl.broadcast_to(_x_pair(base, 3, 7, m)[None, :], shape)
    return acc + _word2_dot(p, q, zn, zn16, x0, x1, x2, x3, y0, y1, y2, y3)


@triton.jit
def _fma_token(acc, x_ptr, i, stride_xm, k, koff, offs_w, wj, xs, M):
    """acc [BN, BK/8] += wj * x[i, k + 8 w + koff] (scaled by xs); tokens i >= M read as 0."""
    xj = tl.load(x_ptr + i * stride_xm + k + 8 * offs_w + koff, mask=(offs_w * 0 + i) < M, other=0.0)
    return acc + wj * (xj.to(tl.float32) * xs)[None, :]


@triton.jit
def _fma_mainloop(x_ptr, qw_ptr, scales_ptr, zeros_ptr, n_ld, k_lo, k_hi, M, N, K, stride_xm,
                  GROUP: tl.constexpr, SYMMETRIC: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  BM: tl.constexpr, MV: tl.constexpr, PTX: tl.constexpr):
    """CUDA-core main loop for M <= MV <= 4 tokens; returns accT [BN, BM] (columns >= MV zero).

    At decode the tensor cores buy nothing, and the MMA operand layout forces the dequantized
    tile through shared memory; here every word stays in the registers it was loaded into
    (one 2-D accumulator per token keeps every tensor in the load's layout).
    A code is turned into an exact fp32 by OR-ing it, unshifted, into the mantissa of 2^23
    (nibble i at bits 4i: value 2^23 + code·16^i, exact while the nibble stays below bit 23,
    so nibbles 5..7 are shifted down once per word). Subtracting 2^23 + zero·16^i leaves
    (code - zero)·16^i exactly, and the matching x is pre-scaled by 16^-i (exact). Per weight:
    one LOP3, one FADD, one FFMA per token; the group scale is applied once per K step.
    PTX (fp16 activations on CUDA): word columns w and w + BK/16 against their activations in
    fp16x2 instead (``_word2_dot``: about 2 instructions per weight instead of ~4.7), in fp32
    per word pair, in units of 1/16 that the scale takes back.
    """
    if PTX:
        UNIT: tl.constexpr = 16.0
        W: tl.constexpr = BK // 16  # the step's word columns in two halves
    else:
        UNIT: tl.constexpr = 1.0
        W: tl.constexpr = BK // 8
    offs_w = tl.arange(0, W)
    w_base = qw_ptr + n_ld[:, None] * (K // 8) + offs_w[None, :]
    if SYMMETRIC:
        z = tl.full((BN,), 8.0, tl.float32)
    else:
        z = tl.load(zeros_ptr + n_ld).to(tl.float32)
    a0 = tl.zeros((BN, W), tl.float32)
    a1 = tl.zeros((BN, W), tl.float32)
    a2 = tl.zeros((BN, W), tl.float32)
    a3 = tl.zeros((BN, W), tl.float32)
    for k in range(k_lo, k_hi, BK):
        p = tl.load(w_base + k // 8)
        if PTX:
            q = tl.load(w_base + k // 8 + W)
        else:
            hi = p >> 20
        if GROUP > 0:
            g = k // GROUP
            if not SYMMETRIC:
                z = tl.load(zeros_ptr + g * N + n_ld).to(tl.float32)
        s0, s1, s2, s3 = _step_sums(a0, a1, a2, a3, GROUP > 0)
        if PTX:
            # fp16 activations on CUDA: (code - zero)/16 · x per word pair in fp16x2 (_word2_dot)
            zn, zn16 = _neg_zero_pairs(z)
            zn = tl.broadcast_to(zn[:, None], (BN, W))
            zn16 = tl.broadcast_to(zn16[:, None], (BN, W))
            s0 = _ptx_token(s0, x_ptr, 0, stride_xm, k, offs_w, p, q, zn, zn16, M, W)
            if MV > 1:
                s1 = _ptx_token(s1, x_ptr, 1, stride_xm, k, offs_w, p, q, zn, zn16, M, W)
            if MV > 2:
                s2 = _ptx_token(s2, x_ptr, 2, stride_xm, k, offs_w, p, q, zn, zn16, M, W)
                s3 = _ptx_token(s3, x_ptr, 3, stride_xm, k, offs_w, p, q, zn, zn16, M, W)
        else:
            for j in tl.static_range(8):
                # nibble j holds k-offset NIBBLE_K[j] = (j & 4) | ((j & 1) << 1) | ((j >> 1) & 1)
                if j < 5:
                    bits = (p & (0xF << (4 * j))) | 0x4B000000
                    wj = bits.to(tl.float32, bitcast=True) - (8388608.0 + z * (1 << (4 * j)))[:, None]
                    xs = 1.0 / (1 << (4 * j))
                else:
                    bits = (hi & (0xF << (4 * (j - 5)))) | 0x4B000000
                    wj = bits.to(tl.float32, bitcast=True) - (8388608.0 + z * (1 << (4 * (j - 5))))[:, None]
                    xs = 1.0 / (1 << (4 * (j - 5)))
                koff = (j & 4) | ((j & 1) << 1) | ((j >> 1) & 1)
                s0 = _fma_token(s0, x_ptr, 0, stride_xm, k, koff, offs_w, wj, xs, M)
                if MV > 1:
                    s1 = _fma_token(s1, x_ptr, 1, stride_xm, k, koff, offs_w, wj, xs, M)
                if MV > 2:
                    s2 = _fma_token(s2, x_ptr, 2, stride_xm, k, koff, offs_w, wj, xs, M)
                    s3 = _fma_token(s3, x_ptr, 3, stride_xm, k, koff, offs_w, wj, xs, M)
        if GROUP > 0:
            s = tl.load(scales_ptr + g * N + n_ld).to(tl.float32)[:, None] * UNIT
            a0, a1, a2, a3 = _add_scaled(a0, a1, a2, a3, s0, s1, s2, s3, s)
        else:
            a0, a1, a2, a3 = s0, s1, s2, s3
    if GROUP == 0:  # the caller applies the per-channel scale; the PTX sums are in units of 1/16
        a0 = a0 * UNIT
        a1 = a1 * UNIT
        a2 = a2 * UNIT
        a3 = a3 * UNIT
    return _tokens_to_accT(a0, a1, a2, a3, BM, MV, 1)


@triton.jit
def _step_sums(a0, a1, a2, a3, GROUPED: tl.constexpr):
    """The sums one K step adds to: fresh zeros when the step has its own group scale (applied
    by _add_scaled after the step), else the running accumulators themselves."""
    if GROUPED:
        s0 = tl.zeros(a0.shape, tl.float32)
        s1 = tl.zeros(a0.shape, tl.float32)
        s2 = tl.zeros(a0.shape, tl.float32)
        s3 = tl.zeros(a0.shape, tl.float32)
    else:
        s0, s1, s2, s3 = a0, a1, a2, a3
    return s0, s1, s2, s3


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
def _add_scaled(a0, a1, a2, a3, s0, s1, s2, s3, s):
    """The four token accumulators plus one group's partial sums times that group's scales."""
    return a0 + s * s0, a1 + s * s1, a2 + s * s2, a3 + s * s3


@triton.jit
def _tokens_to_accT(a0, a1, a2, a3, BM: tl.constexpr, MV: tl.constexpr, AXIS: tl.constexpr):
    """accT [BN, BM]: column t is token t's accumulator summed over its K axis (columns >= MV zero)."""
    cols = tl.arange(0, BM)[None, :]
    accT = tl.where(cols == 0, tl.sum(a0, axis=AXIS)[:, None], 0.0)
    if MV > 1:
        accT += tl.where(cols == 1, tl.sum(a1, axis=AXIS)[:, None], 0.0)
    if MV > 2:
        accT += tl.where(cols == 2, tl.sum(a2, axis=AXIS)[:, None], 0.0)
        accT += tl.where(cols == 3, tl.sum(a3, axis=AXIS)[:, None], 0.0)
    return accT


@triton.jit
def _magic(IS_BF16: tl.constexpr):
    """(two 16-bit floats whose mantissa step is 1, as an int32 OR mask; that float's value)."""
    if IS_BF16:
        return 0x43004300, 128.0
    else:
        return 0x64006400, 1024.0
