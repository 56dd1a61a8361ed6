"""The engine's linear layer (spear/serve/model/layers/linear.py) against the modules it stands for.

Members are real QuantLinears with their compensators (the quality pipeline's modules, the
independent reference). The W4 method (merged codes, merged block-diagonal EC, interleaved gate/up)
is built on the CPU too, where the registered op runs its torch reference on the packed tensors;
the dense method is what the CPU runs.
"""

from __future__ import annotations

import pytest
import torch

from spear.compensate.ec import GatedCompensator
from spear.compensate.lowrank import LowRankCompensator
from spear.compensate.spec import ECFactors, factors
from spear.config import QuantConfig
from spear.errors import SpearError
from spear.kernels.policy import KernelPolicy
from spear.quant.rtn import rtn_quantize_linear
from spear.kernels.layout import Layout
from spear.serve.model.layers.linear import Context, Linear, MemberWeights, QuantTensors
from spear.serve.model.layers.quant_method import DenseMethod, W4Method, merge_factors
from tests.conftest import sqnr_db

K = 128
CTX = Context(KernelPolicy())


def member(out_features, comp=None, bias=False, seed=0, group_size=32, bound=0.5, bits=4, k=K):
    torch.manual_seed(seed)
    q = rtn_quantize_linear(torch.nn.Linear(k, out_features, bias=bias), QuantConfig(bits=bits, group_size=group_size))
    g = torch.Generator().manual_seed(seed + 100)
    if comp == "lowrank":
        q.compensator = LowRankCompensator(torch.randn(3, k, generator=g) * 0.1,
                                           torch.randn(out_features, 3, generator=g) * 0.1)
    elif comp in ("gated", "ungated", "gated-module"):
        ec = GatedCompensator(torch.randn(5, k, generator=g) * 0.1, torch.randn(out_features, 5, generator=g) * 0.1,
                              hidden=6, alpha=0.7, bound=bound, gated=comp != "ungated",
                              per_rank=comp != "gated-module")
        if comp != "ungated":
            with torch.no_grad():
                ec.w2.normal_(0, 1.0, generator=g)
                ec.b2.normal_(0, 0.5, generator=g)
                ec.set_input_scale(torch.rand(5, generator=g) + 0.5)
        q.compensator = ec
    return q


def weights_of(q, name) -> MemberWeights:
    return MemberWeights(name, quant=QuantTensors(q.codes, q.scales, q.zeros, q.bits, q.group_size, q.symmetric),
                         bias=None if q.bias is None else q.bias.detach(),
                         ec=None if q.compensator is None else factors(q.compensator))


def layer_of(mods, kernels, dtype, interleave=False):
    lin = Linear(mods[0].in_features, [m.out_features for m in mods], [f"m{i}" for i in range(len(mods))],
                 bias=any(m.bias is not None for m in mods), interleave=interleave)
    for i, m in enumerate(mods):
        lin.load(i, weights_of(m, f"m{i}"))
    lin.finalize(torch.device("cpu"), dtype, 128, kernels=kernels)
    return lin


COMPS = [((None, None, None), False), (("gated", None, "lowrank"), True), (("ungated", "gated", "gated"), False),
         (("gated-module", "lowrank", None), True)]


@pytest.mark.parametrize("kernels,dtype", [(False, torch.float32), (True, torch.float16)])
@pytest.mark.parametrize("comps,bias", COMPS)
def test_merged_qkv_equals_its_members(kernels, dtype, comps, bias):
    """Catches: a member's block of B or of the gate MLPs misplaced, alpha dropped, bias order."""
    mods = [member(n, c, bias, seed=i) for i, (n, c) in enumerate(zip((64, 32, 32), comps))]
    lin = layer_of(mods, kernels, dtype)
    assert isinstance(lin.method, W4Method if kernels else DenseMethod)
    x = torch.randn(9, K, generator=torch.Generator().manual_seed(5))
    ref = torch.cat([m(x) for m in mods], dim=-1)  # each QuantLinear with its compensator, fp32
    out = lin(x.to(dtype), CTX).float()
    assert out.shape == ref.shape
    assert sqnr_db(ref, out) > (100 if dtype == torch.float32 else 40)


@pytest.mark.parametrize("kernels", [False, True])
def test_gate_up_silu_epilogue_equals_silu_of_the_members(kernels):
    """Catches: the interleave of codes, scales, B or bias out of step (SiLU of the wrong feature)."""
    gate, up = member(96, "gated", True, seed=1), member(96, "lowrank", True, seed=2)
    lin = layer_of([gate, up], kernels, torch.float16, interleave=True)
    assert lin.interleaved == kernels
    x = torch.randn(6, K, generator=torch.Generator().manual_seed(3))
    ref = torch.nn.functional.silu(gate(x)) * up(x)
    act = lin.silu_mul(x.half(), CTX)
    if not kernels:
        assert act is None  # the caller applies SiLU·mul to the dense output
        g, u = lin(x.half(), CTX).float().chunk(2, dim=-1)
        act = torch.nn.functional.silu(g) * u
    assert sqnr_db(ref, act.float()) > 38
    both = lin(x.half(), CTX).float()  # without the epilogue: members side by side, de-interleaved
    assert sqnr_db(torch.cat([gate(x), up(x)], -1), both) > 40


