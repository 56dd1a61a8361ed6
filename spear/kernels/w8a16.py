"""W8A16 GEMM for an output head (lm_head) quantized to 8 bits, per-channel symmetric.

    out (M, N) = (x (M, K) · qweightᵀ) * scale (+ bias)

qweight is int8 (N, K), q in [-128, 127], row-major (K contiguous); scale is fp32 (N,), one
per output feature; x is fp16 or bf16 with unit stride along K. The head of a 7B/8B model is
the largest single weight of its decode step (Llama-3-8B: 128256 x 4096, 1.05 GB in fp16,
525 MB in int8), and at decode it is read once per token, so the kernel is a weight stream:
the aim is the copy rate of HBM, with arithmetic kept off the critical path.

Algorithm. A 2-D grid: BN output features x BM tokens per program; each program walks all of
K (the heads' N of 32000 - 152064 gives 500 - 2376 programs of 64 features at decode,
enough to fill 132 SMs without split-K). Tiles are transposed as in w4a16.py (features along dim 0, tokens
along dim 1), and the weight tile [BN, BK] is loaded K-contiguous, 16 int8 per thread (one
16-byte load). The inner loop only converts int8 to floats and multiply-accumulates: the
per-row scale multiplies the fp32 sums once, in the epilogue, with the bias.
  * CUDA cores (``dot`` False; one token by default): q converted to fp32, one FMA per
    weight and token. One token (BM = 1) accumulates the whole [BN, BK] tile and reduces over
    K once after the loop; several tokens reduce each step's products over K per token (their
    [BN, BK] accumulators would not fit in registers), tokens past M skipped. Each thread
    reads the activations of its own 16 k's (two 16-byte loads; the other rows' threads hit
    L1). With BK >= 32 * num_warps Triton loads a row in a coalesced layout of its own and moves
    it into the tile's layout through shared memory, with a barrier, at every step and token (a
    shorter row it loads directly in the tile's layout); on the H200 the longer steps still won
    (``LAUNCH``).
  * tensor cores (``dot`` True; M >= 2 by default): q converted to the activation dtype
    (exact: |q| <= 128), accT [BN, BM] += W [BN, BK] · xT [BK, BM] in fp32. Under
    TRITON_INTERPRET=1 both dot operands are fp32 (the interpreter's bf16 dot is wrong; _common.py).
K must be a multiple of 16, so that every row of qweight starts 16-byte aligned (Triton
specializes K on that and vectorizes the loads); a K that BK does not divide takes masked
loads (EVEN_K False).

Launch shapes come from ``LAUNCH`` by token count. Programmatic dependent launch
(``_common.pdl``): the program waits for the kernel before it at its start, before any load,
so the overlap is only the launch itself (the head's weights are not prefetched).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Optional

import torch
import triton
import triton.language as tl
from torch.library import custom_op

from spear.kernels import _common
from spear.kernels import reference
from spear.kernels._common import INTERPRET, _pdl_wait

# Launch shapes by token count: the entry of the smallest key >= M (the largest key's above it).
# BM tokens per program (CUDA-core entries skip tokens >= M), BN output features, BK inputs per
# step; ``dot``: tensor cores. M = 1: the fastest launch of ``benchmarks/bench_w8.py --sweep`` on
# the H200 heads, BK = 256 although its activation rows need a layout change (module docstring).
# M = 2-16 take the tensor-core tile: memory-bound, it costs the same at any M <= 16 and beats
# every CUDA-core launch from 2 tokens on (BENCHMARKS.md, "Tried, measured, dropped"). M > 16: not
# swept; they stream the weight through cp.async stages into wgmma, the int8 -> fp16 operand in
# registers.
LAUNCH = MappingProxyType({
    1: MappingProxyType(dict(BM=1, BN=16, BK=256, num_warps=4, num_stages=2, dot=False)),
    16: MappingProxyType(dict(BM=16, BN=64, BK=128, num_warps=4, num_stages=3, dot=True)),
    32: MappingProxyType(dict(BM=32, BN=64, BK=128, num_warps=4, num_stages=3, dot=True)),
    64: MappingProxyType(dict(BM=64, BN=128, BK=64, num_warps=8, num_stages=3, dot=True)),
})
K_STEP = 16  # in_features must be a multiple of this (16-byte aligned int8 rows)
_KEYS = ("BM", "BN", "BK", "num_warps", "num_stages", "dot")


@triton.jit
def _load_k(ptrs, k_ok, EVEN_K: tl.constexpr):
    """A load along K: unmasked when BK divides K (``k_ok`` is then all true), else zeros past K."""
    if EVEN_K:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=k_ok, other=0)


@triton.jit(do_not_specialize=["M"])
def _w8a16_kernel(
    # tensors: x (M, K) fp16/bf16, qweight int8 (N, K), scale fp32 (N,), bias (N,), out (M, N)
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr,
    # sizes and strides (x and out have unit stride along features)
    M, N, K, stride_xm, stride_om,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    # tiling; DOT: tensor cores, DOT_F32: their operands in fp32 (the interpreter)
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr, DOT_F32: tl.constexpr,
    # programmatic dependent launch (_common.set_pdl)
    PDL: tl.constexpr = 0,
):
    _pdl_wait(PDL)
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    n_mask = offs_n < N
    # rows past N re-read an in-bounds row (never stored), so the weight loads need no row mask
    n_ld = offs_n % N
    m0 = tl.program_id(1) * BM
    offs_m = m0 + tl.arange(0, BM)
    m_mask = offs_m < M
    offs_k = tl.arange(0, BK)
    # int64 row offsets: N * K passes 2^31 for the largest heads (256k vocabularies at K = 8192),
    # M * N for prefills of some 17k tokens through a 128k vocabulary
    w_ptrs = w_ptr + n_ld.to(tl.int64)[:, None] * K + offs_k[None, :]
    accT = tl.zeros((BN, BM), tl.float32)
    if DOT:
        xT_ptrs = x_ptr + offs_m.to(tl.int64)[None, :] * stride_xm + offs_k[:, None]
        for k in range(0, K, BK):
            w = _load_k(w_ptrs + k, (offs_k + k < K)[None, :], EVEN_K)
            if EVEN_K:
                xt = tl.load(xT_ptrs + k, mask=m_mask[None, :], other=0.0)
            else:
                xt = tl.load(xT_ptrs + k, mask=m_mask[None, :] & (offs_k + k < K)[:, None], other=0.0)
            if DOT_F32:
                accT = tl.dot(w.to(tl.float32), xt.to(tl.float32), accT)
            else:
                accT = tl.dot(w.to(x_ptr.dtype.element_ty), xt, accT)
    elif BM == 1:
        # one token: the products stay in the tile's layout and are reduced over K once
        acc = tl.zeros((BN, BK), tl.float32)
        for k in range(0, K, BK):
            w = _load_k(w_ptrs + k, (offs_k + k < K)[None, :], EVEN_K)
            xv = _load_k(x_ptr + m0.to(tl.int64) * stride_xm + k + offs_k, offs_k + k < K, EVEN_K)
            acc += w.to(tl.float32) * xv.to(tl.float32)[None, :]
        accT += tl.sum(acc, axis=1)[:, None]
    else:
        cols = tl.arange(0, BM)[None, :]
        for k in range(0, K, BK):
            wf = _load_k(w_ptrs + k, (offs_k + k < K)[None, :], EVEN_K).to(tl.float32)  # once for all tokens
            for t in tl.static_range(BM):
                if m0 + t < M:
                    # the activation row in the tile's K layout: each thread reads its own k's
                    xv = _load_k(x_ptr + (m0 + t).to(tl.int64) * stride_xm + k + offs_k, offs_k + k < K, EVEN_K)
                    accT += tl.where(cols == t, tl.sum(wf * xv.to(tl.float32)[None, :], axis=1)[:, None], 0.0)
    accT = accT * tl.load(scale_ptr + n_ld)[:, None]
    if HAS_BIAS:
        accT += tl.load(bias_ptr + n_ld).to(tl.float32)[:, None]
    tl.store(out_ptr + offs_m.to(tl.int64)[None, :] * stride_om + offs_n[:, None], accT.to(out_ptr.dtype.element_ty),
             mask=n_mask[:, None] & m_mask[None, :])


def pack_w8(codes: torch.Tensor, scales: torch.Tensor,
            zeros: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(qweight int8 (N, K), scale fp32 (N,)) from a QuantLinear's 8-bit per-channel symmetric buffers:
    ``codes`` uint8 (N, K) holding q + 128, ``scales`` (N, 1). ``zeros``, if given, must be 128
    everywhere (symmetric); the layout has no zero points."""
    if codes.dtype != torch.uint8 or codes.dim() != 2:
        raise ValueError(f"codes must be uint8 (out_features, in_features); got {codes.dtype} {tuple(codes.shape)}")
    n, k = codes.shape
    if not scales.is_floating_point() or tuple(scales.shape) not in ((n, 1), (n,)):
        raise ValueError(f"scales must be float per-channel (group_size=0) scales of shape ({n}, 1); got "
                         f"{scales.dtype} {tuple(scales.shape)}")
    if zeros is not None and (zeros.numel() != n or bool((zeros.reshape(-1).to(torch.int16) != 128).any())):
        seen = f" with values in [{int(zeros.min())}, {int(zeros.max())}]" if zeros.numel() else ""
        raise ValueError(f"W8 takes symmetric 8-bit per-channel layers (zero point 128 everywhere, ({n}, 1)); got "
                         f"zeros of shape {tuple(zeros.shape)}{seen}")
    if scales.device != codes.device:
        raise ValueError(f"scales are on {scales.device}, codes on {codes.device}")
    qweight = (codes.to(torch.int16) - 128).to(torch.int8).contiguous()
    return qweight, scales.reshape(n).to(torch.float32).contiguous()


