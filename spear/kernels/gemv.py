"""W4A16 GEMV for decode (M <= 4 tokens) over a K-major packed layout, candidate for the decode path.

    out (M, N) = x (M, K) · W_hatᵀ

Layout (``pack_kmajor``): qweight_t (K/8, N) int32, word (j, n) holds the codes of column n at
k = 8j .. 8j+7; nibble i holds k-offset KMAJOR_NIBBLE_K[i], so that the mask 0x000F000F on
the word shifted by 4i takes the codes of k-offsets (2i, 2i+1): a pair of neighbouring
activations, which fp16x2 instructions consume as one 32-bit register. Output features are contiguous, so a program's tile
[BK/8, BN] is BK/8 rows of BN consecutive words: every thread loads 16 contiguous bytes of
one K row, and the 8 activations a word needs are the same for all its 4 neighbours along N
(the N-major layout of :mod:`layout` pairs each word with its own 8 activations instead).
Scales and zeros (G, N) as in :mod:`layout`.

Main loop per weight: one LOP3 (the nibble, unshifted, OR-ed into the mantissa of 2^23, the
exact-float trick of ``_fma_mainloop``), one FADD (minus 2^23 + zero·16^i), one FFMA per
token against x pre-scaled by 16^-i; the group scale multiplies a whole group's partial sum.
The accumulator stays 2-D [BK/8, BN] in the load's register layout and is reduced over K
once per program.

Split-K as in :mod:`w4a16`: fp32 partials, a per-column-tile counter in ``locks``; the
program that arrives last sums the partials, writes the output and re-arms the counter, so
one launch does everything and the counters stay zero between calls and graph replays.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from spear.kernels import _common
from spear.kernels._common import _halves, _word_dot
from spear.kernels.layout import LOCK_SLOTS, PackedW4, check_codes


# nibble i of a K-major word holds k-offset KMAJOR_NIBBLE_K[i]
KMAJOR_NIBBLE_K = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass
class PackedW4K:
    qweight_t: torch.Tensor  # (K/8, N) int32
    scales: torch.Tensor     # (G, N) fp16
    zeros: torch.Tensor      # (G, N) uint8
    locks: torch.Tensor      # (LOCK_SLOTS,) int32 zeros
    group_size: int
    symmetric: bool

    @property
    def out_features(self) -> int:
        return self.qweight_t.shape[1]

    @property
    def in_features(self) -> int:
        return self.qweight_t.shape[0] * 8


def pack_kmajor(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                symmetric: bool = False) -> PackedW4K:
    """(codes (N, K) uint8, scales (N, G), zeros (N, G)) -> the K-major layout (module docstring)."""
    n, k = check_codes(codes, scales, zeros, group_size, symmetric)
    c = codes.t().reshape(k // 8, 8, n).to(torch.int64)
    word = torch.zeros(k // 8, n, dtype=torch.int64, device=codes.device)
    for nib, koff in enumerate(KMAJOR_NIBBLE_K):
        word |= c[:, koff, :] << (4 * nib)
    word = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)
    return PackedW4K(qweight_t=word.contiguous(), scales=scales.to(torch.float16).t().contiguous(),
                     zeros=zeros.to(torch.uint8).t().contiguous(),
                     locks=torch.zeros(LOCK_SLOTS, dtype=torch.int32, device=codes.device),
                     group_size=group_size, symmetric=symmetric)


def from_packed(w: PackedW4) -> PackedW4K:
    """The K-major copy of a :class:`PackedW4` (same codes, scales and zeros)."""
    from spear.kernels.layout import unpack

    codes, scales, zeros = unpack(w)
    return pack_kmajor(codes, scales, zeros, w.group_size, w.symmetric)


@dataclass(frozen=True)
class GemvConfig:
    BN: int = 128
    BK: int = 128
    split_k: int = 8
    num_warps: int = 4
    num_stages: int = 2
    half: bool = True  # fp16 activations: packed fp16 products (else the exact fp32 loop)
    asm: bool = True   # the fp16 word product in PTX (CUDA only; the interpreter runs the Triton form)


@triton.jit
def _token(acc, x_ptr, t, stride_xm, k, koff: tl.constexpr, offs_j, w, xs, M):
    xi = tl.load(x_ptr + t * stride_xm + k + 8 * offs_j + koff, mask=(offs_j * 0 + t) < M, other=0.0)
    return acc + w * (xi.to(tl.float32) * xs)[:, None]


@triton.jit
def _token_half(acc, x_ptr, t, stride_xm, k, offs_j, d0, d1, d2, d3, M):
    """acc [BK/8, BN] += sum over the word's 8 codes of d * x, products and their sum in fp16."""
    m = (offs_j * 0 + t) < M
    xb = x_ptr + t * stride_xm + k + 8 * offs_j
    x0 = tl.join(tl.load(xb, mask=m, other=0.0), tl.load(xb + 1, mask=m, other=0.0))[:, None, :]
    x1 = tl.join(tl.load(xb + 2, mask=m, other=0.0), tl.load(xb + 3, mask=m, other=0.0))[:, None, :]
    x2 = tl.join(tl.load(xb + 4, mask=m, other=0.0), tl.load(xb + 5, mask=m, other=0.0))[:, None, :]
    x3 = tl.join(tl.load(xb + 6, mask=m, other=0.0), tl.load(xb + 7, mask=m, other=0.0))[:, None, :]
    prod = d0 * x0 + d1 * x1 + d2 * x2 + d3 * x3
    return acc + tl.sum(prod.to(tl.float32), axis=2)


