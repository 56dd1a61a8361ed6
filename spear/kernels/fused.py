"""Fused kernels for the small per-layer ops of the serving engine's Llama layer.

    rms_norm       y = weight * (x * rsqrt(mean(x²) + eps)).to(x.dtype)          1 kernel
    add_rms_norm   s = residual + x;  y = rms_norm(s)  ->  (s, y)                  1 kernel
    rope_write_kv  q' = rope(q);  k_cache[slots] = rope(k);  v_cache[slots] = v    1 kernel
    silu_mul       silu(gate) * up                                                 1 kernel
    silu_mul_pairs silu(gate) * up of interleaved (gate, up) features (prefill)    1 kernel

At decode these ops are tiny and each torch op is its own kernel launch (RMSNorm alone is
about seven elementwise kernels, rotary about ten); here each is one launch.

Numerics follow the torch references of ``reference.py`` (HF's Llama modules): every
value is computed in fp32 from the 16-bit inputs and rounded to the activation dtype exactly
where the torch ops round. Products and sums of two fp16/bf16 values are exact or correctly
rounded in fp32 (fp32 has more than twice their precision plus two bits, so rounding twice
equals rounding once), so those steps reproduce torch bit for bit; only the reduction
order of the mean, rsqrt and exp may differ in the last fp32 bit.

* rms_norm: the sum of squares, the mean and the rsqrt in fp32; x·rstd rounded to x's
  dtype; the product with ``weight`` rounded to the promoted dtype of (weight, x).
* rope: ``x·cos + rotate_half(x)·sin`` with both products and the sum rounded to the
  activation dtype, as the torch expression rounds them.
* silu_mul: silu in fp32 rounded to the activation dtype (what ``F.silu`` returns), the
  product with ``up`` rounded once more, as ``F.silu(gate) * up`` does.

On tensors that are not on a CUDA device the torch reference runs, except under Triton's
interpreter (``TRITON_INTERPRET=1``), where the kernels run on CPU tensors (tests).
Launches depend only on shapes (no host syncs, no data-dependent grids), so a CUDA graph
can capture them. Slots and positions are not range-checked (that would need a sync): out
of range values write or read outside the cache or the rotary table.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spear.kernels import _common
from spear.kernels import reference as _reference
from spear.kernels._common import _pdl_wait, _to
from spear.kernels._rotary import _cos_sin, _rotate

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
# One program holds a whole row of the norm in registers.
MAX_NORM_FEATURES = 65536
# Elements of one half of the head dimension handled per rotary program (heads x half-dims).
ROPE_TILE = 512
SILU_BLOCK = 1024


def _use_kernel(t: torch.Tensor) -> bool:
    return t.is_cuda or _common.INTERPRET


def _norm_warps(block: int) -> int:
    return 1 if block <= 256 else (4 if block <= 2048 else (8 if block <= 8192 else 16))




# ---------------------------------------------------------------------------- RMSNorm


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, sum_ptr, out_ptr, eps,
                     N: tl.constexpr, BLOCK: tl.constexpr, HAS_RES: tl.constexpr, PDL: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # a parameter: before the wait
    _pdl_wait(PDL)
    x = tl.load(x_ptr + row * N + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        x += tl.load(r_ptr + row * N + offs, mask=mask, other=0.0).to(tl.float32)
        s = _to(x, sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * N + offs, s, mask=mask)
        x = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    xn = _to(x * rstd, x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * N + offs, _to(w * xn, out_ptr.dtype.element_ty), mask=mask)


def _check_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> None:
    if not torch.is_tensor(x) or x.dim() < 1 or x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x must be a tensor of fp16, bf16 or fp32 with a feature dimension; got "
                         f"{getattr(x, 'dtype', type(x))} {tuple(getattr(x, 'shape', ()))}")
    if not x.is_contiguous():
        raise ValueError(f"x must be contiguous; got strides {x.stride()} for shape {tuple(x.shape)}")
    n = x.shape[-1]
    if weight.dim() != 1 or weight.shape[0] != n or weight.dtype not in FLOAT_DTYPES:
        raise ValueError(f"weight must be 1-D fp16/bf16/fp32 with {n} entries; got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    if not weight.is_contiguous():
        raise ValueError("weight must be contiguous")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, x on {x.device}")
    if n > MAX_NORM_FEATURES:
        raise ValueError(f"at most {MAX_NORM_FEATURES} features per row; got {n}")
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
            raise ValueError(f"residual must match x ({x.dtype} {tuple(x.shape)} on {x.device}); got "
                             f"{residual.dtype} {tuple(residual.shape)} on {residual.device}")
        if not residual.is_contiguous():
            raise ValueError("residual must be contiguous")


def _launch_norm(x, residual, weight, eps, pdl):
    n = x.shape[-1]
    rows = x.numel() // n if n else 0
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else out
    if rows:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(rows,)](x, residual if residual is not None else x, weight, s, out, float(eps),
                                  N=n, BLOCK=block, HAS_RES=residual is not None, num_warps=_norm_warps(block),
                                  **_common.pdl_args(pdl))
    return s, out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, pdl: int = 0) -> torch.Tensor:
    """RMSNorm over the last dimension of contiguous ``x``; the numerics of ``reference.rms_norm``."""
    _check_norm(x, weight)
    if not _use_kernel(x):
        return _reference.rms_norm(x, weight, eps)
    return _launch_norm(x, None, weight, eps, pdl)[1]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 *, pdl: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = residual + x`` (rounded to x's dtype) and ``rms_norm(s)``, in one pass: (s, norm)."""
    _check_norm(x, weight, residual)
    if not _use_kernel(x):
        s = residual + x
        return s, _reference.rms_norm(s, weight, eps)
    return _launch_norm(x, residual, weight, eps, pdl)


