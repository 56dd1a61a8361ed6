"""The prefill path from ops.DEQUANT_MM_MIN_M tokens: SiLU·mul of interleaved pairs in one pass,
and the EC from one GEMM on [W_hat; A] (``ec_stacked``), each against the fp32 reference."""

from __future__ import annotations

import pytest
import torch

from spear.kernels import fused, ops, pack_ec
from spear.kernels import reference as ref
from spear.kernels.ec import ec_stacked
from spear.kernels.layout import unpack
from tests.kernels._helpers import DEVICE, K_SMALL, N_SMALL, assert_close, capture, make_ec, setup_case


@pytest.mark.parametrize("m,n,dtype", [(1, 64, torch.float16), (7, 96, torch.bfloat16), (33, 200, torch.float32),
                                       (130, 2, torch.float16)])
def test_silu_mul_pairs(poisoned, m, n, dtype):
    y = (torch.randn(m, n, generator=torch.Generator().manual_seed(m + n)) * 3).to(dtype).to(DEVICE)
    out = fused.silu_mul_pairs(y)
    expect = ref.silu_mul_pairs(y)
    assert out.shape == (m, n // 2) and out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-5)
    else:
        assert_close(out, expect, dtype, f"silu_mul_pairs M={m} N={n}")
    # the gate is the even feature: swapping the pairs' roles must change the result
    assert not torch.allclose(out.float(), ref.silu_mul_pairs(y.flip(1)).flip(1).float(), atol=1e-2)
    with pytest.raises(ValueError, match="even number of features"):
        fused.silu_mul_pairs(y[:, :1])


def _stacked_y(x, w, e):
    """x [W_hat; A]ᵀ in x's dtype, as cuBLAS returns it (fp32 math, one rounding)."""
    w_hat = ref.dequantize(*unpack(w), w.group_size).to(x.dtype)
    return (x.float() @ torch.cat([w_hat, e.a]).float().t()).to(x.dtype)


@pytest.mark.parametrize("m,dtype,h,bias,act", [(5, torch.float16, 12, True, 0), (70, torch.bfloat16, None, False, 0),
                                                (129, torch.float16, 16, True, 1), (3, torch.bfloat16, 8, False, 1)])
def test_ec_stacked(poisoned, m, dtype, h, bias, act):
    ec = make_ec(N_SMALL, K_SMALL, 8, h, dtype, seed=4)
    x, w, b, e, expect = setup_case(m, K_SMALL, N_SMALL, 64, False, dtype, seed=m, bias=bias, ec=ec)
    y = _stacked_y(x, w, e)
    out = ec_stacked(y, N_SMALL, e, b, act)
    if act:
        expect = ref.silu_mul_pairs(expect)
    assert_close(out, expect, dtype, f"ec_stacked M={m} act={act}")
    # without the EC term the result is measurably further from the reference (the EC is applied)
    plain = y[:, :N_SMALL].float() + (b.float() if b is not None else 0)
    plain = ref.silu_mul_pairs(plain) if act else plain
    assert (plain - expect).abs().max() > 4 * (out.float() - expect).abs().max()


def test_ec_stacked_checks_shapes():
    ec = make_ec(N_SMALL, K_SMALL, 8, None, torch.float16, seed=4)
    x, w, b, e, _ = setup_case(4, K_SMALL, N_SMALL, 64, False, torch.float16, seed=4, ec=ec)
    y = _stacked_y(x, w, e)
    with pytest.raises(ValueError, match=r"\(M, N \+ R\)"):
        ec_stacked(y[:, :-1], N_SMALL, e)
    with pytest.raises(ValueError, match="bias"):
        ec_stacked(y, N_SMALL, e, b[:-1])
    assert ec_stacked(y[:0], N_SMALL, e).shape == (0, N_SMALL)


@pytest.mark.parametrize("mode", ["out", "in"])
@pytest.mark.parametrize("kmajor", [False, True])
@pytest.mark.parametrize("act", [0, 1])
def test_prefill_ec_paths(poisoned, mode, kmajor, act):
    """"out": dequantize into the first N rows, A under them, one GEMM, ec_stacked. "in": ec_gate
    writes [x, v], the weight is [W_hat, alpha · B], one GEMM over K + R."""
    dtype = torch.float16
    m = ops.DEQUANT_MM_MIN_M + 3
    ec = make_ec(N_SMALL, K_SMALL, 16, 16, dtype, seed=9)
    x, w, b, e, expect = setup_case(m, K_SMALL, N_SMALL, 64, False, dtype, seed=9, ec=ec, kmajor=kmajor)
    path = ops._prefill_ec_out if mode == "out" else ops._prefill_ec_in
    out = path(x, w, b, e, act)
    assert_close(out, ref.silu_mul_pairs(expect) if act else expect, dtype, f"{mode} kmajor={kmajor} act={act}")


def test_prefill_ec_mode(monkeypatch):
    for mode in ("side", "out", "in"):
        monkeypatch.setattr(ops, "PREFILL_EC", mode)
        assert ops._prefill_ec_mode(4096, 4096) == mode
    monkeypatch.setattr(ops, "PREFILL_EC", "auto")
    assert ops._prefill_ec_mode(28672, 4096) == "in" and ops._prefill_ec_mode(4096, 14336) == "out"
    monkeypatch.setattr(ops, "PREFILL_EC", "stacked")
    with pytest.raises(ValueError, match="PREFILL_EC"):
        ops._prefill_ec_mode(4096, 4096)


def test_ec_gate_copies_x_and_writes_strided_v(poisoned):
    """ec_gate(copy_to=, out=) into the two parts of one [x, v] matrix, single pass and split over K."""
    from spear.kernels.ec import ec_gate

    dtype = torch.bfloat16
    e = pack_ec(**make_ec(N_SMALL, K_SMALL, 8, 8, dtype, seed=6))
    x = torch.randn(37, K_SMALL, generator=torch.Generator().manual_seed(7)).to(dtype).to(DEVICE)
    u = x.float() @ e.a.float().t()
    expect = ref.ec_gate(u, e.w1, e.b1, e.w2, e.b2, e.bound)
    r = e.a.shape[0]
    for splits in (1, 2):
        xv = torch.full((37, K_SMALL + r), float("nan"), dtype=dtype, device=DEVICE)
        ec_gate(x, e, out=xv[:, K_SMALL:], splits=splits, copy_to=xv[:, :K_SMALL])
        assert torch.equal(xv[:, :K_SMALL], x), f"the copy of x, splits={splits}"
        assert_close(xv[:, K_SMALL:], expect, dtype, f"v in [x, v], splits={splits}")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["out", "in"])
@pytest.mark.parametrize("m", [ops.DEQUANT_MM_MIN_M, 300, 2048])
@pytest.mark.parametrize("act", [0, 1])
def test_gpu_prefill_ec_dispatch(poisoned, monkeypatch, mode, m, act):
    """The registered op with PREFILL_EC "out" / "in" at a real shape, eagerly and replayed from a CUDA graph."""
    if DEVICE != "cuda":
        pytest.skip("needs CUDA")
    from spear.kernels.ops import w4a16_linear

    monkeypatch.setattr(ops, "PREFILL_EC", mode)
    dtype = torch.float16
    ec = make_ec(4096, 4096, 32, 32, dtype, seed=2)
    x, w, b, e, expect = setup_case(m, 4096, 4096, 128, False, dtype, seed=2, ec=ec, kmajor=True)
    expect = ref.silu_mul_pairs(expect) if act else expect
    assert_close(w4a16_linear(x, w, b, e, act=act), expect, dtype, f"{mode} M={m} act={act}")
    graph, y = capture(lambda: w4a16_linear(x, w, b, e, act=act))
    graph.replay()
    torch.cuda.synchronize()
    assert_close(y, expect, dtype, f"{mode} M={m} act={act}, graph replay")