@triton.jit
def _token_asm(acc, x_ptr, t, stride_xm, k, offs_j, p, zneg, M):
    m = (offs_j * 0 + t) < M
    xb = x_ptr.to(tl.pointer_type(tl.int32)) + (t * stride_xm + k) // 2 + 4 * offs_j
    shape: tl.constexpr = p.shape
    x0 = tl.broadcast_to(tl.load(xb, mask=m, other=0)[:, None], shape)
    x1 = tl.broadcast_to(tl.load(xb + 1, mask=m, other=0)[:, None], shape)
    x2 = tl.broadcast_to(tl.load(xb + 2, mask=m, other=0)[:, None], shape)
    x3 = tl.broadcast_to(tl.load(xb + 3, mask=m, other=0)[:, None], shape)
    return acc + _word_dot(p, zneg, x0, x1, x2, x3)


@triton.jit(do_not_specialize=["M", "split_k"])
def _gemv_kernel(x_ptr, qt_ptr, scales_ptr, zeros_ptr, out_ptr, part_ptr, locks_ptr,
                 M, N, K, stride_xm, stride_om, split_k,
                 GROUP: tl.constexpr, SYMMETRIC: tl.constexpr, MV: tl.constexpr, HALF: tl.constexpr,
                 ASM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    if HALF:
        UNIT: tl.constexpr = 16.0  # the fp16 path accumulates (code - zero) / 16
    else:
        UNIT: tl.constexpr = 1.0
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    iters = tl.cdiv(K // BK, split_k)
    k_lo = pid_k * iters * BK
    k_hi = tl.minimum(k_lo + iters * BK, K)
    # Output features are the contiguous dimension: the hints (and no modulo on the offsets)
    # let the compiler give each thread runs of neighbouring words, loaded 16 bytes at a time,
    # that share their activations. Columns past N are masked (only a layer's last tile).
    offs_n = tl.max_contiguous(tl.multiple_of(pid_n * BN + tl.arange(0, BN), BN), BN)
    n_mask = offs_n < N
    offs_j = tl.arange(0, BK // 8)
    w_base = qt_ptr + offs_j[:, None] * N + offs_n[None, :]
    w_mask = (offs_j[:, None] >= 0) & n_mask[None, :]
    if SYMMETRIC:
        z = tl.full((BN,), 8.0, tl.float32)
    else:
        z = tl.load(zeros_ptr + offs_n, mask=n_mask, other=0).to(tl.float32)
    a0 = tl.zeros((BK // 8, BN), tl.float32)
    a1 = tl.zeros((BK // 8, BN), tl.float32)
    a2 = tl.zeros((BK // 8, BN), tl.float32)
    a3 = tl.zeros((BK // 8, BN), tl.float32)
    for k in range(k_lo, k_hi, BK):
        p = tl.load(w_base + (k // 8) * N, mask=w_mask, other=0)
        if not HALF:
            hi = p >> 20
        if GROUP > 0:
            g = k // GROUP
            if not SYMMETRIC:
                z = tl.load(zeros_ptr + g * N + offs_n, mask=n_mask, other=0).to(tl.float32)
            s0 = tl.zeros((BK // 8, BN), tl.float32)
            s1 = tl.zeros((BK // 8, BN), tl.float32)
            s2 = tl.zeros((BK // 8, BN), tl.float32)
            s3 = tl.zeros((BK // 8, BN), tl.float32)
        else:
            s0 = a0
            s1 = a1
            s2 = a2
            s3 = a3
        if ASM:
            zq = (-(1024.0 + z) * 0.0625).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
            zneg = tl.broadcast_to((zq | (zq << 16))[None, :], (BK // 8, BN))
            s0 = _token_asm(s0, x_ptr, 0, stride_xm, k, offs_j, p, zneg, M)
            if MV > 1:
                s1 = _token_asm(s1, x_ptr, 1, stride_xm, k, offs_j, p, zneg, M)
            if MV > 2:
                s2 = _token_asm(s2, x_ptr, 2, stride_xm, k, offs_j, p, zneg, M)
                s3 = _token_asm(s3, x_ptr, 3, stride_xm, k, offs_j, p, zneg, M)
        elif HALF:
            # fp16 pairs (1024 + code of nibble i, of nibble i + 4) by one mask-and-or each;
            # one fused multiply-add per pair makes them exactly (code - zero) / 16 (the 1/16
            # keeps the fp16 products below the activations' own magnitude).
            zq = ((1024.0 + z) * 0.0625).to(tl.float16)[None, :, None]
            d0 = _halves((p & 0x000F000F) | 0x64006400, False) * 0.0625 - zq
            d1 = _halves(((p >> 4) & 0x000F000F) | 0x64006400, False) * 0.0625 - zq
            d2 = _halves(((p >> 8) & 0x000F000F) | 0x64006400, False) * 0.0625 - zq
            d3 = _halves(((p >> 12) & 0x000F000F) | 0x64006400, False) * 0.0625 - zq
            s0 = _token_half(s0, x_ptr, 0, stride_xm, k, offs_j, d0, d1, d2, d3, M)
            if MV > 1:
                s1 = _token_half(s1, x_ptr, 1, stride_xm, k, offs_j, d0, d1, d2, d3, M)
            if MV > 2:
                s2 = _token_half(s2, x_ptr, 2, stride_xm, k, offs_j, d0, d1, d2, d3, M)
                s3 = _token_half(s3, x_ptr, 3, stride_xm, k, offs_j, d0, d1, d2, d3, M)
        else:
            for i in tl.static_range(8):
                if i < 5:
                    bits = (p & (0xF << (4 * i))) | 0x4B000000
                    w = bits.to(tl.float32, bitcast=True) - (8388608.0 + z * (1 << (4 * i)))[None, :]
                    xs = 1.0 / (1 << (4 * i))
                else:
                    bits = (hi & (0xF << (4 * (i - 5)))) | 0x4B000000
                    w = bits.to(tl.float32, bitcast=True) - (8388608.0 + z * (1 << (4 * (i - 5))))[None, :]
                    xs = 1.0 / (1 << (4 * (i - 5)))
                # k-offset of nibble i: KMAJOR_NIBBLE_K[i] = 2 (i % 4) + i // 4
                s0 = _token(s0, x_ptr, 0, stride_xm, k, 2 * (i % 4) + i // 4, offs_j, w, xs, M)
                if MV > 1:
                    s1 = _token(s1, x_ptr, 1, stride_xm, k, 2 * (i % 4) + i // 4, offs_j, w, xs, M)
                if MV > 2:
                    s2 = _token(s2, x_ptr, 2, stride_xm, k, 2 * (i % 4) + i // 4, offs_j, w, xs, M)
                    s3 = _token(s3, x_ptr, 3, stride_xm, k, 2 * (i % 4) + i // 4, offs_j, w, xs, M)
        if GROUP > 0:
            s = tl.load(scales_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :] * UNIT
            a0 += s * s0
            a1 += s * s1
            a2 += s * s2
            a3 += s * s3
        else:
            a0 = s0
            a1 = s1
            a2 = s2
            a3 = s3
    # columns of the [MV_PAD, BN] result: one row per token
    rows = tl.arange(0, 4)[:, None]
    acc = tl.where(rows == 0, tl.sum(a0, axis=0)[None, :], 0.0)
    if MV > 1:
        acc += tl.where(rows == 1, tl.sum(a1, axis=0)[None, :], 0.0)
    if MV > 2:
        acc += tl.where(rows == 2, tl.sum(a2, axis=0)[None, :], 0.0)
        acc += tl.where(rows == 3, tl.sum(a3, axis=0)[None, :], 0.0)
    if GROUP == 0:
        acc = acc * (tl.load(scales_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32) * UNIT)[None, :]
    offs_t = tl.arange(0, 4)
    mask = (offs_t < M)[:, None] & n_mask[None, :]
    mn = offs_t[:, None] * N + offs_n[None, :]
    if split_k > 1:
        tl.store(part_ptr + pid_k * M * N + mn, acc, mask=mask)
        tl.debug_barrier()
        arrived = tl.atomic_add(locks_ptr + pid_n, 1, sem="acq_rel")
        if arrived == split_k - 1:
            acc = tl.zeros((4, BN), tl.float32)
            for s_i in range(split_k):
                acc += tl.load(part_ptr + s_i * M * N + mn, mask=mask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(locks_ptr + pid_n, 0)
            tl.store(out_ptr + offs_t[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
                     mask=mask)
    else:
        tl.store(out_ptr + offs_t[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=mask)


def pick_gemv_config(m: int, n: int, k: int, group_size: int, programs: int = 1024, BN: int = 128,
                     BK: int = 128, num_warps: int = 4, num_stages: int = 2, half: bool = True, asm: bool = True) -> GemvConfig:
    """Split-K to reach about ``programs`` programs, keeping >= 2 K steps each."""
    bk = min(BK, group_size) if group_size else BK
    tiles = triton.cdiv(n, BN)
    split = 1
    while tiles * split < programs and k // (bk * split * 2) >= 2:
        split *= 2
    return GemvConfig(BN, bk, split, num_warps, num_stages, half, asm)


def w4_gemv(x: torch.Tensor, w: PackedW4K, config: GemvConfig | None = None, launch=None) -> torch.Tensor:
    """``x W_hatᵀ`` for 2-D ``x`` with at most 4 rows (decode)."""
    if x.dim() != 2 or x.dtype not in (torch.float16, torch.bfloat16) or x.stride(1) != 1:
        raise ValueError(f"x must be 2-D fp16/bf16 with unit feature stride; got {x.dtype} {tuple(x.shape)}")
    m, k = x.shape
    n = w.out_features
    if k != w.in_features:
        raise ValueError(f"x has {k} features, the packed weight expects {w.in_features}")
    if not 1 <= m <= 4:
        raise ValueError(f"w4_gemv takes 1..4 tokens; got {m}")
    cfg = config or pick_gemv_config(m, n, k, w.group_size)
    if k % cfg.BK or (w.group_size and w.group_size % cfg.BK):
        raise ValueError(f"BK={cfg.BK} must divide in_features={k} and the group size {w.group_size}")
    n_tiles = triton.cdiv(n, cfg.BN)
    if cfg.split_k > 1 and n_tiles > w.locks.numel():
        raise ValueError(f"split-K needs {n_tiles} lock slots; the layer has {w.locks.numel()}")
    out = _common.alloc((m, n), dtype=x.dtype, device=x.device)
    part = _common.alloc((cfg.split_k, m, n) if cfg.split_k > 1 else (1,), dtype=torch.float32, device=x.device)
    mv = 1 if m == 1 else (2 if m == 2 else 4)
    half = cfg.half and x.dtype == torch.float16
    if half and x.stride(0) % 2:
        raise ValueError("the fp16 path reads activation pairs as 32-bit words: x's row stride must be even")
    kernel = _gemv_kernel if launch is None else launch(_gemv_kernel)
    kernel[(n_tiles, cfg.split_k)](
        x, w.qweight_t, w.scales, w.zeros, out, part, w.locks, m, n, k, x.stride(0), out.stride(0), cfg.split_k,
        GROUP=w.group_size, SYMMETRIC=w.symmetric, MV=mv, HALF=half, ASM=half and not _common.INTERPRET and cfg.asm,
        BN=cfg.BN, BK=cfg.BK,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
