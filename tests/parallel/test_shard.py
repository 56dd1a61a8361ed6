"""One rank's share of a linear layer against the whole layer.

Column-parallel shares (q/k/v, gate/up: A and the gate whole, B split by rows) concatenated, and
row-parallel shares (o, down: A split by columns) summed with u = A x summed *before* the gate,
must give the unsplit layer's output; in float64 the difference is rounding. The naive
row-parallel compensator, the gate applied to each rank's partial u, must not: that is the test
that the gate-after-reduction matters and that these tests can fail.
"""

from __future__ import annotations

import pytest
import torch

from spear.compensate.spec import ECFactors
from spear.errors import SpearError
from spear.parallel import split_of
from spear.parallel.comm import RowPost
from spear.parallel.shard import TPRank, column_share, row_share
from spear.quant.primitives import rtn
from spear.serve.model.layers.linear import Linear, MemberWeights, QuantTensors, parallel_linear
from spear.serve.model.layers.quant_method import W4Method


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _member(name, n, k, g, ec="gated", quant=True, group=0, bias=False, rank=3, hidden=5) -> MemberWeights:
    w = torch.randn(n, k, generator=g) * 0.1
    q = None
    if quant:
        codes, scales, zeros = rtn(w, 4, group, False)
        q, w = QuantTensors(codes, scales.half(), zeros, 4, group, False), None
    e = None
    if ec is not None:
        gate = {}
        if ec == "gated":
            gate = dict(w1=torch.randn(hidden, rank, generator=g) * 2, b1=torch.randn(hidden, generator=g),
                        w2=torch.randn(rank, hidden, generator=g), b2=torch.randn(rank, generator=g), bound=0.8)
        e = ECFactors(torch.randn(rank, k, generator=g) / k ** 0.5, torch.randn(n, rank, generator=g) * 0.3,
                      0.9, **gate)
    return MemberWeights(name, weight=w, quant=q, bias=torch.randn(n, generator=g) if bias else None, ec=e)


def _layer(members, k, split, tp, dtype=torch.float64, kernels=None, interleave=False) -> Linear:
    lin = parallel_linear(split, tp, k, [m.quant.codes.shape[0] if m.quant is not None else m.weight.shape[0]
                                         for m in members],
                          [m.name for m in members], bias=any(m.bias is not None for m in members),
                          **({"interleave": True} if interleave else {}))
    for i, m in enumerate(members):
        lin.load(i, m)
    lin.finalize(torch.device("cpu"), dtype, 128, kernels)
    return lin