# ---------------------------------------------------------------------------- rotary + KV write


@triton.jit
def _rope_kv_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, qo_ptr, kc_ptr, vc_ptr,
                    stride_q, stride_k, stride_v, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr,
                    HAS_POS: tl.constexpr, PDL: tl.constexpr = False):
    """Program (t, j): token t; j < cdiv(H, BH) rotates BH query heads, the others rotate BH
    key heads into the cache and copy the matching value heads."""
    _pdl_wait(PDL)
    HALF: tl.constexpr = D // 2
    NQB: tl.constexpr = (H + BH - 1) // BH
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    dt = qo_ptr.dtype.element_ty
    if HAS_POS:
        row = tl.load(pos_ptr + t).to(tl.int64)
    else:
        row = t
    offs_d = tl.arange(0, BD)
    d_mask = offs_d < HALF
    c1, c2, s1, s2 = _cos_sin(cos_ptr, sin_ptr, row, offs_d, d_mask, D)
    c1, c2, s1, s2 = c1[None, :], c2[None, :], s1[None, :], s2[None, :]
    if j < NQB:
        heads = j * BH + tl.arange(0, BH)
        mask = (heads < H)[:, None] & d_mask[None, :]
        offs = heads[:, None] * D + offs_d[None, :]
        lo, hi = _rotate(q_ptr + t * stride_q, offs, mask, c1, c2, s1, s2, HALF, dt)
        tl.store(qo_ptr + t * (H * D) + offs, lo, mask=mask)
        tl.store(qo_ptr + t * (H * D) + offs + HALF, hi, mask=mask)
    else:
        heads = (j - NQB) * BH + tl.arange(0, BH)
        mask = (heads < HKV)[:, None] & d_mask[None, :]
        offs = heads[:, None] * D + offs_d[None, :]
        slot = tl.load(slot_ptr + t).to(tl.int64)
        dst = slot * (HKV * D)
        lo, hi = _rotate(k_ptr + t * stride_k, offs, mask, c1, c2, s1, s2, HALF, dt)
        tl.store(kc_ptr + dst + offs, lo, mask=mask)
        tl.store(kc_ptr + dst + offs + HALF, hi, mask=mask)
        v1 = tl.load(v_ptr + t * stride_v + offs, mask=mask, other=0.0)
        v2 = tl.load(v_ptr + t * stride_v + offs + HALF, mask=mask, other=0.0)
        tl.store(vc_ptr + dst + offs, v1, mask=mask)
        tl.store(vc_ptr + dst + offs + HALF, v2, mask=mask)


