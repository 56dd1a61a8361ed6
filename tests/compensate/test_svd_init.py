import pytest
import torch

from spear.compensate.stats import ActivationStats
from spear.compensate.svd_init import low_rank_factors, scaling_for


def _weighted_err(e, a, b, x):
    """Mean squared output error of the residual on inputs x (n, in)."""
    return float(((x.double() @ (e.double() - b @ a).T) ** 2).sum(1).mean())


def _stats(x: torch.Tensor, outer=True) -> ActivationStats:
    x = x.double()
    return ActivationStats(x.shape[0], x.abs().sum(0), (x * x).sum(0), x.T @ x if outer else None)


def test_identity_is_eckart_young_optimal():
    torch.manual_seed(0)
    e = torch.randn(40, 30, dtype=torch.float64)
    a, b = low_rank_factors(e, 5)
    assert a.shape == (5, 30) and b.shape == (40, 5)
    s = torch.linalg.svdvals(e)
    assert torch.isclose(torch.linalg.norm(e - b @ a), s[5:].norm(), rtol=1e-10)


def test_full_rank_reconstructs_exactly():
    torch.manual_seed(1)
    e = torch.randn(12, 9, dtype=torch.float64)
    for scale in (None, torch.rand(9, dtype=torch.float64) + 0.1):
        a, b = low_rank_factors(e, 9, scale)
        assert torch.allclose(b @ a, e, atol=1e-10)


def test_diagonal_scaling_is_optimal_for_its_weighted_norm():
    torch.manual_seed(2)
    e = torch.randn(32, 24, dtype=torch.float64)
    d = torch.rand(24, dtype=torch.float64) * 10 + 0.01
    a, b = low_rank_factors(e, 4, d)
    # ||(E - BA) diag(d)|| equals the trailing singular values of E diag(d).
    trailing = torch.linalg.svdvals(e * d)[4:].norm()
    assert torch.isclose(torch.linalg.norm((e - b @ a) * d), trailing, rtol=1e-10)


def test_exact_scaling_beats_diagonal_and_identity_on_correlated_inputs():
    torch.manual_seed(3)
    n, d_in = 4000, 24
    mix = torch.randn(d_in, d_in, dtype=torch.float64)
    x = torch.randn(n, d_in, dtype=torch.float64) @ mix * (torch.rand(d_in, dtype=torch.float64) * 5)
    e = torch.randn(16, d_in, dtype=torch.float64)
    st = _stats(x)
    errs = {}
    for method in ("identity", "qera-approx", "qera-exact"):
        a, b = low_rank_factors(e, 3, scaling_for(method, st, damp=0.0))
        errs[method] = _weighted_err(e, a, b, x)
    assert errs["qera-exact"] < errs["qera-approx"]
    assert errs["qera-exact"] < errs["identity"]
    # QERA-exact is optimal for E||(E - BA) x||²: no random rank-3 pair beats it.
    for _ in range(20):
        a, b = torch.randn(3, d_in, dtype=torch.float64), torch.randn(16, 3, dtype=torch.float64)
        assert _weighted_err(e, a, b, x) > errs["qera-exact"]


def test_lqer_scaling_is_normalized_mean_abs():
    x = torch.tensor([[1.0, -4.0, 0.5], [3.0, 4.0, -0.5]])
    s = scaling_for("lqer", _stats(x, outer=False))
    m = torch.tensor([2.0, 4.0, 0.5], dtype=torch.float64)
    assert torch.allclose(s, m / torch.sqrt(m.min() * m.max()))


def test_errors():
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="rank must be"):
        low_rank_factors(torch.randn(4, 3), 4)
    with pytest.raises(ValueError, match="positive"):
        low_rank_factors(torch.randn(4, 3), 1, torch.tensor([1.0, 0.0, 1.0]))
    with pytest.raises(ValueError, match="needs activation statistics"):
        scaling_for("lqer", None)
    with pytest.raises(FloatingPointError):
        low_rank_factors(torch.tensor([[float("nan"), 1.0], [1.0, 1.0]]), 1)
