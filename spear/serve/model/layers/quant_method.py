"""How a linear layer computes: three quant-method objects with one interface, the shape of vLLM's
``LinearMethodBase`` (weights created and processed once at load, then ``apply`` at every forward).
The serving engine's ``Linear`` (linear.py) holds one, and so does the vLLM plugin's
(spear/vllm_plugin/linear_method.py): one pack, one compensator merge, one forward for both.

  W4Method     CUDA, fp16/bf16: the 4-bit codes packed once for the W4 kernels (spear/kernels/layout.py:
               the fragment layout, N-major where the shape refuses it) with the compensator beside
               them; ``apply`` is one ``w4a16_linear`` call, whose kernel the planner picks under the
               context's policy. act 1: SiLU·mul of interleaved (gate, up) features in the GEMM's epilogue.
  W8Method     CUDA: an 8-bit per-channel symmetric weight without compensator (an 8-bit output head).
  DenseMethod  anywhere: the weight dequantized once and rounded to the compute dtype (as QuantLinear
               does), the compensator in torch.

    method = W4Method.create(...)          # at load: pack (create_weights + process_weights_after_loading)
    y = method.apply(x, bias, ctx, act)    # every forward
    method.kernels(tokens, device, policy) # what a step of ``tokens`` tokens compiles (the warm-up)
    method.launch(tokens, bias, act, ...)  # W4: that call's form, for the parallel compile pass
    method.describe(device, policy)        # the engine's log line (None where no W4 kernel runs)
    method.row_post(n, bias)               # row-parallel: what follows the ranks' sum (spear/parallel/comm.py)

``merge_factors`` is the one merge of several members' compensators into the one a merged layer
(q/k/v, gate/up) runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from spear.compensate.spec import ECFactors
from spear.errors import SpearError


def merge_factors(ecs: list[ECFactors | None], outs: list[int], in_features: int) -> ECFactors | None:
    """One compensator equal to the members' side by side: A stacked, alpha · B and the gate MLPs
    block-diagonal (zero blocks add exact zeros); None if no member has one. Gated members'
    bounds must agree (one scalar of the kernel)."""
    if all(e is None for e in ecs):
        return None
    ranks = [0 if e is None else e.rank for e in ecs]
    hidden = [0 if e is None else e.hidden for e in ecs]
    bounds = {e.bound for e in ecs if e is not None and e.gated}
    if len(bounds) > 1:
        raise SpearError(f"the merged members' gates have different bounds {sorted(bounds)}")
    r, h = sum(ranks), sum(hidden)
    a, b = torch.zeros(r, in_features), torch.zeros(sum(outs), r)
    gated = h > 0
    w1, b1, w2, b2 = torch.zeros(h, r), torch.zeros(h), torch.zeros(r, h), torch.zeros(r)
    ro = ho = no = 0
    for e, ri, hi, n in zip(ecs, ranks, hidden, outs):
        if e is not None:
            a[ro:ro + ri] = e.a
            b[no:no + n, ro:ro + ri] = e.alpha * e.b
            if hi:
                w1[ho:ho + hi, ro:ro + ri] = e.w1
                b1[ho:ho + hi] = e.b1
                w2[ro:ro + ri, ho:ho + hi] = e.w2
                b2[ro:ro + ri] = e.b2
        ro, ho, no = ro + ri, ho + hi, no + n
    if not gated:
        return ECFactors(a, b)
    return ECFactors(a, b, 1.0, w1, b1, w2, b2, bound=bounds.pop())


class W4Method:
    """4-bit codes in a W4 kernel layout and the compensator packed beside them (module docstring)."""

    name = "w4"
    fuses_silu_mul = True  # act 1: SiLU·mul of interleaved (gate, up) pairs in the GEMM's epilogue

    def __init__(self, packed, ec=None):
        self.packed = packed  # spear.kernels.layout.PackedW4
        self.ec = ec          # spear.kernels.layout.PackedEC or None

    @classmethod
    def create(cls, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int, symmetric: bool,
               ec: ECFactors | None, dtype: torch.dtype, device: torch.device) -> "W4Method":
        """Pack once on ``device``; a ValueError names a constraint of the kernel layouts."""
        from spear.kernels.layout import pack, pack_ec

        packed = pack(codes.to(device), scales.to(device), zeros.to(device), group_size, symmetric)
        if ec is None:
            return cls(packed)
        gate = dict(w1=ec.w1.to(device), b1=ec.b1.to(device), w2=ec.w2.to(device), b2=ec.b2.to(device),
                    bound=ec.bound) if ec.gated else {}
        return cls(packed, pack_ec(ec.a.to(device), ec.b.to(device), ec.alpha, dtype, **gate))

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None, ctx, act: int = 0) -> torch.Tensor:
        from spear.kernels.ops import w4a16_linear

        return w4a16_linear(x, self.packed, bias, self.ec, act, ctx.policy, ctx.pdl)

    @property
    def key(self) -> tuple:
        """What the planner reads of this layer: (n, k, the compensator's kernel rank, the weight's format)."""
        w = self.packed
        return (w.out_features, w.in_features, 0 if self.ec is None else self.ec.kernel_rank, w.format)

    def plan(self, tokens: int, device: torch.device, policy):
        from spear.kernels.planner import plan

        n, k, rank, fmt = self.key
        return plan(tokens, n, k, rank, fmt, device, policy)

    def kernels(self, tokens: int, device: torch.device, policy) -> tuple:
        return ((self.key, self.plan(tokens, device, policy)),)

    def launch(self, tokens: int, bias: bool, act: int, dtype: torch.dtype, pdl: int):
        """This layer's call at ``tokens`` tokens as a compile pass sees it (spear/kernels/precompile.py)."""
        from spear.kernels.precompile import W4Launch

        w, ec = self.packed, self.ec
        return W4Launch(w.out_features, w.in_features, w.group_size, w.symmetric, w.layout,
                        0 if ec is None else ec.kernel_rank, 0 if ec is None or not ec.gated else ec.w1.shape[0],
                        act, bias, dtype, tokens, pdl)

    def describe(self, device: torch.device, policy, tokens=None) -> str:
        from spear.kernels import planner

        n, k, rank, fmt = self.key
        runs = planner.describe(n, k, rank, fmt, device, policy, **({} if tokens is None else {"tokens": tokens}))
        return f"W4 {n}x{k} ({fmt.layout.value}{', with EC' if rank else ''}): {runs}"

    def row_post(self, n: int, bias: torch.Tensor | None):
        """The ranks' sum's post step, which takes over a gated compensator (its u = A x stays local,
        summed with the output; an ungated one is linear and rides in the partials)."""
        from spear.parallel.comm import RowPost

        if self.ec is not None and self.ec.gated:
            post, self.ec = RowPost(n, bias, packed=self.ec), None
            return post
        return RowPost(n, bias)


