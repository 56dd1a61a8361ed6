"""The static low-rank compensator ``x -> B (A x)``."""

from __future__ import annotations

import torch
from torch import nn


class LowRankCompensator(nn.Module):
    """Adds ``B·(A·x)`` to a quantized linear's output. A: (r, in), B: (out, r)."""

    kind = "lowrank"

    def __init__(self, A: torch.Tensor, B: torch.Tensor):
        super().__init__()
        if A.dim() != 2 or B.dim() != 2 or A.shape[0] != B.shape[1]:
            raise ValueError(f"A (r, in) and B (out, r) must share r; got {tuple(A.shape)} and {tuple(B.shape)}")
        self.A = nn.Parameter(A)
        self.B = nn.Parameter(B)

    @classmethod
    def empty(cls, in_features: int, out_features: int, rank: int, device=None, dtype=None) -> "LowRankCompensator":
        """An uninitialised shell of the right shapes (checkpoint loading fills it)."""
        return cls(torch.empty(rank, in_features, device=device, dtype=dtype),
                   torch.empty(out_features, rank, device=device, dtype=dtype))

    def spec(self) -> dict:
        """What a checkpoint records to rebuild this module before loading its tensors."""
        return {"rank": self.rank}

    @property
    def rank(self) -> int:
        return self.A.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(nn.functional.linear(x, self.A.to(x.dtype)), self.B.to(x.dtype))

    def extra_repr(self) -> str:
        return f"rank={self.rank}"
