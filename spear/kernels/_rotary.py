"""Rotary embedding device functions shared by ``fused.rope_write_kv``'s kernel and the paged
decode attention kernel (``attention.paged_decode_attention(rope=)``): both must round exactly
as the torch expression ``x * cos + rotate_half(x) * sin`` does, so the two paths give the same
cache bit for bit."""

import triton
import triton.language as tl
from triton.language.extra import libdevice

from spear.kernels._common import INTERPRET, _to

# The interpreter runs every operation as written; compiled, LLVM narrows fp32 arithmetic on
# fp16 values to fp16 and contracts a product into the next addition (fma.rn.f16), which skips
# the product's rounding. libdevice's mul_rn is an explicitly rounded multiply that is never
# contracted; the interpreter has no libdevice, and needs none.
_PLAIN_MUL: tl.constexpr = tl.constexpr(INTERPRET)


@triton.jit
def _rotate(base_ptr, offs, mask, c1, c2, s1, s2, HALF: tl.constexpr, dt: tl.constexpr):
    """Both halves of ``x·cos + rotate_half(x)·sin``, rounded where the torch expression rounds."""
    x1 = tl.load(base_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base_ptr + offs + HALF, mask=mask, other=0.0).to(tl.float32)
    # rotate_half(x) = (-x2, x1); rounding to nearest is symmetric, so round(-a) = -round(a)
    lo = _to(_mul(x1, c1), dt).to(tl.float32) - _to(_mul(x2, s1), dt).to(tl.float32)
    hi = _to(_mul(x2, c2), dt).to(tl.float32) + _to(_mul(x1, s2), dt).to(tl.float32)
    return _to(lo, dt), _to(hi, dt)


@triton.jit
def _mul(a, b):
    """fp32 ``a * b`` that is rounded as such in every kernel (see _PLAIN_MUL): the rotary's
    products must round where torch's do, whichever kernel inlines ``_rotate``."""
    if _PLAIN_MUL:
        return a * b
    else:
        return libdevice.mul_rn(a, b)


@triton.jit
def _cos_sin(cos_ptr, sin_ptr, row, offs_d, d_mask, D: tl.constexpr):
    """The rotary table's row ``row`` in fp32, each of cos and sin as its two halves at ``offs_d``."""
    HALF: tl.constexpr = D // 2
    c1 = tl.load(cos_ptr + row * D + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + row * D + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + row * D + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + row * D + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    return c1, c2, s1, s2


@triton.jit
def _rope_q_write_kv(q_rows, g_mask, kn_row, vn_row, cos_ptr, sin_ptr, len_ptr, bt_row, k_base, v_base,
                     stride_kb, stride_kt, stride_vb, stride_vt, owner, GROUP_PAD: tl.constexpr,
                     HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, dt: tl.constexpr):
    """ROPE: the query group rotated at the new token's position (context length - 1), [GROUP_PAD,
    HEAD_DIM] in the cache dtype, rounded as ``fused.rope_write_kv`` rounds it. The ``owner`` program (the split holding that
    position) also writes the new token's rotated k and its v into the cache slot the block table
    gives, then waits at a barrier so that its own loop reads them back; no other program reads
    that position."""
    HALF: tl.constexpr = HEAD_DIM // 2
    offs_h = tl.arange(0, HALF)
    row = tl.maximum(tl.load(len_ptr).to(tl.int64) - 1, 0)
    c1, c2, s1, s2 = _cos_sin(cos_ptr, sin_ptr, row, offs_h, offs_h < HALF, HEAD_DIM)
    lo, hi = _rotate(q_rows, offs_h[None, :], g_mask[:, None], c1[None, :], c2[None, :], s1[None, :], s2[None, :],
                     HALF, dt)
    # [GROUP_PAD, HALF] x 2 -> [GROUP_PAD, HEAD_DIM]: the low half, then the high half
    q = tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (GROUP_PAD, HEAD_DIM))
    if owner:
        blk = tl.load(bt_row + row // BLOCK_SIZE).to(tl.int64)
        tok = row % BLOCK_SIZE
        k_lo, k_hi = _rotate(kn_row, offs_h, offs_h < HALF, c1, c2, s1, s2, HALF, dt)
        k_dst = k_base + blk * stride_kb + tok * stride_kt
        tl.store(k_dst + offs_h, k_lo)
        tl.store(k_dst + HALF + offs_h, k_hi)
        offs_d = tl.arange(0, HEAD_DIM)
        tl.store(v_base + blk * stride_vb + tok * stride_vt + offs_d, tl.load(vn_row + offs_d))
        # the cache writes of every thread before any thread's loads of the key tiles
        tl.debug_barrier()
    return q
