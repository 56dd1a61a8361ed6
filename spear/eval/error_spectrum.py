"""How much of a linear's quantization error a low-rank term can hold, and how much one holds.

With E = W − Ŵ (out, in) and s the RMS of each input channel (√E[x²]), the error's mean square
effect on the outputs is ‖E·diag(s)‖²_F when the channels are uncorrelated: the activation-weighted
error energy, Σ σ_k² over the singular values of E·diag(s). A rank-r term removes at most the top-r
share Σ_{k≤r} σ_k² / Σ σ_k² of it (Eckart–Young); a compensator whose product is C = α·B·A removes
1 − ‖(E − C)·diag(s)‖² / ‖E·diag(s)‖², which a KL-trained one need not maximise (it minimises the
output KL, not this energy). A flat spectrum (the energy spread over many directions, like
independent rounding noise) is what a rank-1 or rank-2 term cannot hold.
"""

from __future__ import annotations

import torch


def weighted_spectrum(error: torch.Tensor, rms: torch.Tensor) -> torch.Tensor:
    """Singular values (descending, float64) of ``error`` (out, in) with its columns scaled by ``rms`` (in,)."""
    m = error.double() * rms.double()[None, :]
    small = m @ m.T if m.shape[0] <= m.shape[1] else m.T @ m  # the smaller Gram matrix: same nonzero spectrum
    return torch.linalg.eigvalsh(small).clamp(min=0).flip(0).sqrt()


def top_share(spectrum: torch.Tensor, rank: int) -> float:
    """The share of the energy (Σ σ²) in the top ``rank`` singular values."""
    e = spectrum.double() ** 2
    total = float(e.sum())
    return float(e[:rank].sum()) / total if total > 0 else 0.0


def captured(error: torch.Tensor, rms: torch.Tensor, correction: torch.Tensor) -> float:
    """1 − ‖(error − correction)·diag(rms)‖² / ‖error·diag(rms)‖²: the share of the weighted error energy
    that ``correction`` (out, in) removes (negative if it adds error)."""
    s = rms.double()[None, :]
    e = error.double() * s
    total = float((e * e).sum())
    if total == 0:
        return 0.0
    r = e - correction.double() * s
    return 1.0 - float((r * r).sum()) / total