class W8Method:
    """An 8-bit per-channel symmetric weight for the W8A16 kernel."""

    name = "w8"
    fuses_silu_mul = False

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor):
        self.qweight, self.scale = qweight, scale

    @staticmethod
    def takes(q, ec: ECFactors | None) -> bool:
        """Whether the kernel takes a member's quantized weight (``QuantTensors``) and compensator."""
        from spear.kernels.w8a16 import K_STEP

        return (q is not None and ec is None and q.bits == 8 and q.group_size == 0 and q.symmetric
                and q.codes.shape[1] % K_STEP == 0)

    @classmethod
    def create(cls, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, device: torch.device) -> "W8Method":
        from spear.kernels.w8a16 import pack_w8

        return cls(*(t.to(device) for t in pack_w8(codes, scales, zeros)))

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None, ctx, act: int = 0) -> torch.Tensor:
        from spear.kernels.w8a16 import w8a16_linear

        return w8a16_linear(x, self.qweight, self.scale, bias, ctx.pdl)

    def kernels(self, tokens: int, device: torch.device, policy) -> tuple:
        from spear.kernels.w8a16 import pick_config

        return ((("w8", *self.qweight.shape), tuple(sorted(pick_config(tokens).items()))),)

    def describe(self, device: torch.device, policy, tokens=None) -> None:
        return None

    def row_post(self, n: int, bias: torch.Tensor | None):
        from spear.parallel.comm import RowPost

        return RowPost(n, bias)


@dataclass
class DenseEC:
    """A compensator in torch form: B with alpha folded in, ``gate`` its four tensors or None."""

    a: torch.Tensor
    b: torch.Tensor
    gate: tuple[torch.Tensor, ...] | None
    bound: float

    @classmethod
    def of(cls, ec: ECFactors, dtype: torch.dtype, device: torch.device) -> "DenseEC":
        cast = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
        gate = tuple(map(cast, (ec.w1, ec.b1, ec.w2, ec.b2))) if ec.gated else None
        return cls(cast(ec.a), cast(ec.alpha * ec.b), gate, ec.bound)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """alpha · B (gamma(u) ⊙ u), u = A x, in x's dtype (the compensator modules' own math)."""
        u = nn.functional.linear(x, self.a)
        if self.gate is not None:
            w1, b1, w2, b2 = self.gate
            h = nn.functional.silu(nn.functional.linear(u, w1, b1))
            u = u * (1 + self.bound * torch.tanh(nn.functional.linear(h, w2, b2)))
        return nn.functional.linear(u, self.b)


class DenseMethod:
    """A weight in the compute dtype, its compensator in torch: the CPU, unquantized checkpoints, and
    quantized layers the kernels do not take."""

    name = "dense"
    fuses_silu_mul = False

    def __init__(self, weight: torch.Tensor, ec: DenseEC | None = None):
        self.weight, self.ec = weight, ec

    @classmethod
    def create(cls, weight: torch.Tensor, ec: ECFactors | None, dtype: torch.dtype,
               device: torch.device) -> "DenseMethod":
        return cls(weight.to(device=device, dtype=dtype), None if ec is None else DenseEC.of(ec, dtype, device))

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None, ctx, act: int = 0) -> torch.Tensor:
        y = nn.functional.linear(x, self.weight, bias)
        return y if self.ec is None else y + self.ec(x)

    def kernels(self, tokens: int, device: torch.device, policy) -> tuple:
        return ()

    def describe(self, device: torch.device, policy, tokens=None) -> None:
        return None

    def row_post(self, n: int, bias: torch.Tensor | None):
        from spear.parallel.comm import RowPost

        if self.ec is not None and self.ec.gate is not None:
            post, self.ec = RowPost(n, bias, dense=self.ec), None
            return post
        return RowPost(n, bias)
