"""Compensator kernels for the prefill (semi-fused) path.

    ec_gate:  v (M, R) = gamma(u) ⊙ u,  u = x Aᵀ          (reads x once; tiny FLOPs)
    ec_up:    out (M, N) += alpha · v Bᵀ                   (in place; one read and write of out)

At prefill the W4 GEMM is compute-bound and x is re-read by every column tile anyway, so
fusing A x into its K loop would add R/BN of its MMA work to every tile. Instead
``ec_gate`` runs on a side stream while the GEMM runs, and ``ec_up`` adds the rank-R
product after both (ops.py). Alternatively the GEMM's epilogue reads v (EC_MODE 2 of
w4a16.py), which saves the pass over out but must wait for ``ec_gate`` first.

Algorithm of ec_gate: one program per BM tokens walks K in BK steps,
uT [R, BM] += A[R, BK] · xT[BK, BM] (fp32 accumulation on tensor cores), then evaluates
the gate on uT (``_ec_gate``) and stores v in the activation dtype. Split over K when the
token tiles alone are few (``gate_splits``): at 512 tokens there are only 32 tiles, and one
SM streaming a 16-token slice of x and all of A over K = 11008 took longer than the
dequantize pass it runs beside, so it set the semi-fused layer's time. Split, each program
sums its share of K into an fp32 workspace (splits, M, R) and a second kernel adds the
shares, evaluates the gate and stores v.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spear.kernels._common import INTERPRET, _dot, _ec_gate
from spear.kernels.layout import PackedEC

# Token tile of ec_gate: 16 keeps >= 32 programs in flight from M = 512 on (x is read once,
# so more programs means more of the memory system busy).
GATE_BM = 16
# ec_gate splits K until its programs reach about ``programs`` (KernelPolicy.gate_programs;
# the default: two per SM of an H200), each split keeping at least GATE_MIN_STEPS steps of BK.
GATE_PROGRAMS = 264
GATE_MIN_STEPS = 4
UP_BM, UP_BN = 64, 128


def gate_bk(k: int) -> int:
    """ec_gate's K step: 128 inputs where K allows it."""
    return 128 if k % 128 == 0 else (64 if k % 64 == 0 else 32)


