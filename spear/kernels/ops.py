"""The registered op ``spear::w4a16_ec`` and its phase-aware dispatch.

    torch.ops.spear.w4a16_ec(x, qweight, scales, zeros, locks, group_size, symmetric, kmajor, bias,
                             ec_a, ec_b, gate_w1, gate_b1, gate_w2, gate_b2, alpha, bound, act=0) -> Tensor

x (..., K) fp16/bf16; the weight and EC tensors in the layouts of layout.py; ec_a None means
no compensator, gate_w1 None means gamma = 1 (static low-rank term). act 1: the output
features are interleaved (gate, up) pairs and the op returns silu(gate) * up (N / 2
features), in the GEMM's epilogue wherever the Triton GEMM writes the output. Use
:func:`w4a16_linear` rather than spelling the arguments out.

Dispatch on CUDA, by M = number of tokens:
  no EC                plain W4: the Triton GEMM (split-K at decode); from
                       DEQUANT_MM_MIN_M on, dequantize + cuBLAS.
  EC, M <= FUSED_MAX_M full fusion: one launch, A x in the same pass, gate in the epilogue.
  EC, M >  FUSED_MAX_M semi-fused: ec_gate on a side stream, overlapped with the W4 GEMM;
                       then ec_up adds alpha · v Bᵀ. Inside CUDA-graph capture the fork and
                       join are captured as graph edges. While torch.compile traces the op
                       (no streams there) the serial variant runs: ec_gate, then the GEMM
                       with the v-epilogue (EC_MODE 2). From DEQUANT_MM_MIN_M, PREFILL_EC
                       "out" / "in" put the EC into the cuBLAS GEMM itself (see there).
On any other device the op runs the fp32 torch reference (reference.py) and casts.

Registered with ``torch.library.triton_op`` and every launch goes through ``wrap_triton``,
so torch.compile sees the Triton kernels and CUDA graphs can capture them. ``locks`` is
scratch that every kernel returns to zero, hence not declared mutated.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.library import triton_op, wrap_triton

from spear.kernels import _common
from spear.kernels import ec as ec_kernels
from spear.kernels import fused
from spear.kernels import reference
from spear.kernels.layout import PackedEC, PackedW4
from spear.kernels.dequant import dequantize
from spear.kernels.w4a16 import check_act, w4a16_matmul

# Largest M that takes the fused kernel. First measured per layer on one H200, 2026-11-29
# (benchmarks/bench_kernels.py, BENCHMARKS.md "Kernels"; r = 32, h = 32, median over the
# Llama-2-7B/3-8B shapes): fused/semi-fused time 0.89 at M = 16, 1.09 at M = 32, 1.19 at 64.
# Since then the semi-fused path's ec_gate and the GEMM changed; in whole decode steps (H200,
# 2026-12-01, bench_decode.py --fused-max-m 64, BENCHMARKS.md "Thirteenth run") the fused kernel
# wins at 32 and 64 sequences: Llama-3-8B W4+EC 6,714 -> 7,272 and 9,659 -> 10,344 tok/s.
FUSED_MAX_M = 64
# Largest (padded) EC rank that takes the fused kernel at M <= FUSED_MAX_M; larger ECs run
# ec_gate first and the GEMM's v-epilogue (EC_MODE 2). ptxas (sm_90): the fused K-major
# decode kernel needs 151 registers at R = 16 and 255 at R = 64 (the W4 loop alone: 96; with
# the v-epilogue: 96 at R = 16, 128 at R = 64; benchmarks/kernel_registers.py), so large ranks
# cost the W4 loop occupancy.
# Kept at MAX_RANK (always fused) until the two are timed against each other
# (benchmarks/bench_decode.py --fused-max-rank).
FUSED_MAX_RANK = 128
# Smallest M at which dequantize + cuBLAS beats the Triton W4 GEMM (same run): their time
# ratio is 0.36 at M = 128 and 0.37..0.52 up to M = 4096; at M <= 64 the split-K tiles win.
DEQUANT_MM_MIN_M = 128
# The EC from DEQUANT_MM_MIN_M tokens, where the W4 part is dequantize + cuBLAS:
#   "side": ec_gate on a side stream beside it, then ec_up (a pass over the output);
#   "out":  A stacked under W_hat, one GEMM, then ec_stacked (a pass over the output);
#   "in":   [x, v] against [W_hat, alpha · B], one GEMM (a copy of x, no pass over the output);
#   "auto": "in" where N > K (the output is wider than the input), else "out".
# "side" measured +9 to +24% over W4 at 512-2048 tokens (median +15%; H200, 2026-12-01,
# BENCHMARKS.md "Twelfth run"); the others are not yet timed (bench_kernels.py --prefill-ec),
# so "side" stays the default until they are.
PREFILL_EC_MODES = ("side", "out", "in", "auto")
PREFILL_EC = "side"
# Whether the semi-fused path overlaps ec_gate on a side stream (True) or runs it first and
# reads v in the GEMM epilogue (False): the overlap was as fast or faster at M >= 256.
SEMI_FUSED_OVERLAP = True
# The semi-fused path adds alpha · v Bᵀ after the GEMM, in a kernel of its own (ec_up: one more
# read and write of the (M, N) output). Adding it through cuBLAS's epilogue instead (torch.addmm with
# C = alpha · v Bᵀ computed beside the dequantize pass) was slower on 10 of 12 layer shapes at 512 and
# 2048 tokens on an H200 (BENCHMARKS.md, "Eleventh run", item 7): C is itself an (M, N) tensor.

_side_streams: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _side_streams:
        _side_streams[idx] = torch.cuda.Stream(device=idx)
    return _side_streams[idx]


def _silu_mul_pairs(y: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of an output with interleaved (gate, up) features, where no GEMM epilogue does it."""
    return fused.silu_mul_pairs(y, launch=wrap_triton)


