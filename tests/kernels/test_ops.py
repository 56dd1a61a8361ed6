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


# The N-major layout as spear/kernels/layout.py documents it: row n of qweight holds output n; word
# j covers k = 8j .. 8j+7, nibble i (bits 4i .. 4i+3) holding k = 8j + DOC_NIBBLE_K[i]; scales and
# zeros are stored transposed, (G, N).
DOC_NIBBLE_K = (0, 2, 1, 3, 4, 6, 5, 7)


def _dequantize_by_hand(w):
    """fp64 W_hat (N, K) from the packed words with integer shifts and masks, and the codes."""
    words = w.qweight.to(torch.int64) & 0xFFFFFFFF  # the int32 words as unsigned 32-bit values
    n, kw = words.shape
    codes = torch.empty(n, kw * 8, dtype=torch.int64)
    for i, koff in enumerate(DOC_NIBBLE_K):
        codes[:, koff::8] = (words >> (4 * i)) & 0xF
    gs = kw * 8 // w.scales.shape[0]
    zeros = w.zeros.t().to(torch.int64).repeat_interleave(gs, dim=1)
    scales = w.scales.t().double().repeat_interleave(gs, dim=1)
    return (codes - zeros).double() * scales, codes


def _layer_by_hand(x, w, bias, ec_params, dtype):
    """fp64 x W_hatᵀ + bias + α B (γ(Ax) ⊙ Ax) from the packed weight and the EC parameters as the
    packed EC stores them (rounded to ``dtype``)."""
    w_hat, _ = _dequantize_by_hand(w)
    x64 = x.reshape(-1, x.shape[-1]).double()
    y = x64 @ w_hat.t()
    if bias is not None:
        y = y + bias.double()
    if ec_params is not None:
        p = {k: v.to(dtype).double() if torch.is_tensor(v) else v for k, v in ec_params.items()}
        u = x64 @ p["a"].t()
        if "w1" in p:
            h = torch.nn.functional.silu(u @ p["w1"].t() + p["b1"])
            u = u * (1 + p["bound"] * torch.tanh(h @ p["w2"].t() + p["b2"]))
        y = y + p["alpha"] * (u @ p["b"].t())
    return y.reshape(*x.shape[:-1], -1)


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cpu_fallback_against_a_hand_dequantized_fp64_layer(gated, dtype):
    """The op on CPU tensors (its torch fallback) against the layer computed from the packed words
    by hand (documented nibble order, integer math) in fp64; the unpacked codes are the RTN codes.

    Catches: ``NIBBLE_K = (0, 1, 2, 3, 4, 5, 6, 7)`` in spear/kernels/layout.py: pack and unpack
    still agree, so the old test (fallback against the same unpacking reference, atol 0) passed."""
    codes, scales, zeros = make_layer(64, 128, 32, False, 0, "cpu")
    w = pack(codes, scales, zeros, 32)
    params = make_ec(64, 128, 16, 16 if gated else None, dtype, 0, "cpu")
    e = pack_ec(**params)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 128, generator=g).to(dtype)
    bias = torch.randn(64, generator=g).to(dtype)
    assert torch.equal(_dequantize_by_hand(w)[1], codes.long())
    y = w4a16_linear(x, w, bias, e)
    assert y.shape == (2, 5, 64) and y.dtype == dtype
    assert_close(y, _layer_by_hand(x, w, bias, params, dtype), dtype, "W4 + EC")
    assert_close(w4a16_linear(x, w), _layer_by_hand(x, w, None, None, dtype), dtype, "W4")


def test_op_edge_cases():
    torch.manual_seed(0)
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
    torch.manual_seed(m)
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
        torch.manual_seed(m)
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
