"""Linear centered kernel alignment (Kornblith et al., 2019).

    CKA(X, Y) = ‖Yᶜᵀ Xᶜ‖²_F / (‖Xᶜᵀ Xᶜ‖_F · ‖Yᶜᵀ Yᶜ‖_F),   Xᶜ = X − mean over rows

for representations X (n, d1) and Y (n, d2) of the same n tokens. It is 1 for identical
representations and invariant to orthogonal transforms and isotropic scaling of either.
Computed in float64 through the d×d cross-products (n ≫ d here), not the n×n Gram matrices.
"""

from __future__ import annotations

import torch


def linear_cka(x: torch.Tensor, y: torch.Tensor) -> float:
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0]:
        raise ValueError(f"CKA needs (n, d) representations of the same n tokens; got {tuple(x.shape)} and "
                         f"{tuple(y.shape)}")
    x = x.double()
    y = y.double()
    x = x - x.mean(0, keepdim=True)
    y = y - y.mean(0, keepdim=True)
    cross = torch.linalg.matrix_norm(y.T @ x) ** 2
    norm = torch.linalg.matrix_norm(x.T @ x) * torch.linalg.matrix_norm(y.T @ y)
    if norm == 0:
        raise ValueError("CKA is undefined for a constant representation")
    return float(cross / norm)