def _plain_w4(x: torch.Tensor, w: PackedW4, bias: Optional[torch.Tensor], act: int = 0) -> torch.Tensor:
    if x.shape[0] >= DEQUANT_MM_MIN_M:
        y = torch.nn.functional.linear(x, dequantize(w, x.dtype, launch=wrap_triton), bias)
        return _silu_mul_pairs(y) if act else y
    return w4a16_matmul(x, w, bias, launch=wrap_triton, act=act)


def _beside(device: torch.device, overlap: bool, work):
    """Run ``work()`` on the side stream, forked from the main stream here, and return the join that
    the main stream must call before it reads what ``work`` wrote (inline and a no-op join without
    ``overlap``). Tensors ``work`` touches are allocated on the main stream before the fork, so they
    are freed on main after the join; inside CUDA-graph capture fork and join become graph edges."""
    if not overlap:
        work()
        return lambda: None
    main = torch.cuda.current_stream(device)
    side = _side_stream(device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        work()
    return lambda: main.wait_stream(side)


def _prefill_ec_out(x: torch.Tensor, w: PackedW4, bias: Optional[torch.Tensor], e: PackedEC,
                    act: int = 0) -> torch.Tensor:
    """PREFILL_EC "out": one cuBLAS GEMM on [W_hat; A] (A's R rows under W_hat) gives the output
    and u = x Aᵀ as its last R columns; ec_stacked then adds alpha · gamma(u) ⊙ u Bᵀ in a pass
    over the output (ec.py)."""
    n, r = w.out_features, e.a.shape[0]
    wa = _common.alloc((n + r, w.in_features), dtype=x.dtype, device=x.device)
    dequantize(w, x.dtype, launch=wrap_triton, out=wa[:n])
    wa[n:].copy_(e.a)
    return ec_kernels.ec_stacked(torch.nn.functional.linear(x, wa), n, e, bias, act, launch=wrap_triton)


def _prefill_ec_in(x: torch.Tensor, w: PackedW4, bias: Optional[torch.Tensor], e: PackedEC,
                   act: int = 0) -> torch.Tensor:
    """PREFILL_EC "in": ec_gate writes [x, v] (copying x as it reads it), the weight is
    [W_hat, alpha · B], and one cuBLAS GEMM over K + R inputs returns x W_hatᵀ + alpha · v Bᵀ:
    the EC costs a copy of x and R / K more GEMM, and no pass over the output."""
    m, k = x.shape
    n, r = w.out_features, e.a.shape[0]
    xv = _common.alloc((m, k + r), dtype=x.dtype, device=x.device)
    ec_kernels.ec_gate(x, e, out=xv[:, k:], launch=wrap_triton, copy_to=xv[:, :k])
    wb = _common.alloc((n, k + r), dtype=x.dtype, device=x.device)
    dequantize(w, x.dtype, launch=wrap_triton, out=wb[:, :k])
    torch.mul(e.b, e.alpha, out=wb[:, k:])
    y = torch.nn.functional.linear(xv, wb, bias)
    return _silu_mul_pairs(y) if act else y


def _prefill_ec_mode(n: int, k: int) -> str:
    if PREFILL_EC not in PREFILL_EC_MODES:
        raise ValueError(f"PREFILL_EC must be one of {PREFILL_EC_MODES}; got {PREFILL_EC!r}")
    if PREFILL_EC == "auto":
        # the pass over the output costs M·N, the copy of x M·K
        return "in" if n > k else "out"
    return PREFILL_EC


def _semi_fused(x: torch.Tensor, w: PackedW4, bias: Optional[torch.Tensor], e: PackedEC,
                overlap: bool, act: int = 0) -> torch.Tensor:
    v = _common.alloc((x.shape[0], e.a.shape[0]), dtype=x.dtype, device=x.device)
    if not overlap:
        ec_kernels.ec_gate(x, e, out=v, launch=wrap_triton)
        if x.shape[0] >= DEQUANT_MM_MIN_M:
            y = ec_kernels.ec_up(_plain_w4(x, w, bias), v, e, launch=wrap_triton)
            return _silu_mul_pairs(y) if act else y
        return w4a16_matmul(x, w, bias, e, ec_mode=2, v=v, launch=wrap_triton, act=act)
    join = _beside(x.device, True, lambda: ec_kernels.ec_gate(x, e, out=v, launch=wrap_triton))
    out = _plain_w4(x, w, bias)
    join()  # before v is read
    y = ec_kernels.ec_up(out, v, e, launch=wrap_triton)
    return _silu_mul_pairs(y) if act else y


@triton_op("spear::w4a16_ec", mutates_args=())
def w4a16_ec(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
             locks: torch.Tensor, group_size: int, symmetric: bool, kmajor: bool, bias: Optional[torch.Tensor],
             ec_a: Optional[torch.Tensor], ec_b: Optional[torch.Tensor], gate_w1: Optional[torch.Tensor],
             gate_b1: Optional[torch.Tensor], gate_w2: Optional[torch.Tensor], gate_b2: Optional[torch.Tensor],
             alpha: float, bound: float, act: int = 0) -> torch.Tensor:
    w = PackedW4(qweight, scales, zeros, locks, group_size, symmetric, kmajor)
    e = None
    if ec_a is not None:
        if ec_b is None:
            raise ValueError("ec_a given without ec_b: the compensator needs both A and B")
        e = PackedEC(ec_a, ec_b, gate_w1, gate_b1, gate_w2, gate_b2, alpha, bound, ec_a.shape[0])
    k, n = w.in_features, w.out_features
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the packed weight expects in_features={k}")
    check_act(act, n)
    n_out = n // 2 if act else n
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m == 0:
        return x.new_empty((*lead, n_out))
    if x.device.type != "cuda":
        y = reference.w4a16_ec_packed(x2, w, bias, e)
        y = (reference.silu_mul_pairs(y) if act else y).to(x.dtype)
    elif e is None:
        y = _plain_w4(x2, w, bias, act)
    elif m <= FUSED_MAX_M and e.a.shape[0] <= FUSED_MAX_RANK:
        y = w4a16_matmul(x2, w, bias, e, ec_mode=1, launch=wrap_triton, act=act)
    elif m <= FUSED_MAX_M:
        y = _semi_fused(x2, w, bias, e, overlap=False, act=act)
    else:
        mode = _prefill_ec_mode(n, k) if m >= DEQUANT_MM_MIN_M else "side"
        if mode == "out":
            y = _prefill_ec_out(x2, w, bias, e, act)
        elif mode == "in":
            y = _prefill_ec_in(x2, w, bias, e, act)
        else:
            eager = type(x) is torch.Tensor and not torch.compiler.is_compiling()
            y = _semi_fused(x2, w, bias, e, overlap=SEMI_FUSED_OVERLAP and eager, act=act)
    return y.reshape(*lead, n_out)


def w4a16_linear(x: torch.Tensor, w: PackedW4, bias: torch.Tensor | None = None,
                 ec: PackedEC | None = None, act: int = 0) -> torch.Tensor:
    """``x W_hatᵀ (+ bias) (+ alpha · B (gamma(A x) ⊙ A x))`` through ``spear::w4a16_ec``; with
    ``act`` 1, silu(gate) * up of that output's interleaved (gate, up) features."""
    g = ec is not None and ec.gated
    return torch.ops.spear.w4a16_ec(
        x, w.qweight, w.scales, w.zeros, w.locks, w.group_size, w.symmetric, w.kmajor, bias,
        ec.a if ec is not None else None, ec.b if ec is not None else None,
        ec.w1 if g else None, ec.b1 if g else None, ec.w2 if g else None, ec.b2 if g else None,
        float(ec.alpha) if ec is not None else 0.0, float(ec.bound) if ec is not None else 0.0, act)
