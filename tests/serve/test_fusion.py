"""Fused q/k/v and gate/up projections (spear/serve/fusion.py), checked on the CPU against the
members run one by one (``w4a16_linear`` runs its torch reference off CUDA)."""

import pytest
import torch

from spear.compensate.ec import GatedCompensator
from spear.compensate.lowrank import LowRankCompensator
from spear.config import QuantConfig
from spear.quant.rtn import rtn_quantize_linear
from spear.serve.fusion import FusedLinear, FusedPart, fuse_group, fuse_projections
from spear.serve.w4_kernels import W4KernelLinear
from tests.conftest import sqnr_db

K = 128


def member(out_features, comp=None, bias=False, seed=0, group_size=32, bound=0.5):
    torch.manual_seed(seed)
    q = rtn_quantize_linear(torch.nn.Linear(K, out_features, bias=bias), QuantConfig(bits=4, group_size=group_size))
    g = torch.Generator().manual_seed(seed + 100)
    if comp == "lowrank":
        q.compensator = LowRankCompensator(torch.randn(3, K, generator=g) * 0.1,
                                           torch.randn(out_features, 3, generator=g) * 0.1)
    elif comp in ("gated", "ungated"):
        ec = GatedCompensator(torch.randn(5, K, generator=g) * 0.1, torch.randn(out_features, 5, generator=g) * 0.1,
                              hidden=6, alpha=0.7, bound=bound, gated=comp == "gated")
        if comp == "gated":
            with torch.no_grad():
                ec.w2.normal_(0, 1.0, generator=g)
                ec.b2.normal_(0, 0.5, generator=g)
        q.compensator = ec
    return q


@pytest.mark.parametrize("kmajor", [False, True])
@pytest.mark.parametrize("comps,bias", [
    ((None, None, None), False),
    (("gated", None, "lowrank"), True),
    (("ungated", "gated", "gated"), False),
    (("lowrank", "lowrank"), True),
])
def test_fused_w4_equals_members(kmajor, comps, bias):
    outs = [64, 32, 32, 96][:len(comps)]
    qs = [member(n, c, bias=bias and i != 1, seed=i) for i, (n, c) in enumerate(zip(outs, comps))]
    mods = [W4KernelLinear(q, torch.float16, kmajor=kmajor) for q in qs]
    fused = fuse_group(mods)
    assert isinstance(fused, FusedLinear) and fused.splits == outs
    assert fused.inner.weight.kmajor == kmajor
    assert (fused.inner.ec is not None) == any(c is not None for c in comps)
    x = torch.randn(5, K).half()
    expect = torch.cat([m(x) for m in mods], dim=-1).float()
    out = fused(x)
    assert out.shape == (5, sum(outs))
    assert sqnr_db(expect, out.float()) > 45
    # and against the unpacked QuantLinears (fp32 reference of each member)
    assert sqnr_db(torch.cat([q(x.float()) for q in qs], dim=-1), out.float()) > 40


@pytest.mark.parametrize("kmajor", [False, True])
@pytest.mark.parametrize("comps,bias", [((None, None), False), (("gated", "lowrank"), True), ((None, "ungated"), False)])
def test_interleaved_gate_up_and_silu_mul(kmajor, comps, bias):
    """gate/up fused with alternating features: forward still gives [gate | up]; silu_mul gives
    silu(gate) * up from the op's act (the reference here; the GEMM epilogue on CUDA)."""
    qs = [member(64, c, bias=bias and i == 0, seed=10 + i) for i, c in enumerate(comps)]
    mods = [W4KernelLinear(q, torch.float16, kmajor=kmajor) for q in qs]
    fused = fuse_group(mods, interleave=True)
    assert isinstance(fused, FusedLinear) and fused.interleaved and fused.splits == [64, 64]
    x = torch.randn(5, K).half()
    gate, up = mods[0](x).float(), mods[1](x).float()
    out = fused(x)
    assert out.shape == (5, 128)
    assert sqnr_db(torch.cat([gate, up], dim=-1), out.float()) > 45
    # the interleaved inner output itself: features 2i, 2i + 1 are gate_i, up_i
    inner = fused.inner(x).float()
    assert sqnr_db(gate, inner[:, 0::2]) > 45 and sqnr_db(up, inner[:, 1::2]) > 45
    act = fused.silu_mul(x)
    assert act.shape == (5, 64) and act.dtype == torch.float16
    assert sqnr_db(torch.nn.functional.silu(gate) * up, act.float()) > 40
    # unequal widths or three members: plain side-by-side fusion, no silu_mul
    plain = fuse_group([W4KernelLinear(member(64, seed=1), torch.float16),
                        W4KernelLinear(member(32, seed=2), torch.float16)], interleave=True)
    assert not plain.interleaved
    with pytest.raises(ValueError, match="interleaved"):
        plain.silu_mul(x)


def test_members_that_cannot_share_a_kernel_stay_apart():
    # gated members with different bounds (a scalar of the kernel)
    mods = [W4KernelLinear(member(32, "gated", seed=i, bound=b), torch.float16) for i, b in enumerate((0.5, 1.0))]
    assert fuse_group(mods) is None
    # different group sizes
    mods = [W4KernelLinear(member(32, seed=i, group_size=g), torch.float16) for i, g in enumerate((32, 64))]
    assert fuse_group(mods) is None
    # a mix of kinds
    assert fuse_group([W4KernelLinear(member(32), torch.float16), torch.nn.Linear(K, 32)]) is None


def test_fuse_projections_keeps_the_model_function(tiny_llama):
    model, _ = tiny_llama
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expect = model(input_ids=ids).logits
        params_before = sum(p.numel() for p in model.parameters())
        layers = list(model.model.layers)
        assert fuse_projections(layers) == 2 * len(layers)
        got = model(input_ids=ids).logits
    attn, mlp = layers[0].self_attn, layers[0].mlp
    assert isinstance(attn.q_proj, FusedPart) and attn.qkv_proj.splits == [attn.q_proj.out_features,
                                                                        attn.k_proj.out_features,
                                                                        attn.v_proj.out_features]
    assert isinstance(mlp.up_proj, FusedPart) and len(mlp.gate_up_proj.splits) == 2
    # no second copy of any weight
    assert sum(p.numel() for p in model.parameters()) == params_before
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)
