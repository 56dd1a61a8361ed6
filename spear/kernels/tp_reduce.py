"""The row-parallel layer's sum across tensor-parallel ranks and its compensator's second half, one kernel.

Under tensor parallelism a row-parallel linear (o_proj, down_proj) computes on rank t a partial
output y_t = W_t x_t over its share of the input features and, for a gated compensator, a partial
u_t = A_t x_t. The layer's output is

    y = sum_t y_t + bias + alpha · B (gamma(u) ⊙ u),    u = sum_t u_t

and gamma is nonlinear, so u must be summed before it is applied. Each rank writes its partials
side by side into one row of a staging buffer, [y_t | u_t] (M, N + R). ``tp_reduce_ec`` reads P
such buffers, sums them in fp32, applies the gate, adds alpha · B v and the bias, and writes y
(M, N): with P = the ranks' buffers (the peer path, spear/parallel/comm.py: each rank reads its
peers' buffers over NVLink through symmetric memory), the reduction, the gate and B are one
launch and no collective runs; with P = 1 it is the post-compensator kernel after an all-reduce
of the one buffer.

Peers' buffers are separate pointer arguments (at most MAX_PEERS) rather than a pointer table, so
the interpreter runs the kernel as compiled code does; a launch passes the first buffer in the
unused places, which PEERS (a constexpr) keeps from being read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spear.kernels._common import INTERPRET, _dot, _ec_gate
from spear.kernels.layout import PackedEC

MAX_PEERS = 8
BM, BN = 16, 128


@triton.jit
def _peer_sum(p0, p1, p2, p3, p4, p5, p6, p7, offs, mask, PEERS: tl.constexpr):
    """fp32 sum over the first PEERS buffers of the elements at ``offs``, in rank order."""
    s = tl.load(p0 + offs, mask=mask, other=0.0).to(tl.float32)
    if PEERS > 1:
        s += tl.load(p1 + offs, mask=mask, other=0.0).to(tl.float32)
    if PEERS > 2:
        s += tl.load(p2 + offs, mask=mask, other=0.0).to(tl.float32)
    if PEERS > 3:
        s += tl.load(p3 + offs, mask=mask, other=0.0).to(tl.float32)
    if PEERS > 4:
        s += tl.load(p4 + offs, mask=mask, other=0.0).to(tl.float32)
    if PEERS > 5:
        s += tl.load(p5 + offs, mask=mask, other=0.0).to(tl.float32)
    if PEERS > 6:
        s += tl.load(p6 + offs, mask=mask, other=0.0).to(tl.float32)
    if PEERS > 7:
        s += tl.load(p7 + offs, mask=mask, other=0.0).to(tl.float32)
    return s


@triton.jit(do_not_specialize=["M"])
def _tp_reduce_ec_kernel(
    p0, p1, p2, p3, p4, p5, p6, p7, out_ptr, bias_ptr, b_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr,
    alpha, bound,
    M, N, stride_s, stride_o,
    PEERS: tl.constexpr, EC: tl.constexpr, GATE: tl.constexpr, HAS_BIAS: tl.constexpr,
    R: tl.constexpr, H: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, DOT_F32: tl.constexpr,
):
    """Grid: (M / BM) x (N / BN) output tiles, column tiles fastest. Each program sums its tile of
    the partial outputs and, with EC, the BM tokens' partial u (recomputing their gate: R x H
    values, next to nothing), then adds alpha · v Bᵀ for its columns and the bias."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BN)
    offs_m = (pid // n_tiles) * BM + tl.arange(0, BM)
    offs_n = (pid % n_tiles) * BN + tl.arange(0, BN)
    m_mask, n_mask = offs_m < M, offs_n < N
    mask = m_mask[:, None] & n_mask[None, :]
    y = _peer_sum(p0, p1, p2, p3, p4, p5, p6, p7, offs_m[:, None] * stride_s + offs_n[None, :], mask, PEERS)
    if EC:
        offs_r = tl.arange(0, R)
        uT = _peer_sum(p0, p1, p2, p3, p4, p5, p6, p7, offs_m[None, :] * stride_s + N + offs_r[:, None],
                       m_mask[None, :], PEERS)
        # torch.compile passes Python floats as fp64 scalars: keep the gate's math fp32
        vT = _ec_gate(uT, w1_ptr, b1_ptr, w2_ptr, b2_ptr, tl.cast(bound, tl.float32), R, H, BM, GATE, DOT_F32)
        bt = tl.load(b_ptr + (offs_n % N)[None, :] * R + offs_r[:, None])      # [R, BN]
        v = tl.trans(vT).to(bt.dtype)                                        # v in the activation dtype
        y += tl.cast(alpha, tl.float32) * _dot(v, bt, tl.zeros((BM, BN), tl.float32), DOT_F32)
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_o + offs_n[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def tp_reduce_ec(staging: list[torch.Tensor], n: int, bias: torch.Tensor | None = None, ec: PackedEC | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """y (M, n) from P staging buffers (M, n + R) of the same shape, dtype and row stride: their
    sum's first n columns, + bias, + alpha · B (gamma(u) ⊙ u) with u their sum's last R columns
    when ``ec`` is given (its B, alpha and gate; R = its padded rank). Without ``ec`` the buffers
    may be (M, n) or wider (the columns after n are not read)."""
    p = len(staging)
    if not 1 <= p <= MAX_PEERS:
        raise ValueError(f"tp_reduce_ec sums 1 to {MAX_PEERS} buffers, got {p}")
    s0 = staging[0]
    m, width = s0.shape
    r = 0 if ec is None else ec.b.shape[1]
    if width < n + r or s0.stride(1) != 1:
        raise ValueError(f"the staging buffers must be (M, {n} + {r}) with unit inner stride; got {tuple(s0.shape)}, "
                         f"strides {s0.stride()}")
    for t in staging[1:]:
        if t.shape != s0.shape or t.dtype != s0.dtype or t.stride() != s0.stride():
            raise ValueError("the staging buffers differ in shape, dtype or strides")
    if ec is not None and ec.b.shape[0] != n:
        raise ValueError(f"B has {ec.b.shape[0]} rows, the output {n} columns")
    out = out if out is not None else torch.empty((m, n), dtype=s0.dtype, device=s0.device)
    if m == 0:
        return out
    gated = ec is not None and ec.gated
    gate = (ec.w1, ec.b1, ec.w2, ec.b2) if gated else (s0,) * 4
    peers = list(staging) + [s0] * (MAX_PEERS - p)
    _tp_reduce_ec_kernel[(triton.cdiv(m, BM) * triton.cdiv(n, BN),)](
        *peers, out, bias if bias is not None else s0, ec.b if ec is not None else s0, *gate,
        float(ec.alpha) if ec is not None else 0.0, float(ec.bound) if ec is not None else 0.0,
        m, n, s0.stride(0), out.stride(0),
        PEERS=p, EC=ec is not None, GATE=gated, HAS_BIAS=bias is not None, R=max(r, 16),
        H=ec.w1.shape[0] if gated else 16, BM=BM, BN=BN, DOT_F32=INTERPRET, num_warps=4, num_stages=1,
    )
    return out
