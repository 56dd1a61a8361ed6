"""Which kernel a W4 layer call runs: ``plan(tokens, n, k, rank, weight, device, policy)``.

One pure function answers for the op (ops.py, at every call), the engine's warm-up (which compiles
every plan a step can meet) and the engine's log. It asks the device itself whether it runs the
Gluon GEMM (``target``: a Hopper GPU and a Triton with Gluon), so no caller carries that along.

A plan, on CUDA (elsewhere the fp32 torch reference runs the whole layer):

  kernel   the W4 product: TRITON (w4a16.py, over either layout), GLUON (gluon_w4.py: the fragment
           layout on Hopper, for the token classes of the table's "gluon" / "gluon_wide"), CUBLAS
           (dequantize, then cuBLAS: from the layout's ``*_cublas_min_m`` tokens on)
  config   its launch (launch.TritonConfig, launch.GluonConfig; None for cuBLAS)
  ec       a compensator (``rank`` > 0, the padded rank the kernels see): FUSED into the Triton
           GEMM up to ``fused_max_m`` tokens (u = A x, the gate and alpha B v in one launch), or
           SEMI above: ec_gate, its K split in ``gate_splits``, beside or before the W4 part, then
           alpha v Bᵀ in that kernel's epilogue or by ec_up
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from functools import lru_cache

import torch

from spear.kernels.launch import GluonConfig, TritonConfig, pick_gluon, pick_triton
from spear.kernels.layout import Layout, WeightFormat
from spear.kernels.policy import KernelPolicy


class Kernel(enum.Enum):
    """The function that computes a call's W4 product (ops.py maps each to it)."""

    REFERENCE = "reference"  # reference.w4a16_ec_packed, off CUDA
    TRITON = "triton"        # w4a16.w4a16_matmul
    GLUON = "gluon"          # gluon_w4.gluon_w4a16
    CUBLAS = "cublas"        # dequant.dequantize, then cuBLAS


class EC(enum.Enum):
    """How a call's compensator runs."""

    NONE = "none"
    FUSED = "fused"
    SEMI = "semi-fused"


@dataclass(frozen=True)
class Plan:
    kernel: Kernel
    config: TritonConfig | GluonConfig | None
    ec: EC = EC.NONE
    gate_splits: int = 0  # SEMI: ec_gate's K splits

    @property
    def label(self) -> str:
        return self.kernel.value + ("" if self.ec is EC.NONE else f", {self.ec.value} EC")

    def __str__(self) -> str:
        return self.label + ("" if self.config is None else f" ({self.config})")


@dataclass(frozen=True)
class Target:
    """What the planner needs to know of a device."""

    cuda: bool
    gluon: bool  # runs the Gluon GEMM


@lru_cache(maxsize=16)
def capability(device: torch.device) -> tuple[int, int] | None:
    """The CUDA compute capability of ``device``; None off CUDA."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


@lru_cache(maxsize=1)
def _have_gluon() -> bool:
    from spear.kernels.gluon_w4 import HAVE_GLUON

    return HAVE_GLUON


def target(device: torch.device) -> Target:
    """``device`` as the planner sees it: CUDA, and whether it runs the Gluon GEMM (sm_90, Gluon)."""
    cap = capability(torch.device(device))
    return Target(cap is not None, cap == (9, 0) and _have_gluon())


def plan(tokens: int, n: int, k: int, rank: int, weight: WeightFormat, device: torch.device,
         policy: KernelPolicy) -> Plan:
    """The kernel, launch and compensator form of a W4 call of ``tokens`` rows over an (n, k) weight
    of ``weight``'s format, with a compensator of padded ``rank`` (0: none), on ``device`` under
    ``policy`` (module docstring)."""
    return _plan(tokens, n, k, rank, weight, target(device), policy)


@lru_cache(maxsize=4096)
def _plan(tokens: int, n: int, k: int, rank: int, weight: WeightFormat, t: Target, policy: KernelPolicy) -> Plan:
    if not t.cuda:
        return Plan(Kernel.REFERENCE, None, EC.FUSED if rank else EC.NONE)
    fragment = weight.layout is Layout.FRAGMENT
    table = policy.launch_table
    cublas_from = policy.fragment_cublas_min_m if fragment else policy.nmajor_cublas_min_m
    gluon = pick_gluon(tokens, n, k, table, weight.group_size, rank) if fragment and t.gluon and policy.gluon \
        else None
    if gluon is not None:
        kernel, config = Kernel.GLUON, gluon
    elif not cublas_from or tokens < cublas_from:
        kernel, config = Kernel.TRITON, pick_triton(tokens, n, k, fragment, weight.group_size, table)
    else:
        kernel, config = Kernel.CUBLAS, None
    if rank == 0:
        return Plan(kernel, config)
    if tokens <= policy.fused_max_m:  # the Triton GEMM's fused compensator, whatever the W4 part would be
        c = pick_triton(tokens, n, k, fragment, weight.group_size, table)
        return Plan(Kernel.TRITON, replace(c, u_split=c.u_split or policy.u_split_max), EC.FUSED)
    from spear.kernels.ec import gate_splits

    return Plan(kernel, config, EC.SEMI, gate_splits(tokens, k, policy.gate_programs))


DESCRIBED_TOKENS = (1, 2, 4, 16, 32, 64, 96, 128, 256, 512, 1024, 4096)


def describe(n: int, k: int, rank: int, weight: WeightFormat, device: torch.device, policy: KernelPolicy,
             tokens=DESCRIBED_TOKENS) -> str:
    """One phrase per run of token counts that share a kernel and compensator form, e.g. for the
    engine's log and ``spear tune-kernels``."""
    runs: list[list] = []
    for m in tokens:
        label = plan(m, n, k, rank, weight, device, policy).label
        if runs and runs[-1][2] == label:
            runs[-1][1] = m
        else:
            runs.append([m, m, label])
    return "; ".join(f"{a}-{b} tokens: {label}" if a != b else f"{a} tokens: {label}" for a, b, label in runs)
