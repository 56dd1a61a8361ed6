import pytest
import torch

from spear.config import QuantConfig
from spear.errors import SpearError
from spear.quant.linear import QuantLinear
from spear.quant.primitives import (compute_qparams, dequantize, fake_quantize, n_groups, pack_codes, quantize,
                                    rtn, unpack_codes)
from spear.quant.rtn import rtn_quantize_linear
from tests.conftest import sqnr_db


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group_size", [0, 16, 32])
@pytest.mark.parametrize("symmetric", [True, False])
def test_rtn_error_within_half_step(bits, group_size, symmetric):
    """Every weight within half a step, and the grid spans each group's range exactly: symmetric
    uses the codes zero ± (2^(b-1) − 1) with the group's largest |w| on the outermost one (the
    code 0, i.e. −2^(b-1), stays unused so the grid is symmetric about 0); asymmetric uses both ends
    0 and 2^b − 1.

    Catches: ``scales = (wmax - wmin) / (qmax - 1)`` (asymmetric) or ``amax / (half - 2)``
    (symmetric, 3-8 bits) in ``compute_qparams``: coarser grids that still keep every error within
    half of their own step, which the old check (the same bound in both branches) passed."""
    torch.manual_seed(bits * 100 + group_size)
    w = torch.randn(24, 96)
    codes, scales, zeros = rtn(w, bits, group_size, symmetric)
    assert codes.dtype == torch.uint8 and int(codes.max()) < 2**bits
    assert scales.shape == zeros.shape == (24, n_groups(96, group_size))
    w_hat = dequantize(codes, scales, zeros, group_size)
    step = scales.repeat_interleave(96 // scales.shape[1], dim=1)
    assert ((w - w_hat).abs() <= step / 2 + 1e-6).all()
    g = scales.shape[1]
    cg = codes.reshape(24, g, -1).long()
    if symmetric:
        half = 2 ** (bits - 1)
        assert (zeros == half).all() and int(cg.min()) >= 1
        assert ((cg - half).abs().amax(-1) == half - 1).all()
    else:
        assert (cg.amin(-1) == 0).all() and (cg.amax(-1) == 2**bits - 1).all()


@pytest.mark.parametrize("bits,floor", [(8, 40.0), (4, 18.0), (3, 12.0)])
def test_sqnr_floor(bits, floor):
    torch.manual_seed(0)
    w = torch.randn(64, 128)
    assert sqnr_db(w, fake_quantize(w, bits, 32, True)) > floor


def test_symmetric_keeps_zero_exact_and_midpoint_zero():
    w = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    w[:, 5] = 0.0
    codes, scales, zeros = rtn(w, 4, 0, True)
    assert (zeros == 8).all()
    assert (dequantize(codes, scales, zeros, 0)[:, 5] == 0).all()


def test_asymmetric_reproduces_grid_weights_exactly():
    # Weights already on an asymmetric 4-bit grid with integer zero points round-trip exactly.
    torch.manual_seed(1)
    codes = torch.randint(0, 16, (16, 64), dtype=torch.uint8)
    codes[:, ::32] = 0
    codes[:, 1::32] = 15
    scales = torch.rand(16, 2) + 0.5
    zeros = torch.randint(1, 15, (16, 2), dtype=torch.uint8)
    w = dequantize(codes, scales, zeros, 32)
    c2, s2, z2 = rtn(w, 4, 32, False)
    assert torch.allclose(dequantize(c2, s2, z2, 32), w, atol=1e-5)


def test_group_size_must_divide():
    with pytest.raises(SpearError, match="group size 100 does not divide in_features=576"):
        n_groups(576, 100)
    with pytest.raises(SpearError):
        compute_qparams(torch.ones(4, 100), 4, 64, True)


def test_config_validation():
    with pytest.raises(SpearError, match="bits"):
        QuantConfig(bits=5)
    with pytest.raises(SpearError, match="group_size"):
        QuantConfig(group_size=-1)
    assert QuantConfig.from_dict(QuantConfig(bits=3, group_size=64).to_dict()) == QuantConfig(bits=3, group_size=64)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("in_features", [7, 64, 99])
def test_pack_roundtrip(bits, in_features):
    g = torch.Generator().manual_seed(bits * 1000 + in_features)
    codes = torch.randint(0, 2**bits, (5, in_features), dtype=torch.uint8, generator=g)
    packed = pack_codes(codes, bits)
    assert packed.shape == (5, (in_features * bits + 7) // 8)
    assert torch.equal(unpack_codes(packed, bits, in_features), codes)


def test_quantize_is_rounding_of_scaled_weights():
    w = torch.tensor([[0.0, 0.49, 0.51, -1.0, 7.0, -8.0, 100.0, -100.0]])
    scales = torch.ones(1, 1)
    zeros = torch.full((1, 1), 8, dtype=torch.uint8)
    assert quantize(w, scales, zeros, 4, 0).tolist() == [[8, 8, 9, 7, 15, 0, 15, 0]]


@pytest.mark.parametrize("group_size,symmetric", [(0, True), (16, False)])
def test_quant_linear_forward_matches_dequantized_matmul(group_size, symmetric):
    torch.manual_seed(2)
    lin = torch.nn.Linear(64, 32, bias=True)
    q = rtn_quantize_linear(lin, QuantConfig(bits=4, group_size=group_size, symmetric=symmetric))
    x = torch.randn(3, 5, 64)
    ref = x @ q.dequantized_weight().T + lin.bias
    assert torch.allclose(q(x), ref, atol=1e-5)
    assert sqnr_db(lin(x), q(x)) > 15
    # The stored scales are fp16 and the codes were rounded against them.
    assert q.scales.dtype == torch.float16


def test_quant_linear_adds_compensator():
    torch.manual_seed(3)
    lin = torch.nn.Linear(16, 8, bias=False)
    q = rtn_quantize_linear(lin, QuantConfig())
    x = torch.randn(4, 16)
    base = q(x)
    extra = torch.nn.Linear(16, 8, bias=False)
    q.compensator = extra
    assert torch.allclose(q(x), base + extra(x), atol=1e-6)
    assert isinstance(q, QuantLinear)
