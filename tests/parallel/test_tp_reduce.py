"""``tp_reduce_ec`` (the row-parallel sum with the compensator's second half, one Triton kernel)
against ``reference.tp_reduce_ec``, through the interpreter on the CPU at odd shapes: 1 to 4
staging buffers (the peers of the peer path; 1 is the post step after an all-reduce), token counts
off the tile, output widths off the 128-column tile, gated / ungated / no compensator, with and
without a bias."""

from __future__ import annotations

import pytest
import torch

from spear.kernels import reference
from spear.kernels.layout import pack_ec
from spear.kernels.tp_reduce import tp_reduce_ec


def _ec(kind, n, g, rank=5, hidden=6):
    if kind is None:
        return None
    a, b = torch.randn(rank, 64, generator=g), torch.randn(n, rank, generator=g) * 0.5
    gate = {}
    if kind == "gated":
        gate = dict(w1=torch.randn(hidden, rank, generator=g), b1=torch.randn(hidden, generator=g),
                    w2=torch.randn(rank, hidden, generator=g), b2=torch.randn(rank, generator=g), bound=0.7)
    return pack_ec(a, b, 0.8, torch.float16, **gate)


def _ref(staging, n, bias, ec):
    if ec is None:
        return reference.tp_reduce_ec(staging, n, bias)
    gate = (ec.w1, ec.b1, ec.w2, ec.b2) if ec.gated else (None,) * 4
    return reference.tp_reduce_ec(staging, n, bias, ec.b, ec.alpha, *gate, ec.bound)


@pytest.mark.parametrize("peers", [1, 2, 3, 4])
@pytest.mark.parametrize("kind", ["gated", "lowrank", None])
@pytest.mark.parametrize("m,n", [(1, 72), (17, 200), (3, 128)])
def test_tp_reduce_ec_equals_the_reference(peers, kind, m, n):
    """Catches: a peer's buffer left out of the sum (PEERS off by one), u read at the wrong column
    offset, the gate applied to one peer's u, the bias added per peer."""
    g = torch.Generator().manual_seed(peers * 100 + m)
    ec = _ec(kind, n, g)
    r = 0 if ec is None else ec.b.shape[1]
    staging = [torch.randn(m, n + r, generator=g).half() for _ in range(peers)]
    bias = torch.randn(n, generator=g).half() if peers % 2 else None
    got = tp_reduce_ec(staging, n, bias, ec).float()
    want = _ref(staging, n, bias, ec)
    assert got.shape == (m, n)
    err = (got - want).norm() / want.norm()
    assert err < 2e-3, float(err)  # fp16 output rounding (and v rounded to fp16 before B)


def test_tp_reduce_ec_reads_strided_rows_and_writes_out():
    """Staging rows wider than n + r (a larger buffer viewed as (M, width)); ``out`` given."""
    g = torch.Generator().manual_seed(7)
    ec = _ec("gated", 40, g)
    big = torch.randn(2, 6, 80, generator=g).half()
    staging = [t[:, :40 + ec.b.shape[1]] for t in big]
    out = torch.full((6, 40), float("nan")).half()
    tp_reduce_ec(staging, 40, None, ec, out=out)
    want = _ref(staging, 40, None, ec)
    assert torch.isfinite(out).all() and (out.float() - want).norm() / want.norm() < 2e-3


def test_tp_reduce_ec_refuses_mismatched_buffers():
    s = torch.zeros(4, 32).half()
    with pytest.raises(ValueError, match="differ"):
        tp_reduce_ec([s, torch.zeros(4, 33).half()], 32)
    with pytest.raises(ValueError, match="1 to 8 buffers"):
        tp_reduce_ec([s] * 9, 32)
    ec = _ec("lowrank", 32, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="staging buffers must be"):
        tp_reduce_ec([s], 32, None, ec)  # no room for u
