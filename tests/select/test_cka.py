import pytest
import torch

from spear.select.cka import linear_cka


def test_identical_representations_have_cka_one():
    x = torch.randn(200, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert linear_cka(x, x) == pytest.approx(1.0, abs=1e-12)


def test_invariant_to_orthogonal_transform_and_isotropic_scaling():
    torch.manual_seed(0)
    x = torch.randn(300, 12, dtype=torch.float64)
    y = x + 0.5 * torch.randn_like(x)
    q, _ = torch.linalg.qr(torch.randn(12, 12, dtype=torch.float64))
    ref = linear_cka(x, y)
    assert 0.5 < ref < 1.0
    assert linear_cka(x @ q, y) == pytest.approx(ref, rel=1e-10)
    assert linear_cka(x, 7.5 * y) == pytest.approx(ref, rel=1e-10)
    assert linear_cka(3 * x @ q, y @ q.T) == pytest.approx(ref, rel=1e-10)


def test_matches_the_gram_matrix_definition():
    torch.manual_seed(1)
    x, y = torch.randn(50, 6, dtype=torch.float64), torch.randn(50, 9, dtype=torch.float64)
    h = torch.eye(50, dtype=torch.float64) - 1.0 / 50

    def hsic(k, l):
        return torch.trace(k @ h @ l @ h)

    k, l = x @ x.T, y @ y.T
    ref = hsic(k, l) / torch.sqrt(hsic(k, k) * hsic(l, l))
    assert linear_cka(x, y) == pytest.approx(float(ref), rel=1e-10)


def test_unrelated_representations_score_low_and_bad_shapes_raise():
    torch.manual_seed(2)
    x, y = torch.randn(4000, 4, dtype=torch.float64), torch.randn(4000, 4, dtype=torch.float64)
    assert linear_cka(x, y) < 0.01
    with pytest.raises(ValueError, match="same n"):
        linear_cka(x, y[:10])
    with pytest.raises(ValueError, match="constant"):
        linear_cka(torch.ones(5, 3), y[:5])
