"""The error-spectrum measures against torch's SVD and the Eckart–Young bound."""

import pytest
import torch

from spear.eval.error_spectrum import captured, top_share, weighted_spectrum


def test_spectrum_and_shares_against_the_svd():
    """Both orientations (wide and tall errors) against ``torch.linalg.svdvals`` of the scaled error;
    the truncated SVD of E·diag(s), mapped back through diag(s)⁻¹, captures exactly the top-r share,
    and a random rank-r correction of the same size captures less.

    Catches: the scale applied to rows instead of columns (the tall case differs), or the share of
    σ instead of σ² (0.5 of a 3:1 spectrum instead of 0.9)."""
    g = torch.Generator().manual_seed(0)
    for out_f, in_f in ((12, 40), (40, 12)):
        e = torch.randn(out_f, in_f, generator=g, dtype=torch.float64)
        s = torch.rand(in_f, generator=g, dtype=torch.float64) * 3 + 0.1
        sv = weighted_spectrum(e, s)
        assert torch.allclose(sv, torch.linalg.svdvals(e * s[None, :]), rtol=1e-8)
        u, sig, vh = torch.linalg.svd(e * s[None, :], full_matrices=False)
        for r in (1, 3):
            best = (u[:, :r] * sig[:r]) @ vh[:r] / s[None, :]
            assert captured(e, s, best) == pytest.approx(top_share(sv, r), rel=1e-9)
            other = torch.randn(out_f, r, generator=g, dtype=torch.float64) @ torch.randn(r, in_f, generator=g,
                                                                                          dtype=torch.float64)
            assert captured(e, s, 0.01 * other) < top_share(sv, r)
    assert top_share(torch.tensor([3.0, 1.0]), 1) == pytest.approx(0.9)
    assert captured(e, s, e) == pytest.approx(1.0) and captured(e, s, torch.zeros_like(e)) == 0.0
