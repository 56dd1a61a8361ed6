"""The registered op ``spear::w4a16_ec``: it runs what the planner names.

    torch.ops.spear.w4a16_ec(x, qweight, scales, zeros, locks, group_size, symmetric, layout, bias,
                             ec_a, ec_b, gate_w1, gate_b1, gate_w2, gate_b2, alpha, bound, act,
                             policy, pdl) -> Tensor

x (..., K) fp16/bf16; the weight and EC tensors in the layouts of layout.py (``layout`` the weight's
``Layout.id``); ec_a None means no compensator, gate_w1 None means gamma = 1 (static low-rank term).
act 1: the output features are interleaved (gate, up) pairs and the op returns silu(gate) * up
(N / 2 features), in the GEMM's epilogue wherever the W4 kernel writes the output. ``policy`` is
``KernelPolicy.op_args`` (the thresholds and launch table, as integers), ``pdl`` the
programmatic-dependent-launch level of this call (0 or 1). Use :func:`w4a16_linear` rather than
spelling the arguments out.

Each call asks ``planner.plan`` (the token count, the weight, the device, the policy) and calls the
kernel the plan names (``_KERNELS``) with its launch. A semi-fused compensator runs ec_gate on a
side stream beside the W4 part, then ec_up adds alpha · v Bᵀ (inside CUDA-graph capture the fork
and join are captured as graph edges); while torch.compile traces the op, which has no streams, the
serial variant runs: ec_gate, then the W4 kernel with alpha · v Bᵀ in its epilogue. Off CUDA the
plan is the fp32 torch reference (reference.py), cast.

Registered with ``torch.library.custom_op``: one opaque node for torch.compile, whose fake
implementation gives the output's shape and dtype without planning, so it traces with a
symbolic token count (vLLM compiles with a dynamic token dimension); the real implementation
plans on the concrete M it receives, at run time, so a compiled graph or a captured CUDA graph
takes the path eager mode takes. ``locks`` is scratch that every kernel returns to zero,
hence not declared mutated.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.library import custom_op

from spear.kernels import ec as ec_kernels
from spear.kernels import fused, reference
from spear.kernels.dequant import dequantize
from spear.kernels.layout import Layout, PackedEC, PackedW4
from spear.kernels.planner import EC, Kernel, Plan, plan
from spear.kernels.policy import KernelPolicy
from spear.kernels.w4a16 import check_act, w4a16_matmul

DEFAULT_POLICY = KernelPolicy()

_side_streams: dict[int, torch.cuda.Stream] = {}  # one side stream per device, made on first use


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _side_streams:
        _side_streams[idx] = torch.cuda.Stream(device=idx)
    return _side_streams[idx]


# ---------------------------------------------------------------------------- the kernels a plan names
# Each takes (x 2-D, weight, bias, launch, act, ec, v, pdl): the W4 product, plus alpha · v Bᵀ where
# ``v`` is given (the semi-fused compensator), or the whole compensator where only ``ec`` is (the
# Triton GEMM's fused form; the reference).
def _triton(x, w, bias, config, act, ec, v, pdl):
    return w4a16_matmul(x, w, bias, ec, v=v, config=config, act=act, pdl=pdl)


def _gluon(x, w, bias, config, act, ec, v, pdl):
    from spear.kernels.gluon_w4 import gluon_w4a16

    return gluon_w4a16(x, w, bias, config, act=act, ec=ec, v=v)


def _cublas(x, w, bias, config, act, ec, v, pdl):
    y = torch.nn.functional.linear(x, dequantize(w, x.dtype), bias)
    if v is not None:
        y = ec_kernels.ec_up(y, v, ec)
    return fused.silu_mul_pairs(y) if act else y


def _reference(x, w, bias, config, act, ec, v, pdl):
    y = reference.w4a16_ec_packed(x, w, bias, ec)
    return (reference.silu_mul_pairs(y) if act else y).to(x.dtype)


_KERNELS = {Kernel.TRITON: _triton, Kernel.GLUON: _gluon, Kernel.CUBLAS: _cublas, Kernel.REFERENCE: _reference}


def _beside(device: torch.device, work):
    """Run ``work()`` on the side stream, forked from the main stream here, and return the join that
    the main stream must call before it reads what ``work`` wrote. Tensors ``work`` touches are
    allocated on the main stream before the fork, so they are freed on main after the join; inside
    CUDA-graph capture fork and join become graph edges."""
    main = torch.cuda.current_stream(device)
    side = _side_stream(device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        work()
    return lambda: main.wait_stream(side)


def run(p: Plan, x: torch.Tensor, w: PackedW4, bias: Optional[torch.Tensor], e: Optional[PackedEC], act: int,
        pdl: int, overlap: bool) -> torch.Tensor:
    """The planned call on 2-D ``x``; ``overlap``: a semi-fused compensator's ec_gate may run on a
    side stream (eager CUDA calls only)."""
    kernel = _KERNELS[p.kernel]
    if p.ec is not EC.SEMI:
        return kernel(x, w, bias, p.config, act, e, None, pdl)
    v = torch.empty((x.shape[0], e.kernel_rank), dtype=x.dtype, device=x.device)

    def gate():
        ec_kernels.ec_gate(x, e, out=v, splits=p.gate_splits)

    if not overlap:
        gate()
        return kernel(x, w, bias, p.config, act, e, v, pdl)
    join = _beside(x.device, gate)
    y = kernel(x, w, bias, p.config, 0, None, None, pdl)
    join()  # before v is read
    y = ec_kernels.ec_up(y, v, e)
    return fused.silu_mul_pairs(y) if act else y


def w4a16_ec_impl(x: torch.Tensor, w: PackedW4, bias: Optional[torch.Tensor], e: Optional[PackedEC], act: int,
                  policy: KernelPolicy, pdl: int) -> torch.Tensor:
    """The op's body."""
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
    p = plan(m, n, k, 0 if e is None else e.kernel_rank, w.format, x.device, policy)
    overlap = (p.ec is EC.SEMI and policy.semi_fused_overlap and x.is_cuda and type(x) is torch.Tensor
               and not torch.compiler.is_compiling())
    return run(p, x2, w, bias, e, act, pdl, overlap).reshape(*lead, n_out)