def gate_splits(m: int, k: int, programs: int = GATE_PROGRAMS) -> int:
    """K splits of ec_gate at M tokens: enough programs to keep the memory system busy. A power of
    two: the split count is a constexpr of the kernels (one compilation per value), so the token
    counts a server meets compile a handful of variants at warm-up, not one per count."""
    tiles = -(-m // GATE_BM)
    want = max(1, min(programs // tiles, (k // gate_bk(k)) // GATE_MIN_STEPS))
    return 1 << (want.bit_length() - 1)


@triton.jit(do_not_specialize=["M"])
def _ec_gate_kernel(
    x_ptr, a_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, v_ptr,
    bound,
    M, K, stride_xm, steps_per_split, stride_vm,
    GATE: tl.constexpr, R: tl.constexpr, H: tl.constexpr,
    BM: tl.constexpr, BK: tl.constexpr, DOT_F32: tl.constexpr, SPLIT: tl.constexpr,
):
    """Grid (token tiles, SPLIT). SPLIT 1: v for BM tokens (rows stride_vm apart). Otherwise this
    split's share of u = x Aᵀ (steps_per_split steps of BK) into the fp32 workspace at v_ptr,
    (SPLIT, M, R)."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    offs_m = pid * BM + tl.arange(0, BM)
    m_mask = offs_m < M
    offs_r = tl.arange(0, R)
    offs_k = tl.arange(0, BK)
    k_lo = split * steps_per_split * BK
    k_hi = tl.minimum(k_lo + steps_per_split * BK, K)
    uT = tl.zeros((R, BM), tl.float32)
    for k in range(k_lo, k_hi, BK):
        a = tl.load(a_ptr + offs_r[:, None] * K + (k + offs_k)[None, :])
        xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + (k + offs_k)[:, None], mask=m_mask[None, :], other=0.0)
        uT = _dot(a, xt, uT, DOT_F32)
    if SPLIT == 1:
        # torch.compile passes Python floats as fp64 scalars: keep the gate's math fp32
        vT = _ec_gate(uT, w1_ptr, b1_ptr, w2_ptr, b2_ptr, tl.cast(bound, tl.float32), R, H, BM, GATE, DOT_F32)
        tl.store(v_ptr + offs_m[None, :] * stride_vm + offs_r[:, None], vT.to(v_ptr.dtype.element_ty),
                 mask=m_mask[None, :])
    else:
        ws = v_ptr + split.to(tl.int64) * M * R
        tl.store(ws + offs_m[None, :] * R + offs_r[:, None], uT, mask=m_mask[None, :])


@triton.jit(do_not_specialize=["M"])
def _ec_gate_finish_kernel(
    ws_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, v_ptr,
    bound,
    M, stride_vm,
    GATE: tl.constexpr, R: tl.constexpr, H: tl.constexpr,
    BM: tl.constexpr, DOT_F32: tl.constexpr, SPLIT: tl.constexpr,
):
    """v for BM tokens from the SPLIT shares of u in the workspace (SPLIT, M, R) fp32."""
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    m_mask = offs_m < M
    offs_r = tl.arange(0, R)
    ptrs = ws_ptr + offs_m[None, :] * R + offs_r[:, None]
    uT = tl.zeros((R, BM), tl.float32)
    for s in range(SPLIT):
        uT += tl.load(ptrs + s * M * R, mask=m_mask[None, :], other=0.0)
    vT = _ec_gate(uT, w1_ptr, b1_ptr, w2_ptr, b2_ptr, tl.cast(bound, tl.float32), R, H, BM, GATE, DOT_F32)
    tl.store(v_ptr + offs_m[None, :] * stride_vm + offs_r[:, None], vT.to(v_ptr.dtype.element_ty),
             mask=m_mask[None, :])


@triton.jit
def _out_tile(M, N, R: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """This program's [BM, BN] tile of an (M, N) output (1-D grid, column tiles fastest): its column
    tile index, token and feature offsets, rank offsets and the two masks."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BN)
    offs_m = (pid // n_tiles) * BM + tl.arange(0, BM)
    offs_n = (pid % n_tiles) * BN + tl.arange(0, BN)
    return pid % n_tiles, offs_m, offs_n, tl.arange(0, R), offs_m < M, offs_n < N


@triton.jit(do_not_specialize=["M"])
def _ec_up_kernel(
    v_ptr, b_ptr, out_ptr,
    alpha,
    M, N, stride_om,
    R: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, DOT_F32: tl.constexpr,
):
    _, offs_m, offs_n, offs_r, m_mask, n_mask = _out_tile(M, N, R, BM, BN)
    v = tl.load(v_ptr + offs_m[:, None] * R + offs_r[None, :], mask=m_mask[:, None], other=0.0)
    bt = tl.load(b_ptr + (offs_n % N)[None, :] * R + offs_r[:, None])
    corr = _dot(v, bt, tl.zeros((BM, BN), tl.float32), DOT_F32)
    o_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    y = tl.load(o_ptrs, mask=mask, other=0.0).to(tl.float32) + tl.cast(alpha, tl.float32) * corr
    tl.store(o_ptrs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _gate_args(ec: PackedEC) -> tuple[tuple, dict]:
    """The gate MLP's four tensors (A in their place when the EC has no gate; never read then) and
    the kernels' GATE / R / H constants."""
    gated = ec.gated
    tensors = (ec.w1, ec.b1, ec.w2, ec.b2) if gated else (ec.a,) * 4
    return tensors, dict(GATE=gated, R=ec.a.shape[0], H=ec.w1.shape[0] if gated else 16)


def _check(x: torch.Tensor, ec: PackedEC) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be 2-D with unit stride along features; got shape {tuple(x.shape)}, "
                         f"strides {x.stride()}")
    if x.shape[1] != ec.a.shape[1]:
        raise ValueError(f"x has {x.shape[1]} features, A expects in_features={ec.a.shape[1]}")
    if x.dtype != ec.a.dtype:
        raise ValueError(f"EC parameters must be in the activation dtype {x.dtype}; got {ec.a.dtype}")
    if x.shape[1] % 32:
        raise ValueError(f"in_features must be a multiple of 32 (the smallest K tile); got {x.shape[1]}")


def ec_gate(x: torch.Tensor, ec: PackedEC, out: torch.Tensor | None = None, *,
            splits: int | None = None, programs: int = GATE_PROGRAMS) -> torch.Tensor:
    """v = gamma(x Aᵀ) ⊙ (x Aᵀ), (M, R) in the activation dtype (R the padded rank).
    ``out``: where to write v, rows of unit stride (e.g. the last R columns of a wider matrix).
    ``splits``: K splits (default ``gate_splits`` for about ``programs`` programs); 1 is one
    program per token tile."""
    _check(x, ec)
    m, k = x.shape
    r = ec.a.shape[0]
    v = out if out is not None else torch.empty((m, r), dtype=x.dtype, device=x.device)
    if v.shape != (m, r) or v.dtype != x.dtype or v.stride(1) != 1:
        raise ValueError(f"v must be ({m}, {r}) {x.dtype} with rows of unit stride; got {tuple(v.shape)} {v.dtype}, "
                         f"strides {v.stride()}")
    bk = gate_bk(k)
    steps = k // bk
    splits = gate_splits(m, k, programs) if splits is None else max(1, min(int(splits), steps))
    per = triton.cdiv(steps, splits)
    splits = triton.cdiv(steps, per)  # no empty split
    gate, consts = _gate_args(ec)
    consts.update(BM=GATE_BM, DOT_F32=INTERPRET)
    tiles = triton.cdiv(m, GATE_BM)
    ws = v if splits == 1 else torch.empty((splits, m, r), dtype=torch.float32, device=x.device)
    _ec_gate_kernel[(tiles, splits)](x, ec.a, *gate, ws, float(ec.bound), m, k, x.stride(0), per,
                                     v.stride(0) if splits == 1 else r, BK=bk, SPLIT=splits, **consts, num_warps=4,
                                     num_stages=3)
    if splits > 1:
        _ec_gate_finish_kernel[(tiles,)](ws, *gate, v, float(ec.bound), m, v.stride(0), SPLIT=splits, **consts,
                                         num_warps=4, num_stages=1)
    return v


def ec_up(out: torch.Tensor, v: torch.Tensor, ec: PackedEC) -> torch.Tensor:
    """out += alpha · v Bᵀ in place; returns ``out``."""
    m, n = out.shape
    r = ec.b.shape[1]
    if v.shape != (m, r) or ec.b.shape[0] != n or out.stride(1) != 1:
        raise ValueError(f"ec_up needs out (M, N) with unit inner stride, v (M, {r}) and B ({n}, {r}); got out "
                         f"{tuple(out.shape)}, v {tuple(v.shape)}, B {tuple(ec.b.shape)}")
    _ec_up_kernel[(triton.cdiv(m, UP_BM) * triton.cdiv(n, UP_BN),)](
        v, ec.b, out, float(ec.alpha), m, n, out.stride(0),
        R=r, BM=UP_BM, BN=UP_BN, DOT_F32=INTERPRET, num_warps=4, num_stages=1,
    )
    return out