def _check(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
    if qweight.dtype != torch.int8 or qweight.dim() != 2 or not qweight.is_contiguous():
        raise ValueError(f"qweight must be contiguous int8 (out_features, in_features) (pack_w8); got "
                         f"{qweight.dtype} {tuple(qweight.shape)}, strides {qweight.stride()}")
    n, k = qweight.shape
    if k == 0 or k % K_STEP:
        raise ValueError(f"in_features must be a positive multiple of {K_STEP} (16-byte aligned int8 rows); got {k}")
    if scale.dtype != torch.float32 or tuple(scale.shape) != (n,) or not scale.is_contiguous():
        raise ValueError(f"scale must be contiguous fp32 ({n},) (pack_w8); got {scale.dtype} {tuple(scale.shape)}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (tokens, in_features); got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"x must be float16 or bfloat16; got {x.dtype}")
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} features, the weight expects in_features={k}")
    if x.stride(1) != 1:
        raise ValueError(f"x must have unit stride along features; got strides {x.stride()}")
    if bias is not None and (tuple(bias.shape) != (n,) or not bias.is_floating_point() or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous float ({n},) = (out_features,); got {bias.dtype} "
                         f"{tuple(bias.shape)}")
    for name, t in (("qweight", qweight), ("scale", scale), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")


def pick_config(m: int) -> dict:
    """The ``LAUNCH`` entry for M tokens."""
    for key in sorted(LAUNCH):
        if m <= key:
            return dict(LAUNCH[key])
    return dict(LAUNCH[max(LAUNCH)])


def w8a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                 config: dict | None = None, *, pdl: int = 0) -> torch.Tensor:
    """``(x qweightᵀ) * scale (+ bias)`` for 2-D ``x`` in x's dtype, accumulated in fp32.

    ``config`` overrides keys of the ``LAUNCH`` entry for M (BM, BN, BK, num_warps, num_stages,
    dot);
    ``pdl`` 1: launched with programmatic dependent launch.
    """
    _check(x, qweight, scale, bias)
    m, k = x.shape
    n = qweight.shape[0]
    unknown = set(config or {}) - set(_KEYS)
    if unknown:
        raise ValueError(f"unknown launch key(s) {sorted(unknown)}; expected some of {', '.join(_KEYS)}")
    cfg = {**pick_config(m), **(config or {})}
    bm, bn, dot = cfg["BM"], cfg["BN"], bool(cfg["dot"])
    bk = min(cfg["BK"], triton.next_power_of_2(k))  # no tile wider than K
    if any(v < 1 or v & (v - 1) for v in (bm, bn, bk)) or bk < K_STEP or (dot and min(bm, bn) < 16) or (
            not dot and bm > 16):
        raise ValueError(f"BM, BN, BK must be powers of 2 with BK >= {K_STEP}; tensor-core tiles need BM, BN >= 16, "
                         f"CUDA-core ones BM <= 16; got BM={bm}, BN={bn}, BK={bk}, dot={dot}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm))
    _w8a16_kernel[grid](
        x, qweight, scale, bias if bias is not None else scale, out,
        m, n, k, x.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=k % bk == 0,
        BM=bm, BN=bn, BK=bk, DOT=dot, DOT_F32=INTERPRET,
        **_common.pdl_args(pdl),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out


@custom_op("spear::w8a16", mutates_args=())
def w8a16(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor],
          pdl: int = 0) -> torch.Tensor:
    """x (..., K) -> (..., N): the Triton kernel on CUDA, the fp32 reference (cast to x's dtype) elsewhere."""
    n, k = qweight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight expects in_features={k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    _check(x2, qweight, scale, bias)
    if x2.shape[0] == 0:
        return x.new_empty((*lead, n))
    if x.device.type != "cuda":
        y = reference.w8a16(x2, qweight, scale, bias).to(x.dtype)
    else:
        y = w8a16_matmul(x2, qweight, scale, bias, pdl=pdl)
    return y.reshape(*lead, n)


@w8a16.register_fake
def _w8a16_fake(x, qweight, scale, bias, pdl=0):
    """The output's shape and dtype only: the launch is picked at run time on the concrete token
    count, so the op traces with a symbolic one (ops.py, spear::w4a16_ec)."""
    n, k = qweight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight expects in_features={k}")
    return x.new_empty((*x.shape[:-1], n))


def w8a16_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None = None, pdl: int = 0) -> torch.Tensor:
    """``x (qweight * scale)ᵀ (+ bias)`` through ``spear::w8a16``; qweight, scale from :func:`pack_w8`."""
    return torch.ops.spear.w8a16(x, qweight, scale, bias, pdl)
