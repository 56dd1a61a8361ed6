"""The EC above the fused kernel's token counts (the semi-fused "side" path of ops.py: ec_gate,
the W4 part, then ec_up or the W4 kernel's v-epilogue) and SiLU·mul of interleaved pairs in one
pass, each against the fp32 reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from spear.kernels import fused, ops, planner
from spear.kernels import reference as ref
from spear.kernels.layout import Layout, pack_ec
from spear.kernels.planner import EC, Kernel, plan
from spear.kernels.policy import KernelPolicy
from tests.kernels._helpers import DEVICE, K_SMALL, N_SMALL, assert_close, capture, make_ec, setup_case

DEFAULT = KernelPolicy()


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


# (tokens, layout, act): from the layout's cuBLAS threshold on (dequantize + cuBLAS, then ec_up), and
# below it (the Triton GEMM's v-epilogue), under the default policy's plan for a GPU
@pytest.mark.parametrize("m,layout,act", [(DEFAULT.nmajor_cublas_min_m + 3, Layout.NMAJOR, 0),
                                          (DEFAULT.fragment_cublas_min_m + 3, Layout.FRAGMENT, 1),
                                          (DEFAULT.fused_max_m + 3, Layout.FRAGMENT, 0),
                                          (DEFAULT.fused_max_m + 3, Layout.NMAJOR, 1)])
def test_semi_fused_side_path(poisoned, monkeypatch, m, layout, act):
    """The op's semi-fused path in its serial form (as torch.compile traces it; the overlap on a
    side stream needs CUDA), as planned for a GPU (its capability faked): ec_gate writes v, then
    dequantize + cuBLAS and ec_up add alpha v Bᵀ, or the GEMM's epilogue does, and SiLU·mul of the
    pairs where the GEMM does not."""
    monkeypatch.setattr(planner, "capability", lambda device: (8, 0))
    dtype = torch.float16
    ec = make_ec(N_SMALL, K_SMALL, 16, 16, dtype, seed=9)
    x, w, b, e, expect = setup_case(m, K_SMALL, N_SMALL, 64, False, dtype, seed=9 + m, ec=ec, layout=layout)
    p = plan(m, N_SMALL, K_SMALL, e.kernel_rank, w.format, x.device, DEFAULT)
    cublas = m >= (DEFAULT.nmajor_cublas_min_m if layout is Layout.NMAJOR else DEFAULT.fragment_cublas_min_m)
    assert p.ec is EC.SEMI and p.kernel is (Kernel.CUBLAS if cublas else Kernel.TRITON)
    out = ops.run(p, x, w, b, e, act, 0, overlap=False)
    what = f"side M={m} {layout} act={act} {p}"
    assert_close(out, ref.silu_mul_pairs(expect) if act else expect, dtype, what)
    # without the EC term the result is measurably further from the reference (the EC is applied)
    plain = ops.run(dataclasses.replace(p, ec=EC.NONE), x, w, b, None, act, 0, overlap=False)
    target = ref.silu_mul_pairs(expect) if act else expect
    assert (plain.float() - target).abs().max() > 4 * (out.float() - target).abs().max()
    assert int(w.locks.abs().sum()) == 0


def test_ec_gate_writes_strided_v(poisoned):
    """ec_gate(out=) into the last R columns of a wider matrix, single pass and split over K: the
    columns before them are left alone."""
    from spear.kernels.ec import ec_gate

    dtype = torch.bfloat16
    e = pack_ec(**make_ec(N_SMALL, K_SMALL, 8, 8, dtype, seed=6))
    x = torch.randn(37, K_SMALL, generator=torch.Generator().manual_seed(7)).to(dtype).to(DEVICE)
    u = x.float() @ e.a.float().t()
    expect = ref.ec_gate(u, e.w1, e.b1, e.w2, e.b2, e.bound)
    r = e.a.shape[0]
    for splits in (1, 2):
        xv = torch.full((37, K_SMALL + r), 7.0, dtype=dtype, device=DEVICE)
        ec_gate(x, e, out=xv[:, K_SMALL:], splits=splits)
        assert bool((xv[:, :K_SMALL] == 7.0).all()), f"columns before v written, splits={splits}"
        assert_close(xv[:, K_SMALL:], expect, dtype, f"v in [x, v], splits={splits}")


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("m", [DEFAULT.nmajor_cublas_min_m, 300, 2048])
@pytest.mark.parametrize("act", [0, 1])
def test_gpu_side_path_dispatch(poisoned, overlap, m, act):
    """The registered op's semi-fused EC at prefill token counts and a real shape, ec_gate beside
    the W4 part on a side stream or before it, eagerly and replayed from a CUDA graph."""
    if DEVICE != "cuda":
        pytest.skip("needs CUDA")
    from spear.kernels.ops import w4a16_linear

    policy = DEFAULT.replace(semi_fused_overlap=overlap)
    dtype = torch.float16
    ec = make_ec(4096, 4096, 32, 32, dtype, seed=2)
    x, w, b, e, expect = setup_case(m, 4096, 4096, 128, False, dtype, seed=2, ec=ec, layout=Layout.FRAGMENT)
    assert plan(m, 4096, 4096, e.kernel_rank, w.format, x.device, policy).ec is EC.SEMI
    expect = ref.silu_mul_pairs(expect) if act else expect
    what = f"side overlap={overlap} M={m} act={act}"
    assert_close(w4a16_linear(x, w, b, e, act=act, policy=policy), expect, dtype, what)
    graph, y = capture(lambda: w4a16_linear(x, w, b, e, act=act, policy=policy))
    graph.replay()
    torch.cuda.synchronize()
    assert_close(y, expect, dtype, what + ", graph replay")
