"""The registered op ``spear::w4a16_ec``: CPU fallback, dispatch by M, CUDA graphs, torch.compile."""

from __future__ import annotations

import pytest
import torch

from spear.kernels import ops, pack, pack_ec, w4a16_linear
from spear.kernels import reference as ref
from tests.kernels._helpers import DEVICE, assert_close, make_ec, make_layer


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


@pytest.mark.parametrize("act", [0, 1])
@pytest.mark.parametrize("with_bias", [True, False])
def test_prefill_ec_addmm_is_the_reference(poisoned, with_bias, act):
    """PREFILL_EC "addmm" (serial form; the kernels in the interpreter, cuBLAS's part as torch on the CPU):
    y = x Ŵᵀ + (alpha · v Bᵀ + bias), the EC term added through addmm's input."""
    if DEVICE != "cpu":
        pytest.skip("the GPU form is test_gpu_dispatch")
    dtype = torch.float16
    codes, scales, zeros, w, e = _layer(64, 128, 32, dtype, "cpu", r=16, h=16, seed=3)
    x = torch.randn(ops.DEQUANT_MM_MIN_M + 3, 128).to(dtype)
    bias = torch.randn(64).to(dtype) if with_bias else None
    got = ops._semi_fused_addmm(x, w, bias, e, overlap=False, act=act)
    expect = _expect(x, codes, scales, zeros, 32, bias, e)
    assert_close(got, ref.silu_mul_pairs(expect) if act else expect, dtype, f"addmm bias={with_bias} act={act}")


def test_an_unknown_prefill_ec_mode_is_refused(monkeypatch):
    _, _, _, w, e = _layer(64, 128, 0, torch.float16, "cpu")
    monkeypatch.setattr(ops, "PREFILL_EC", "fused")
    with pytest.raises(ValueError, match=r"PREFILL_EC must be one of \('ec_up', 'addmm'\)"):
        ops._semi_fused(torch.randn(200, 128).half(), w, None, e, overlap=False)


def test_op_is_registered_as_a_triton_op():
    assert hasattr(torch.ops.spear, "w4a16_ec")
    schema = str(torch.ops.spear.w4a16_ec.default._schema)
    assert "Tensor? ec_a" in schema and "float alpha" in schema


def _need_cuda():
    if DEVICE != "cuda":
        pytest.skip("needs CUDA")


@pytest.mark.gpu
@pytest.mark.parametrize("m,prefill_ec", [(1, "ec_up"), (5, "ec_up"), (ops.FUSED_MAX_M, "ec_up"),
                                          (ops.FUSED_MAX_M + 1, "ec_up"), (300, "ec_up"), (2048, "ec_up"),
                                          (300, "addmm"), (2048, "addmm")])
@pytest.mark.parametrize("overlap", [True, False])
def test_gpu_dispatch(poisoned, monkeypatch, m, prefill_ec, overlap):
    _need_cuda()
    monkeypatch.setattr(ops, "SEMI_FUSED_OVERLAP", overlap)
    monkeypatch.setattr(ops, "PREFILL_EC", prefill_ec)
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
@pytest.mark.parametrize("m,prefill_ec", [(4, "ec_up"), (600, "ec_up"), (600, "addmm")])
def test_gpu_cuda_graph_replay(monkeypatch, m, prefill_ec):
    """Capture the op (fused at small M, side stream at large M), replay on new inputs."""
    _need_cuda()
    monkeypatch.setattr(ops, "PREFILL_EC", prefill_ec)
    dtype = torch.bfloat16
    codes, scales, zeros, w, e = _layer(4096, 4096, 64, dtype, "cuda", r=16, h=16)
    x = torch.randn(m, 4096, device="cuda").to(dtype)
    w4a16_linear(x, w, None, e)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = w4a16_linear(x, w, None, e)
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
