"""The registered op ``spear::w4a16_ec`` and its dispatch by the kernel policy.

    torch.ops.spear.w4a16_ec(x, qweight, scales, zeros, locks, group_size, symmetric, layout, bias,
                             ec_a, ec_b, gate_w1, gate_b1, gate_w2, gate_b2, alpha, bound, act,
                             policy, pdl) -> Tensor

x (..., K) fp16/bf16; the weight and EC tensors in the layouts of layout.py (``layout`` the index
of the weight's in layout.LAYOUTS); ec_a None means
no compensator, gate_w1 None means gamma = 1 (static low-rank term). act 1: the output
features are interleaved (gate, up) pairs and the op returns silu(gate) * up (N / 2
features), in the GEMM's epilogue wherever the Triton GEMM writes the output. ``policy`` is
``KernelPolicy.op_args`` (the thresholds and launch table, as integers), ``pdl`` the
programmatic-dependent-launch level of this call (0 or 1). Use :func:`w4a16_linear` rather
than spelling the arguments out.

The path by M = number of tokens is ``policy.plan`` (see spear/kernels/policy.py): the Triton
GEMM, the Gluon GEMM (Hopper), dequantize + cuBLAS, the fused EC, or the semi-fused EC (ec_gate on a side stream,
overlapped with the W4 part, then ec_up adds alpha · v Bᵀ; inside CUDA-graph capture the fork
and join are captured as graph edges; while torch.compile traces the op, which has no streams,
the serial variant runs: ec_gate, then the GEMM with the v-epilogue). On any other device
the op runs the fp32 torch reference (reference.py) and casts.

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
from spear.kernels import fused
from spear.kernels import reference
from spear.kernels.dequant import dequantize
from spear.kernels.launch import Config, GluonConfig
from spear.kernels.layout import LAYOUTS, PackedEC, PackedW4
from spear.kernels.policy import KernelPolicy, _plan, settings
from spear.kernels.w4a16 import check_act, w4a16_matmul

DEFAULT_POLICY = KernelPolicy()

_side_streams: dict[int, torch.cuda.Stream] = {}  # one side stream per device, made on first use


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _side_streams:
        _side_streams[idx] = torch.cuda.Stream(device=idx)
    return _side_streams[idx]


_gluon_devices: dict[int, bool] = {}  # whether each device runs the Gluon GEMM, asked once


def gluon_available(device: torch.device) -> bool:
    """The device is a Hopper GPU and this Triton has Gluon (gluon_w4.available), asked once per device."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _gluon_devices:
        from spear.kernels import gluon_w4

        _gluon_devices[idx] = gluon_w4.available(torch.device("cuda", idx))
    return _gluon_devices[idx]


def _w4_part(x: torch.Tensor, w: PackedW4, bias: Optional[torch.Tensor], config, pdl: int, act: int = 0):
    """The W4 product alone: the Triton GEMM with a ``Config``, the Gluon GEMM with a
    ``GluonConfig``, or dequantize + cuBLAS (None)."""
    if isinstance(config, GluonConfig):
        from spear.kernels.gluon_w4 import gluon_w4a16

        return gluon_w4a16(x, w, bias, config, act=act)
    if config is None:
        y = torch.nn.functional.linear(x, dequantize(w, x.dtype), bias)
        return fused.silu_mul_pairs(y) if act else y
    return w4a16_matmul(x, w, bias, config=config, act=act, pdl=pdl)


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


def _semi_fused(x: torch.Tensor, w: PackedW4, bias: Optional[torch.Tensor], e: PackedEC, config, overlap: bool,
                gate_programs: int, pdl: int, act: int = 0) -> torch.Tensor:
    v = torch.empty((x.shape[0], e.a.shape[0]), dtype=x.dtype, device=x.device)

    def gate():
        ec_kernels.ec_gate(x, e, out=v, programs=gate_programs)

    if not overlap:
        gate()
        if isinstance(config, Config):  # the Triton GEMM's epilogue adds alpha · v Bᵀ
            return w4a16_matmul(x, w, bias, e, ec_mode=2, v=v, config=config, act=act, pdl=pdl)
        if isinstance(config, GluonConfig):  # so does the Gluon GEMM's
            from spear.kernels.gluon_w4 import gluon_w4a16

            return gluon_w4a16(x, w, bias, config, act=act, ec=e, v=v)
        y = ec_kernels.ec_up(_w4_part(x, w, bias, config, pdl), v, e)
        return fused.silu_mul_pairs(y) if act else y
    join = _beside(x.device, gate)
    out = _w4_part(x, w, bias, config, pdl)
    join()  # before v is read
    y = ec_kernels.ec_up(out, v, e)
    return fused.silu_mul_pairs(y) if act else y


def w4a16_ec_impl(x: torch.Tensor, w: PackedW4, bias: Optional[torch.Tensor], e: Optional[PackedEC], act: int,
                  s, pdl: int) -> torch.Tensor:
    """The op's body: ``s`` the decoded policy (``policy.settings``)."""
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
        return (reference.silu_mul_pairs(y) if act else y).to(x.dtype).reshape(*lead, n_out)
    p = _plan(m, n, k, w.group_size, w.layout, 0 if e is None else e.a.shape[0], s, cuda=True,
              gluon=w.layout == "mma" and gluon_available(x.device))
    if p.path in ("gemm", "dequant_cublas", "gluon"):
        y = _w4_part(x2, w, bias, p.config, pdl, act)
    elif p.path == "fused_ec":
        y = w4a16_matmul(x2, w, bias, e, ec_mode=1, config=p.config, act=act, pdl=pdl,
                         u_split_max=s.u_split_max)
    else:
        eager = type(x) is torch.Tensor and not torch.compiler.is_compiling()
        y = _semi_fused(x2, w, bias, e, p.config, s.semi_fused_overlap and eager, s.gate_programs, pdl, act)
    return y.reshape(*lead, n_out)


def _weight(qweight, scales, zeros, locks, group_size: int, symmetric: bool, layout: int) -> PackedW4:
    """The op's weight arguments as a PackedW4 (``layout``: an index into layout.LAYOUTS)."""
    if not 0 <= layout < len(LAYOUTS):
        raise ValueError(f"layout must index {LAYOUTS}; got {layout}")
    return PackedW4(qweight, scales, zeros, locks, group_size, symmetric, LAYOUTS[layout])


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
    return w4a16_ec_impl(x, w, bias, e, act, settings(policy), pdl)


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
    return w4a16_ec_impl(x, w, bias, ec, act, policy.settings, pdl)
