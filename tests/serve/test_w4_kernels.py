"""The CUDA adapter's packing, checked on the CPU: ``w4a16_linear`` runs its torch reference there."""

import pytest
import torch

from spear.compensate.ec import GatedCompensator
from spear.compensate.lowrank import LowRankCompensator
from spear.config import QuantConfig
from spear.quant.rtn import rtn_quantize_linear
from spear.serve.w4_kernels import W4KernelLinear, packable, use_quant_kernels
from tests.conftest import sqnr_db


def quant_linear(group_size=0, bias=False, seed=0, in_features=128):
    torch.manual_seed(seed)
    lin = torch.nn.Linear(in_features, 96, bias=bias)
    return rtn_quantize_linear(lin, QuantConfig(bits=4, group_size=group_size))


def gated(rank=6, per_rank=True):
    g = torch.Generator().manual_seed(1)
    ec = GatedCompensator(torch.randn(rank, 128, generator=g) * 0.1, torch.randn(96, rank, generator=g) * 0.1,
                          hidden=5, alpha=0.7, bound=0.5, per_rank=per_rank)
    with torch.no_grad():
        ec.w2.normal_(0, 1.0, generator=g)
        ec.b2.normal_(0, 0.5, generator=g)
        ec.set_input_scale(torch.rand(rank, generator=g) + 0.5)
    return ec


@pytest.mark.parametrize("group_size,bias,comp", [
    (0, False, None), (32, True, None), (64, False, "lowrank"), (128, True, "gated"), (0, False, "gated-module"),
])
def test_packed_layer_matches_quantlinear(group_size, bias, comp):
    q = quant_linear(group_size, bias)
    if comp == "lowrank":
        g = torch.Generator().manual_seed(2)
        q.compensator = LowRankCompensator(torch.randn(4, 128, generator=g) * 0.1, torch.randn(96, 4, generator=g) * 0.1)
    elif comp is not None:
        q.compensator = gated(per_rank=comp == "gated")
    x = torch.randn(7, 128).half()
    ref = q(x.float())
    packed = W4KernelLinear(q, torch.float16)
    assert (packed.ec is not None) == (comp is not None) and packed.compensator is None
    out = packed(x)
    assert out.dtype == torch.float16 and out.shape == (7, 96)
    assert sqnr_db(ref, out.float()) > 40


@pytest.mark.parametrize("in_features,expect_kmajor", [(128, True), (96, False)])
def test_kmajor_packing(in_features, expect_kmajor):
    """K-major where K allows it (multiple of 128), else the N-major layout; same function."""
    q = quant_linear(32, bias=True, in_features=in_features)
    packed = W4KernelLinear(q, torch.float16, kmajor=True)
    assert packed.weight.kmajor == expect_kmajor
    x = torch.randn(5, in_features).half()
    assert sqnr_db(q(x.float()), packed(x).float()) > 40


class _Slice(torch.nn.Module):
    """A compensator kind the kernels do not know."""

    def forward(self, x):
        return 0.1 * x[..., :96]


def test_unknown_compensator_stays_a_module():
    q = quant_linear()
    q.compensator = _Slice()
    packed = W4KernelLinear(q, torch.float16)
    assert packed.ec is None and packed.compensator is q.compensator
    x = torch.randn(3, 128).half()
    assert sqnr_db(q(x.float()), packed(x).float()) > 40


def test_only_kernel_shapes_are_packed(tiny_llama):
    from spear.quant import quantize_model_rtn

    model, _ = tiny_llama
    q = quant_linear()
    q.bits = 3
    assert not packable(q)
    quantize_model_rtn(model, QuantConfig(bits=4, group_size=32), progress=False)
    assert use_quant_kernels(model) == 0  # fp32 activations keep the torch path
    model.half()
    assert use_quant_kernels(model) == 14
    assert sum(isinstance(m, W4KernelLinear) for m in model.modules()) == 14


def test_w8_head_is_served_by_the_w8_kernel(tiny_llama):
    """An 8-bit per-channel symmetric QuantLinear (spear quantize --lm-head-bits 8) becomes a
    W8KernelLinear whose output matches it; other 8-bit forms keep the torch path."""
    from spear.quant import quantize_model_rtn
    from spear.serve.w4_kernels import W8KernelLinear, packable_w8

    torch.manual_seed(0)
    lin = torch.nn.Linear(128, 96, bias=True)
    q = rtn_quantize_linear(lin, QuantConfig(bits=8))
    assert packable_w8(q) and not packable(q)
    assert not packable_w8(rtn_quantize_linear(lin, QuantConfig(bits=8, group_size=32)))
    assert not packable_w8(rtn_quantize_linear(lin, QuantConfig(bits=8, symmetric=False)))
    packed = W8KernelLinear(q, torch.float16)
    x = torch.randn(2, 5, 128).half()
    out = packed(x)
    assert out.dtype == torch.float16 and out.shape == (2, 5, 96)
    assert sqnr_db(q(x.float()), out.float()) > 40
    with pytest.raises(ValueError, match="does not fit the W8 kernel"):
        W8KernelLinear(quant_linear(), torch.float16)

    model, _ = tiny_llama
    quantize_model_rtn(model, QuantConfig(bits=4, group_size=32), progress=False)
    quantize_model_rtn(model, QuantConfig(bits=8, include_lm_head=True), progress=False)
    model.half()
    assert use_quant_kernels(model) == 15
    assert isinstance(model.lm_head, W8KernelLinear)