def test_merge_factors_computes_each_members_compensator():
    """The merged compensator's output, split by member, equals each member's own module."""
    mods = [member(n, c, seed=i) for i, (n, c) in enumerate(zip((64, 32, 32), ("gated", None, "ungated")))]
    ecs = [None if m.compensator is None else factors(m.compensator) for m in mods]
    merged = merge_factors(ecs, [64, 32, 32], K)
    x = torch.randn(4, K, generator=torch.Generator().manual_seed(0))
    u = x @ merged.a.t()
    h = torch.nn.functional.silu(u @ merged.w1.t() + merged.b1)
    v = u * (1 + merged.bound * torch.tanh(h @ merged.w2.t() + merged.b2))
    y = (v @ merged.b.t()).split([64, 32, 32], dim=-1)
    for m, part in zip(mods, y):
        ref = m.compensator(x) if m.compensator is not None else torch.zeros_like(part)
        torch.testing.assert_close(part, ref, rtol=1e-5, atol=1e-6)


def test_off_kernel_reasons_and_shapes():
    w3 = layer_of([member(64, bits=3)], True, torch.float16)
    assert isinstance(w3.method, DenseMethod) and "3-bit" in w3.reason
    odd = layer_of([member(64, group_size=0, k=96)], True, torch.float16)
    assert isinstance(odd.method, W4Method) and odd.method.packed.layout is Layout.NMAJOR  # K % 64 != 0: the fallback
    assert layer_of([member(64)], True, torch.float16).method.packed.layout is Layout.FRAGMENT
    big = member(64, "lowrank")
    lin = Linear(K, [64], ["big"])
    w = weights_of(big, "big")
    w.ec = ECFactors(torch.zeros(200, K), torch.zeros(64, 200))
    lin.load(0, w)
    lin.finalize(torch.device("cpu"), torch.float16, 128, kernels=True)
    assert isinstance(lin.method, DenseMethod) and "beyond the kernels' 128" in lin.reason
    with pytest.raises(SpearError, match=r"weight of shape \(64, 128\), the model's config expects \(32, 128\)"):
        Linear(K, [32], ["x"]).load(0, weights_of(member(64), "x"))
    with pytest.raises(SpearError, match="different bounds"):
        layer_of([member(64, "gated", bound=0.5), member(64, "gated", bound=0.25, seed=1)], True, torch.float16)


def test_attention_says_which_kernels_cannot_take_its_shapes():
    """At load, not silently each step: a head_dim the paged kernels do not take (96, not a power of
    two) is reported for decode and prefill; Llama shapes are not."""
    from spear.serve.model.layers.attention import PagedAttention

    assert PagedAttention(32, 8, 128).kernel_fallbacks(16, torch.float16) == []
    odd = PagedAttention(12, 4, 96).kernel_fallbacks(16, torch.bfloat16)
    assert [kind for kind, _ in odd] == ["attention (decode steps)", "attention (prefill and mixed steps)"]
    assert all("head_dim 96" in why and "torch.bfloat16" in why for _, why in odd)


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4)])
def test_cpu_prefill_attention_equals_per_head_softmax(heads, kv_heads):
    """The CPU's attention of a mixed step (a whole prompt, a chunk over cached keys in blocks out of
    order, a decode) against softmax(q kᵀ) v per query head over its kv head's keys (h // group)."""
    from spear.serve.model.layers.attention import AttentionMetadata, prefill_attention_sdpa

    torch.manual_seed(0)
    bs, d, blocks = 4, 16, 24
    kc, vc = torch.randn(blocks, bs, kv_heads, d), torch.randn(blocks, bs, kv_heads, d)
    # (tokens of the step, keys in all): a prompt alone, a chunk of 5 at 13 keys, a decode at 9 keys
    seqs = [(6, 6, [0, 1]), (5, 13, [7, 3, 4, 20]), (1, 9, [10, 11, 12])]
    table = torch.full((3, 4), -1, dtype=torch.int64)
    for b, (_, _, bl) in enumerate(seqs):
        table[b, :len(bl)] = torch.tensor(bl)
    starts = torch.tensor([0, 6, 11, 12], dtype=torch.int32)
    q = torch.randn(12, heads, d)
    meta = AttentionMetadata(positions=torch.zeros(12, dtype=torch.int64), slots=torch.zeros(12, dtype=torch.int64),
                             cos=torch.ones(1, d), sin=torch.zeros(1, d), block_tables=table,
                             seq_lens=torch.tensor([s[1] for s in seqs]), query_start_loc=starts, max_query_len=6)
    got = prefill_attention_sdpa(q, kc, vc, meta, d ** -0.5).view(12, heads, d)
    group = heads // kv_heads
    for b, (n, ctx, bl) in enumerate(seqs):
        slots = torch.tensor([bl[t // bs] * bs + t % bs for t in range(ctx)])
        keys, vals = kc.flatten(0, 1)[slots], vc.flatten(0, 1)[slots]   # (ctx, Hkv, D)
        for i in range(n):
            pos = ctx - n + i
            for h in range(heads):
                s = keys[: pos + 1, h // group] @ q[starts[b] + i, h] * d ** -0.5
                want = s.softmax(0) @ vals[: pos + 1, h // group]
                torch.testing.assert_close(got[starts[b] + i, h], want, atol=1e-5, rtol=1e-5)