def _ctx():
    from spear.kernels.policy import KernelPolicy
    from spear.serve.model.layers.linear import Context

    return Context(KernelPolicy())


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("interleave", [False, True])
def test_column_shares_concatenate_to_the_whole_layer(size, interleave):
    """q/k/v-like (three members: gated, ungated, none) and gate/up-like (interleaved) layers.
    Catches: B split by columns instead of rows, or a share of A instead of the whole."""
    g = _gen(0)
    k = 48
    if interleave:
        members = [_member("gate", 24, k, g, "gated"), _member("up", 24, k, g, "lowrank")]
    else:
        members = [_member("q", 24, k, g, "gated", bias=True), _member("k", 12, k, g, "lowrank"),
                   _member("v", 12, k, g, None)]
    x = torch.randn(7, k, generator=g, dtype=torch.float64)
    whole = _layer(members, k, "column", TPRank()).forward(x, _ctx())
    outs = [_layer(members, k, "column", TPRank(r, size), interleave=interleave).forward(x, _ctx())
            for r in range(size)]
    # each rank holds its slice of every member: put the members' slices back in order
    widths = [m.quant.codes.shape[0] for m in members]
    got = torch.cat([torch.cat([o.split([w // size for w in widths], -1)[i] for o in outs], -1)
                     for i in range(len(members))], -1)
    torch.testing.assert_close(got, whole, rtol=1e-12, atol=1e-12)


def _row_partials(members, k, size, dtype, kernels, x):
    """Each rank's (partial output, partial u, post) as its row-parallel layer computes them."""
    out = []
    for r in range(size):
        lin = _layer(members, k, "row", TPRank(r, size), dtype, kernels)
        share = TPRank(r, size).share(k)
        xr = x[:, share].contiguous()
        y = lin._local(xr, _ctx())
        u = None if lin.post.ec is None else torch.nn.functional.linear(xr, lin.post.ec.a)
        out.append((y, u, lin.post))
    return out


@pytest.mark.parametrize("ec", ["gated", "lowrank", None])
@pytest.mark.parametrize("size", [2, 3])
def test_row_shares_summed_give_the_whole_layer_and_the_gate_after_the_sum(ec, size):
    """o/down-like, float64, dense path: the partials summed (u with them) then the post step equal
    the whole layer; the naive gate on each rank's partial u does not (by far more than rounding).
    Catches: gamma applied before the sum, the bias added on every rank, A or B split the wrong way."""
    g = _gen(1)
    k, n = 192, 40
    members = [_member("o_proj", n, k, g, ec, group=32, bias=True)]
    x = torch.randn(5, k, generator=g, dtype=torch.float64)
    whole = _layer(members, k, "row", TPRank()).forward(x, _ctx())
    parts = _row_partials(members, k, size, torch.float64, None, x)
    staging = [y if u is None else torch.cat([y, u], -1) for y, u, _ in parts]
    got = parts[0][2](staging)  # the peer path: one post step over every rank's buffer
    torch.testing.assert_close(got, whole, rtol=1e-11, atol=1e-11)
    summed = parts[0][2]([sum(staging)])  # the all-reduce path: the post step on the summed buffer
    torch.testing.assert_close(summed, whole, rtol=1e-11, atol=1e-11)
    if ec == "gated":
        naive = sum(RowPost(n, None, dense=p.dense)([s]) for (_, _, p), s in zip(parts, staging)) + members[0].bias
        assert (naive - whole).norm() > 1e-3 * whole.norm()


@pytest.mark.parametrize("ec", ["gated", "lowrank"])
def test_row_shares_on_the_packed_kernel_form(ec):
    """The W4 kernel layout (packed codes and EC, fp16; the op's CPU reference and the post step's
    reference): two ranks against the unsplit packed layer. Catches: a gated EC left inside the
    rank's op (gamma of the partial u) or u taken from an unpadded A."""
    g = _gen(2)
    k, n = 128, 64
    members = [_member("down_proj", n, k, g, ec, group=32, bias=True)]
    x = torch.randn(4, k, generator=g).half()
    whole = _layer(members, k, "row", TPRank(), torch.float16, True)
    assert isinstance(whole.method, W4Method)
    want = whole.forward(x, _ctx()).float()
    parts = _row_partials(members, k, 2, torch.float16, True, x)
    staging = [y if u is None else torch.cat([y, u], -1) for y, u, _ in parts]
    got = parts[0][2](staging).float()
    assert (got - want).norm() / want.norm() < 2e-3


def test_the_reduction_kernel_equals_the_post_reference_on_a_layer():
    """tp_reduce_ec (the fused kernel, interpreter) on the staging buffers of two W4 ranks with a
    gated EC equals RowPost's reference."""
    from spear.kernels.tp_reduce import tp_reduce_ec

    g = _gen(3)
    k, n = 128, 72
    members = [_member("o_proj", n, k, g, "gated", group=32, bias=True)]
    x = torch.randn(3, k, generator=g).half()
    parts = _row_partials(members, k, 2, torch.float16, True, x)
    staging = [torch.cat([y, u], -1) for y, u, _ in parts]
    post = parts[0][2]
    ref = post(staging).float()
    got = tp_reduce_ec(staging, n, post.bias, post.packed).float()
    assert (got - ref).norm() / ref.norm() < 2e-3


def test_shares_refuse_uneven_splits_and_cut_groups():
    g = _gen(4)
    with pytest.raises(SpearError, match="does not split evenly across 3"):
        parallel_linear("column", TPRank(0, 3), 64, [32], ["x.q_proj"])
    m = _member("mlp.down_proj", 16, 96, g, None, group=32)
    with pytest.raises(SpearError, match="cut through its quantization groups of 32"):
        row_share(m, TPRank(0, 2).share(96))  # 48 columns: half a group
    with pytest.raises(SpearError, match="rank 2 is not in 0..1"):
        TPRank(2, 2)


def test_share_math_and_split_names():
    t = TPRank(1, 4)
    assert t.share(64) == slice(16, 32)
    assert [split_of(n) for n in ("model.layers.0.self_attn.o_proj", "model.layers.3.mlp.down_proj",
                                  "model.layers.0.self_attn.q_proj", "model.layers.0.mlp.gate_proj", "lm_head")] \
        == ["row", "row", "column", "column", "column"]
    g = _gen(5)
    m = _member("q", 8, 32, g, "gated", quant=False, bias=True)
    c = column_share(m, slice(2, 6))
    assert torch.equal(c.weight, m.weight[2:6]) and torch.equal(c.ec.b, m.ec.b[2:6])
    assert c.ec.a is m.ec.a and c.ec.w1 is m.ec.w1 and torch.equal(c.bias, m.bias[2:6])
    r = row_share(m, slice(8, 16))
    assert torch.equal(r.weight, m.weight[:, 8:16]) and torch.equal(r.ec.a, m.ec.a[:, 8:16])
    assert r.ec.b is m.ec.b and r.bias is m.bias