def _check_rope(q, k, v, cos, sin, k_cache, v_cache, slots, positions) -> None:
    for name, x, dims in (("q", q, 3), ("k", k, 3), ("v", v, 3), ("cos", cos, 2), ("sin", sin, 2),
                          ("k_cache", k_cache, 4), ("v_cache", v_cache, 4)):
        if not torch.is_tensor(x) or x.dim() != dims:
            raise ValueError(f"{name} must be a {dims}-D tensor; got shape {tuple(getattr(x, 'shape', ()))}")
        if x.dtype != q.dtype:
            raise ValueError(f"{name} must have q's dtype {q.dtype}; got {x.dtype}")
        # q, k, v may be column slices of one fused projection: rows strided, each row's heads dense
        dense = x.stride()[1:] == (x.shape[2], 1) if name in ("q", "k", "v") else x.is_contiguous()
        if not dense:
            raise ValueError(f"{name} must be contiguous{' within each token' if name in 'qkv' else ''}; got "
                             f"strides {x.stride()} for shape {tuple(x.shape)}")
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device}, q on {q.device}")
    if q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"q, k, v must be fp16, bf16 or fp32; got {q.dtype}")
    t, _, d = q.shape
    hkv = k.shape[1]
    if k.shape != (t, hkv, d) or v.shape != k.shape:
        raise ValueError(f"q (T, H, D) = {tuple(q.shape)} needs k and v of shape (T, n_kv_heads, D); got k "
                         f"{tuple(k.shape)}, v {tuple(v.shape)}")
    if d % 2:
        raise ValueError(f"head_dim must be even for rotate-half; got {d}")
    if cos.shape != sin.shape or cos.shape[1] != d:
        raise ValueError(f"cos and sin must be (rows, {d}); got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if positions is None and cos.shape[0] != t:
        raise ValueError(f"without positions, cos and sin hold one row per token ({t}); got {cos.shape[0]} rows")
    if k_cache.shape != v_cache.shape or k_cache.shape[2:] != (hkv, d):
        raise ValueError(f"caches must both be (num_blocks, block_size, {hkv}, {d}); got {tuple(k_cache.shape)} "
                         f"and {tuple(v_cache.shape)}")
    for name, idx in (("slots", slots), ("positions", positions)):
        if idx is None:
            continue
        if not torch.is_tensor(idx) or idx.dim() != 1 or idx.shape[0] != t or idx.dtype not in INDEX_DTYPES:
            raise ValueError(f"{name} must be 1-D int32/int64 with one entry per token ({t}); got "
                             f"{getattr(idx, 'dtype', type(idx))} {tuple(getattr(idx, 'shape', ()))}")
        if idx.device != q.device:
            raise ValueError(f"{name} is on {idx.device}, q on {q.device}")
        if not idx.is_contiguous():
            raise ValueError(f"{name} must be contiguous")


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                  positions: torch.Tensor | None = None, *, pdl: int = 0) -> torch.Tensor:
    """Rotary on q and k, and the KV cache write, in one launch; returns the rotated q (new tensor).

    q (T, n_heads, head_dim), k and v (T, n_kv_heads, head_dim), each token's heads contiguous
    (rows may be strided: q, k, v can be column slices of one fused projection); caches (num_blocks, block_size,
    n_kv_heads, head_dim) receive the rotated k and v at ``slots`` (T,) (slot = block *
    block_size + offset). ``cos``/``sin``: with ``positions`` (T,) they are whole rotary tables
    (max_len, head_dim) indexed in the kernel (no gather launch); without, one row per token
    (T, head_dim). All floating tensors share q's dtype. Same results as
    ``reference.apply_rope`` on q and k followed by ``reference.write_kv``.
    """
    _check_rope(q, k, v, cos, sin, k_cache, v_cache, slots, positions)
    if not _use_kernel(q):
        if positions is not None:
            cos, sin = cos[positions], sin[positions]
        q_rot = _reference.apply_rope(q, cos, sin)
        _reference.write_kv(k_cache, v_cache, _reference.apply_rope(k, cos, sin), v, slots)
        return q_rot
    t, h, d = q.shape
    hkv = k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if t == 0:
        return q_out
    bd = triton.next_power_of_2(d // 2)
    bh = min(triton.next_power_of_2(max(h, hkv)), max(1, ROPE_TILE // bd))
    grid = (t, triton.cdiv(h, bh) + triton.cdiv(hkv, bh))
    _rope_kv_kernel[grid](q, k, v, cos, sin, positions if positions is not None else slots, slots, q_out, k_cache,
                          v_cache, q.stride(0), k.stride(0), v.stride(0), H=h, HKV=hkv, D=d, BH=bh, BD=bd,
                          HAS_POS=positions is not None, num_warps=4,
                          enable_fp_fusion=False,  # fp32: no FMA contraction, the products round as torch's do
                          **_common.pdl_args(pdl))
    return q_out


# ---------------------------------------------------------------------------- SiLU · up


@triton.jit(do_not_specialize=["n", "cols", "stride_g", "stride_u"])
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, n, cols, stride_g, stride_u, BLOCK: tl.constexpr,
                     PDL: tl.constexpr = False, PAIRS: tl.constexpr = False):
    """PAIRS False: silu(g) rounded to the dtype, times u (as ``F.silu(gate) * up``). PAIRS True:
    g and u interleaved in one row (g at 2 col, u at 2 col + 1; g_ptr = u_ptr), the product in
    fp32 and rounded once (as the GEMM epilogue's SiLU·mul)."""
    _pdl_wait(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    row, col = offs // cols, offs % cols
    dt = out_ptr.dtype.element_ty
    if PAIRS:
        g = tl.load(g_ptr + row * stride_g + 2 * col, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * stride_u + 2 * col + 1, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, _to(g / (1.0 + tl.exp(-g)) * u, dt), mask=mask)
    else:
        g = tl.load(g_ptr + row * stride_g + col, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * stride_u + col, mask=mask, other=0.0).to(tl.float32)
        act = _to(g / (1.0 + tl.exp(-g)), dt).to(tl.float32)
        tl.store(out_ptr + offs, _to(act * u, dt), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, *, pdl: int = 0) -> torch.Tensor:
    """``F.silu(gate) * up`` in one pass; 2-D inputs of one shape and dtype whose rows may be strided
    (gate and up can be the two halves of one fused projection). Returns a contiguous tensor."""
    for name, x in (("gate", gate), ("up", up)):
        if not torch.is_tensor(x) or x.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name} must be an fp16, bf16 or fp32 tensor; got {getattr(x, 'dtype', type(x))}")
        if x.dim() != 2 or x.stride(1) != 1:
            raise ValueError(f"{name} must be 2-D (tokens, features) with unit stride along features; got "
                             f"strides {x.stride()} for shape {tuple(x.shape)}")
    if up.shape != gate.shape or up.dtype != gate.dtype or up.device != gate.device:
        raise ValueError(f"gate and up must match: {gate.dtype} {tuple(gate.shape)} on {gate.device} vs "
                         f"{up.dtype} {tuple(up.shape)} on {up.device}")
    if not _use_kernel(gate):
        return torch.nn.functional.silu(gate) * up
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    n = gate.numel()
    if n:
        _silu_mul_kernel[(triton.cdiv(n, SILU_BLOCK),)](gate, up, out, n, gate.shape[1], gate.stride(0), up.stride(0),
                                                        BLOCK=SILU_BLOCK, num_warps=4, **_common.pdl_args(pdl))
    return out


def silu_mul_pairs(y: torch.Tensor, *, pdl: int = 0) -> torch.Tensor:
    """silu(gate) * up for a 2-D output whose features are interleaved (gate, up) pairs (the fused
    gate/up projection), in one pass: fp32 math, one rounding to y's dtype, as
    ``reference.silu_mul_pairs`` and the W4 GEMM's epilogue. (M, N / 2), contiguous."""
    if not torch.is_tensor(y) or y.dtype not in FLOAT_DTYPES:
        raise ValueError(f"y must be an fp16, bf16 or fp32 tensor; got {getattr(y, 'dtype', type(y))}")
    if y.dim() != 2 or y.stride(1) != 1 or y.shape[1] % 2:
        raise ValueError(f"y must be 2-D (tokens, features) with unit stride along an even number of features; "
                         f"got shape {tuple(y.shape)}, strides {y.stride()}")
    if not _use_kernel(y):
        return _reference.silu_mul_pairs(y).to(y.dtype)
    m, half = y.shape[0], y.shape[1] // 2
    out = torch.empty((m, half), dtype=y.dtype, device=y.device)
    n = m * half
    if n:
        _silu_mul_kernel[(triton.cdiv(n, SILU_BLOCK),)](y, y, out, n, half, y.stride(0), y.stride(0), BLOCK=SILU_BLOCK,
                                                        num_warps=4, PAIRS=True, **_common.pdl_args(pdl))
    return out
