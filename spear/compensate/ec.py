"""SPEAR's token-gated low-rank error compensator (EC).

    y = Wq·x + α · B · ( γ(A·x) ⊙ (A·x) )

A: (r, in), B: (out, r), α a learnable scalar, and γ a bottleneck MLP r → h → r
whose output gates each rank component per token:

    u = A·x
    γ(u) = 1 + bound · tanh( W2 · silu( W1 · (u ⊙ s) + b1 ) + b2 )

``s`` is a fixed per-rank input normalisation (1 / RMS of u on calibration data,
a buffer) so that the gate sees unit-scale inputs whatever the module; it folds
into W1 for deployment (see :meth:`GatedCompensator.export_gate`). The output is
bounded in (1 - bound, 1 + bound). W2 and b2 start at zero, so γ ≡ 1 and the EC
starts as the static low-rank solution it is initialised from. ``gated=False`` is
the static low-rank special case (γ ≡ 1) with the same A, B, α.

``per_rank=False`` gates the whole module with one γ per token (W2: 1 × h, b2: 1);
it exports to the kernel's per-rank form by repeating that row r times.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class GatedCompensator(nn.Module):
    kind = "spear-ec"

    def __init__(self, A: torch.Tensor, B: torch.Tensor, hidden: int = 8, gated: bool = True,
                 bound: float = 1.0, alpha: float = 1.0, seed: int = 0, per_rank: bool = True):
        super().__init__()
        if A.dim() != 2 or B.dim() != 2 or A.shape[0] != B.shape[1]:
            raise ValueError(f"A (r, in) and B (out, r) must share r; got {tuple(A.shape)} and {tuple(B.shape)}")
        if gated and hidden < 1:
            raise ValueError(f"a gated EC needs hidden >= 1, got {hidden}")
        if not 0 < bound <= 1:
            raise ValueError(f"gate bound must be in (0, 1] so that γ stays positive, got {bound}")
        r = A.shape[0]
        self.gated, self.hidden, self.bound = gated, hidden if gated else 0, float(bound)
        self.per_rank = bool(per_rank) if gated else True
        self.A = nn.Parameter(A)
        self.B = nn.Parameter(B)
        self.alpha = nn.Parameter(torch.tensor(float(alpha), dtype=A.dtype, device=A.device))
        if gated:
            gen = torch.Generator().manual_seed(seed)
            w1 = torch.randn(hidden, r, generator=gen) / math.sqrt(r)
            self.w1 = nn.Parameter(w1.to(A.device, A.dtype))
            self.b1 = nn.Parameter(torch.zeros(hidden, dtype=A.dtype, device=A.device))
            g = r if self.per_rank else 1
            self.w2 = nn.Parameter(torch.zeros(g, hidden, dtype=A.dtype, device=A.device))
            self.b2 = nn.Parameter(torch.zeros(g, dtype=A.dtype, device=A.device))
            self.register_buffer("u_scale", torch.ones(r, dtype=A.dtype, device=A.device))

    @classmethod
    def empty(cls, in_features: int, out_features: int, rank: int, hidden: int = 8, gated: bool = True,
              bound: float = 1.0, per_rank: bool = True, device=None, dtype=None) -> "GatedCompensator":
        a = torch.zeros(rank, in_features, device="cpu", dtype=dtype)
        b = torch.zeros(out_features, rank, device="cpu", dtype=dtype)
        return cls(a, b, hidden=hidden, gated=gated, bound=bound, per_rank=per_rank).to(device)

    def spec(self) -> dict:
        out = {"rank": self.rank, "hidden": self.hidden, "gated": self.gated, "bound": self.bound}
        if not self.per_rank:
            out["per_rank"] = False
        return out

    @property
    def rank(self) -> int:
        return self.A.shape[0]

    def gate(self, u: torch.Tensor) -> torch.Tensor:
        """γ(u) for projected inputs u (..., r); ones when ungated."""
        if not self.gated:
            return torch.ones_like(u)
        dt = u.dtype
        h = nn.functional.silu(nn.functional.linear(u * self.u_scale.to(dt), self.w1.to(dt), self.b1.to(dt)))
        return 1 + self.bound * torch.tanh(nn.functional.linear(h, self.w2.to(dt), self.b2.to(dt)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        u = nn.functional.linear(x, self.A.to(dt))
        if self.gated:
            u = u * self.gate(u)
        return self.alpha.to(dt) * nn.functional.linear(u, self.B.to(dt))

    @torch.no_grad()
    def set_input_scale(self, u_rms: torch.Tensor) -> None:
        """Normalise the gate's input by the RMS of u measured on calibration data."""
        if self.gated:
            self.u_scale.copy_(1.0 / u_rms.clamp(min=1e-8).to(self.u_scale))

    @torch.no_grad()
    def balance_(self) -> None:
        """Rescale each rank component so that ‖A_i‖ = ‖B_i‖, leaving the function unchanged:
        u_i grows by c_i, the gate's input scale shrinks by c_i (γ sees the same input) and
        B_i shrinks by c_i. Done before rounding to fp16 so neither factor holds the whole range."""
        from spear.compensate.svd_init import balance

        a, b = balance(self.A.double(), self.B.double())
        if self.gated:
            c = a.norm(dim=1) / self.A.double().norm(dim=1).clamp(min=1e-300)
            self.u_scale.copy_((self.u_scale.double() / torch.where(c > 0, c, torch.ones_like(c))).to(self.u_scale))
        self.A.copy_(a.to(self.A))
        self.B.copy_(b.to(self.B))

    @torch.no_grad()
    def export_gate(self) -> dict[str, torch.Tensor | float]:
        """Gate weights in the kernel's form (input scale folded into W1; α and bound as floats)."""
        out = {"A": self.A.detach(), "B": self.B.detach(), "alpha": float(self.alpha), "bound": self.bound}
        if self.gated:
            reps = 1 if self.per_rank else self.rank
            out.update(w1=(self.w1 * self.u_scale[None, :]).detach(), b1=self.b1.detach(),
                       w2=self.w2.detach().repeat(reps, 1), b2=self.b2.detach().repeat(reps))
        return out

    def extra_repr(self) -> str:
        mode = "" if self.per_rank else ", one γ per module"
        return f"rank={self.rank}, " + (f"gate hidden={self.hidden}, bound={self.bound}{mode}" if self.gated else "ungated")
