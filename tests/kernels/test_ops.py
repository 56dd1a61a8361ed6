"""The registered op ``spear::w4a16_ec``: CPU fallback, dispatch by M, CUDA graphs, torch.compile."""

from __future__ import annotations

import pytest
import torch

from spear.kernels import ops, pack, pack_ec, w4a16_linear
from spear.kernels import reference as ref
from tests.kernels._helpers import DEVICE, assert_close, capture, make_ec, make_layer


def _layer(n, k, gs, dtype, device, r=16, h=16, seed=0):
    codes, scales, zeros = make_layer(n, k, gs, False, seed, device)
    w = pack(codes, scales, zeros, gs)
    e = pack_ec(**make_ec(n, k, r, h, dtype, seed, device)) if r else None
    return codes, scales, zeros, w, e


def _expect(x, codes, scales, zeros, gs, bias, e):
    x2 = x.reshape(-1, x.shape[-1])
    args = () if e is None else (e.a, e.b, e.w1, e.b1, e.w2, e.b2, e.alpha, e.bound)
    return ref.w4a16_ec(x2, codes, scales, zeros, gs, bias, *args).reshape(*x.shape[:-1], -1)


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cpu_fallback_is_the_reference(gated, dtype):
    codes, scales, zeros, w, e = _layer(64, 128, 32, dtype, "cpu", h=16 if gated else None)
    x = torch.randn(2, 5, 128).to(dtype)
    bias = torch.randn(64).to(dtype)
    y = w4a16_linear(x, w, bias, e)
    assert y.shape == (2, 5, 64) and y.dtype == dtype
    torch.testing.assert_close(y, _expect(x, codes, scales, zeros, 32, bias, e).to(dtype), rtol=0, atol=0)
    y0 = w4a16_linear(x, w)
    torch.testing.assert_close(y0, _expect(x, codes, scales, zeros, 32, None, None).to(dtype), rtol=0, atol=0)


def test_op_edge_cases():
    _, _, _, w, e = _layer(64, 128, 0, torch.float16, "cpu")
    assert w4a16_linear(torch.randn(0, 128).half(), w, None, e).shape == (0, 64)
    with pytest.raises(ValueError, match="in_features=128"):
        w4a16_linear(torch.randn(3, 64).half(), w)


def test_op_is_registered_as_a_triton_op():
    assert hasattr(torch.ops.spear, "w4a16_ec")
    schema = str(torch.ops.spear.w4a16_ec.default._schema)
    assert "Tensor? ec_a" in schema and "float alpha" in schema


def _need_cuda():
    if DEVICE != "cuda":
        pytest.skip("needs CUDA")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 5, ops.FUSED_MAX_M, ops.FUSED_MAX_M + 1, 64, 300, 2048])
@pytest.mark.parametrize("overlap", [True, False])
def test_gpu_dispatch(poisoned, monkeypatch, m, overlap):
    _need_cuda()
    monkeypatch.setattr(ops, "SEMI_FUSED_OVERLAP", overlap)
    # without overlap, decode ECs above FUSED_MAX_RANK take ec_gate + the v-epilogue
    monkeypatch.setattr(ops, "FUSED_MAX_RANK", ops.FUSED_MAX_RANK if overlap else 16)
    dtype = torch.float16
    codes, scales, zeros, w, e = _layer(4096, 4096, 128, dtype, "cuda", r=32, h=32)
    x = torch.randn(m, 4096, device="cuda").to(dtype)
    bias = torch.randn(4096, device="cuda").to(dtype)
    assert_close(w4a16_linear(x, w, bias, e), _expect(x, codes, scales, zeros, 128, bias, e), dtype, f"op M={m}")
    assert_close(w4a16_linear(x, w, bias), _expect(x, codes, scales, zeros, 128, bias, None), dtype, f"W4 M={m}")
    assert int(w.locks.abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("m", [4, 64, 600])
def test_gpu_cuda_graph_replay(m):
    """Capture the op (fused at small M, side stream at large M, ec_gate split over K at 64 and
    600), replay on new inputs."""
    _need_cuda()
    dtype = torch.bfloat16
    codes, scales, zeros, w, e = _layer(4096, 4096, 64, dtype, "cuda", r=16, h=16)
    x = torch.randn(m, 4096, device="cuda").to(dtype)
    graph, y = capture(lambda: w4a16_linear(x, w, None, e))
    for seed in range(3):
        x.copy_(torch.randn(m, 4096, generator=torch.Generator().manual_seed(seed)).to(dtype))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(y, _expect(x, codes, scales, zeros, 64, None, e), dtype, f"graph replay {seed} M={m}")
    assert int(w.locks.abs().sum()) == 0


@pytest.mark.gpu
def test_gpu_torch_compile():
    _need_cuda()
    dtype = torch.float16
    codes, scales, zeros, w, e = _layer(1024, 2048, 128, dtype, "cuda", r=8, h=8)

    @torch.compile(fullgraph=True)
    def f(x):
        return w4a16_linear(x, w, None, e) * 2.0

    for m in (3, 200):
        x = torch.randn(m, 2048, device="cuda").to(dtype)
        assert_close(f(x), 2.0 * _expect(x, codes, scales, zeros, 128, None, e), dtype, f"compiled M={m}")


def test_programmatic_dependent_launch_is_refused_off_the_gpu():
    """set_pdl needs Triton's griddepcontrol on a GPU; the interpreter (CI) refuses it and stays off."""
    from spear.kernels import _common

    if not _common.INTERPRET:
        pytest.skip("the interpreter's refusal")
    for mode in (True, "wait", "trigger"):
        with pytest.raises(ValueError, match="programmatic dependent launch"):
            _common.set_pdl(mode)
    assert _common.pdl() == dict(PDL=0)
    with pytest.raises(ValueError, match="PDL mode"):
        _common.set_pdl("sometimes")
    _common.set_pdl("off")
    assert _common.pdl() == dict(PDL=0)