def _weight(qweight, scales, zeros, locks, group_size: int, symmetric: bool, layout: int) -> PackedW4:
    """The op's weight arguments as a PackedW4 (``layout``: a ``Layout.id``)."""
    return PackedW4(qweight, scales, zeros, locks, group_size, symmetric, Layout.of_id(layout))


@custom_op("spear::w4a16_ec", mutates_args=())
def w4a16_ec(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
             locks: torch.Tensor, group_size: int, symmetric: bool, layout: int, bias: Optional[torch.Tensor],
             ec_a: Optional[torch.Tensor], ec_b: Optional[torch.Tensor], gate_w1: Optional[torch.Tensor],
             gate_b1: Optional[torch.Tensor], gate_w2: Optional[torch.Tensor], gate_b2: Optional[torch.Tensor],
             alpha: float, bound: float, act: int, policy: list[int], pdl: int) -> torch.Tensor:
    w = _weight(qweight, scales, zeros, locks, group_size, symmetric, layout)
    e = None
    if ec_a is not None:
        if ec_b is None:
            raise ValueError("ec_a given without ec_b: the compensator needs both A and B")
        e = PackedEC(ec_a, ec_b, gate_w1, gate_b1, gate_w2, gate_b2, alpha, bound, ec_a.shape[0])
    return w4a16_ec_impl(x, w, bias, e, act, KernelPolicy.of_op_args(policy), pdl)


@w4a16_ec.register_fake
def _w4a16_ec_fake(x, qweight, scales, zeros, locks, group_size, symmetric, layout, bias, ec_a, ec_b, gate_w1,
                   gate_b1, gate_w2, gate_b2, alpha, bound, act, policy, pdl):
    """The output's shape and dtype only: no plan, so the token count may be symbolic."""
    w = _weight(qweight, scales, zeros, locks, group_size, symmetric, layout)
    n = w.out_features
    check_act(act, n)
    if x.shape[-1] != w.in_features:
        raise ValueError(f"x has {x.shape[-1]} features, the packed weight expects in_features={w.in_features}")
    return x.new_empty((*x.shape[:-1], n // 2 if act else n))


def _traced(x: torch.Tensor) -> bool:
    """Whether ``x`` is being traced (torch.compile, fake or symbolic shapes): then the op's node,
    whose fake implementation needs no concrete token count."""
    return (torch.compiler.is_compiling() or type(x) is not torch.Tensor
            or not all(isinstance(d, int) for d in x.shape))


def w4a16_linear(x: torch.Tensor, w: PackedW4, bias: torch.Tensor | None = None,
                 ec: PackedEC | None = None, act: int = 0, policy: KernelPolicy = DEFAULT_POLICY,
                 pdl: int = 0) -> torch.Tensor:
    """``x W_hatᵀ (+ bias) (+ alpha · B (gamma(A x) ⊙ A x))`` under ``policy``; with ``act`` 1,
    silu(gate) * up of that output's interleaved (gate, up) features.

    While traced (torch.compile, fake tensors, symbolic sizes), through the registered op
    ``spear::w4a16_ec`` (one opaque node); otherwise its body runs directly: the dispatcher's
    argument handling cost ~100 µs of host time a call (a 2-core x86-64 CPU), which at ~160 W4
    calls per prefill step of an 8B model left the H200 idle (BENCHMARKS.md, "Serving: mixed
    steps"). CUDA graphs capture either."""
    if _traced(x):
        g = ec is not None and ec.gated
        return torch.ops.spear.w4a16_ec(
            x, w.qweight, w.scales, w.zeros, w.locks, w.group_size, w.symmetric, w.layout_id, bias,
            ec.a if ec is not None else None, ec.b if ec is not None else None,
            ec.w1 if g else None, ec.b1 if g else None, ec.w2 if g else None, ec.b2 if g else None,
            float(ec.alpha) if ec is not None else 0.0, float(ec.bound) if ec is not None else 0.0, act,
            list(policy.op_args), pdl)
    return w4a16_ec_impl(x, w, bias, ec, act, policy, pdl)
