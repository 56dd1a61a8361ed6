"""The registered op ``spear::w4a16_ec``: CPU fallback, the kernels the planner names, CUDA graphs,
torch.compile, programmatic dependent launch."""

from __future__ import annotations

import pytest
import torch

from spear.kernels import ops
from spear.kernels import reference as ref
from spear.kernels.layout import Layout, pack, pack_ec
from spear.kernels.ops import w4a16_linear
from spear.kernels.planner import EC, plan
from spear.kernels.policy import KernelPolicy
from tests.kernels._helpers import DEVICE, assert_close, capture, make_ec, make_layer


def _layer(n, k, gs, dtype, device, r=16, h=16, seed=0, layout=None):
    codes, scales, zeros = make_layer(n, k, gs, False, seed, device)
    w = pack(codes, scales, zeros, gs, layout=layout)
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
    w = pack(codes, scales, zeros, 32, layout=Layout.NMAJOR)
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
    assert "[] policy" in schema and "pdl" in schema


def test_cpu_fallback_under_any_policy():
    """Off CUDA every policy and PDL level gives the fp32 reference (the policy only picks CUDA paths)."""
    codes, scales, zeros, w, e = _layer(64, 128, 32, torch.float16, "cpu")
    x = torch.randn(7, 128, generator=torch.Generator().manual_seed(2)).half()
    expect = w4a16_linear(x, w, None, e)
    assert_close(expect, _expect(x, codes, scales, zeros, 32, None, e), torch.float16, "default policy")
    for policy in (KernelPolicy(fused_max_m=0, nmajor_cublas_min_m=1, fragment_cublas_min_m=1, semi_fused_overlap=False),
                   KernelPolicy(launch_table={"fragment": {"16": dict(BM=16, BN=32, BK=64, num_warps=4, num_stages=2,
                                                                      programs=64)}})):
        assert torch.equal(w4a16_linear(x, w, None, e, policy=policy), expect)
    assert torch.equal(w4a16_linear(x, w, None, e, pdl=1), expect)


def _need_cuda():
    if DEVICE != "cuda":
        pytest.skip("needs CUDA")


DEFAULT = KernelPolicy()
# overlap off and nothing fused: every EC call takes ec_gate first, then the GEMM's v-epilogue
# (below the cuBLAS threshold) or dequantize + cuBLAS and ec_up
SERIAL = KernelPolicy(semi_fused_overlap=False, fused_max_m=0)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 5, DEFAULT.fused_max_m, DEFAULT.fused_max_m + 1, DEFAULT.fragment_cublas_min_m - 1,
                               DEFAULT.fragment_cublas_min_m, 300, 2048])
@pytest.mark.parametrize("policy", [DEFAULT, SERIAL], ids=["default", "serial"])
@pytest.mark.parametrize("layout", list(Layout))
def test_gpu_dispatch(poisoned, m, policy, layout):
    _need_cuda()
    dtype = torch.float16
    codes, scales, zeros, w, e = _layer(4096, 4096, 128, dtype, "cuda", r=32, h=32, layout=layout)
    if policy is SERIAL:
        assert plan(m, 4096, 4096, e.kernel_rank, w.format, torch.device("cuda"), policy).ec is EC.SEMI
    torch.manual_seed(m)
    x = torch.randn(m, 4096, device="cuda").to(dtype)
    bias = torch.randn(4096, device="cuda").to(dtype)
    assert_close(w4a16_linear(x, w, bias, e, policy=policy), _expect(x, codes, scales, zeros, 128, bias, e), dtype,
                 f"op M={m}")
    assert_close(w4a16_linear(x, w, bias, policy=policy), _expect(x, codes, scales, zeros, 128, bias, None), dtype,
                 f"W4 M={m}")
    assert int(w.locks.abs().sum()) == 0


@pytest.mark.gpu
def test_gpu_two_policies_in_one_process_take_their_own_paths(poisoned, monkeypatch):
    """The op under two policies, calls interleaved: the kernels each call launches (and the GEMM's
    tile width, from each policy's launch table) are the ones its own policy plans."""
    _need_cuda()
    calls = []
    real = dict(mm=ops.w4a16_matmul, dq=ops.dequantize, gate=ops.ec_kernels.ec_gate, up=ops.ec_kernels.ec_up)

    def spy(name, fn, bn=False):
        def wrapped(*args, **kw):
            ec = args[3] if len(args) > 3 else kw.get("ec")
            mode = 0 if ec is None else (2 if kw.get("v") is not None else 1)
            calls.append((name, mode, kw["config"].BN) if bn else (name,))
            return fn(*args, **kw)
        return wrapped

    monkeypatch.setattr(ops, "w4a16_matmul", spy("gemm", real["mm"], bn=True))
    monkeypatch.setattr(ops, "dequantize", spy("dequant", real["dq"]))
    monkeypatch.setattr(ops.ec_kernels, "ec_gate", spy("ec_gate", real["gate"]))
    monkeypatch.setattr(ops.ec_kernels, "ec_up", spy("ec_up", real["up"]))
    a = KernelPolicy()
    b = KernelPolicy(fused_max_m=8, nmajor_cublas_min_m=32, semi_fused_overlap=False,
                     launch_table={"nmajor": {"16": dict(BM=16, BN=32, BK=128, num_warps=4, num_stages=3, programs=512)}})
    dtype = torch.float16
    codes, scales, zeros, w, e = _layer(1024, 1024, 128, dtype, "cuda", r=16, h=16, layout=Layout.NMAJOR)
    side = [("ec_gate",), ("dequant",), ("ec_up",)]
    expect = {(a, 16, True): [("gemm", 1, 64)], (b, 16, True): [("ec_gate",), ("gemm", 2, 32)],
              (a, 48, True): [("gemm", 1, 64)], (b, 48, True): side,
              (a, 16, False): [("gemm", 0, 64)], (b, 16, False): [("gemm", 0, 32)],
              (a, 48, False): [("gemm", 0, 64)], (b, 48, False): [("dequant",)],
              (a, 200, True): side, (b, 200, True): side}
    for _ in range(2):
        for (policy, m, with_ec), launched in expect.items():
            x = torch.randn(m, 1024, generator=torch.Generator().manual_seed(m)).to(dtype).cuda()
            ec = e if with_ec else None
            calls.clear()
            y = w4a16_linear(x, w, None, ec, policy=policy)
            what = f"fused_max_m={policy.fused_max_m} M={m} EC={with_ec}"
            assert calls == launched, f"{what}: launched {calls}, expected {launched}"
            assert_close(y, _expect(x, codes, scales, zeros, 128, None, ec), dtype, what)
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
def _fake_like(t):
    """A fake CUDA tensor of t's shape and dtype (inside a FakeTensorMode)."""
    return torch.empty(t.shape, dtype=t.dtype, device="cuda")


@pytest.mark.parametrize("layout", list(Layout))
def test_op_traces_with_a_symbolic_token_count(layout):
    """vLLM compiles with a dynamic token dimension: under FakeTensorMode with an unbacked SymInt
    token count and fake CUDA tensors (what torch.compile(dynamic=True) hands the op), the W4 and
    W8 ops give their output's shape and dtype without planning a launch on the symbol (which
    raised TypeError: unhashable type: non-nested SymInt from the plan cache)."""
    import dataclasses

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from spear.kernels.w8a16 import w8a16_linear

    codes, scales, zeros = make_layer(64, 256, 128, False, 0, "cpu")
    w = pack(codes, scales, zeros, 128, layout=layout)
    e = pack_ec(**make_ec(64, 256, 8, 8, torch.float16, 0, "cpu"))
    shape_env = ShapeEnv()
    with FakeTensorMode(shape_env=shape_env):
        m = shape_env.create_unbacked_symint()
        x = torch.empty(m, 256, dtype=torch.float16, device="cuda")
        wf = dataclasses.replace(w, **{f: _fake_like(getattr(w, f)) for f in ("qweight", "scales", "zeros", "locks")})
        ef = dataclasses.replace(e, **{f: _fake_like(getattr(e, f)) for f in ("a", "b", "w1", "b1", "w2", "b2")})
        for ec, act, n_out in ((None, 0, 64), (ef, 0, 64), (ef, 1, 32)):
            y = w4a16_linear(x, wf, None, ec, act)
            assert tuple(y.shape) == (m, n_out) and y.dtype == torch.float16 and y.device.type == "cuda"
        y3 = w4a16_linear(torch.empty(2, m, 256, dtype=torch.float16, device="cuda"), wf)
        assert tuple(y3.shape) == (2, m, 64)
        y8 = w8a16_linear(x, torch.empty(32, 256, dtype=torch.int8, device="cuda"),
                          torch.empty(32, dtype=torch.float32, device="cuda"))
        assert tuple(y8.shape) == (m, 32) and y8.dtype == torch.float16


def test_op_under_torch_compile_with_dynamic_shapes():
    """torch.compile(dynamic=True, fullgraph=True) over the op (the CPU build: the op's reference
    path at run time; a backend that runs dynamo's graph as traced, so no C++ toolchain is
    needed): one graph for every token count, the results those of eager calls."""
    codes, scales, zeros = make_layer(64, 256, 64, False, 3, "cpu")
    w = pack(codes, scales, zeros, 64, layout=Layout.FRAGMENT)
    e = pack_ec(**make_ec(64, 256, 8, 8, torch.float16, 3, "cpu"))
    torch._dynamo.reset()
    frames = []

    def backend(gm, example_inputs):
        frames.append(gm)
        return gm.forward

    @torch.compile(dynamic=True, fullgraph=True, backend=backend)
    def f(x):
        return w4a16_linear(x, w, None, e) * 2.0

    for m in (3, 17, 40):
        x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).half()
        assert torch.equal(f(x), 2.0 * w4a16_linear(x, w, None, e))
    assert len(frames) == 1, f"{len(frames)} graphs for three token counts: the token dimension is not dynamic"
    assert any("spear.w4a16_ec" in str(n.target) for n in frames[0].graph.nodes), "the op is not one node"


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


def test_programmatic_dependent_launch_is_refused_off_the_gpu(poisoned):
    """PDL is a launch level, 0 or 1, that each launcher takes from its caller; level 1 needs
    Triton's griddepcontrol on a GPU, so the interpreter (CI) refuses it at every launcher."""
    from spear.kernels import _common, attention, fused, w8a16
    from spear.kernels.w4a16 import w4a16_matmul

    if not _common.INTERPRET:
        pytest.skip("the interpreter's refusal")
    assert _common.pdl_args(0) == dict(PDL=0)
    for level in (2, -1, 0.5, "wait"):
        with pytest.raises(ValueError, match="the PDL level is 0"):
            _common.pdl_args(level)
    codes, scales, zeros, w, _ = _layer(64, 128, 32, torch.float16, DEVICE, r=0)
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(0)).half().to(DEVICE)
    g = torch.randn(2, 64, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    q8 = torch.randint(-128, 128, (64, 128), generator=torch.Generator().manual_seed(2), dtype=torch.int8).to(DEVICE)
    q = torch.zeros(2, 4, 16, device=DEVICE)
    kc = torch.zeros(5, 8, 2, 16, device=DEVICE)
    tables, lens = torch.zeros(2, 3, dtype=torch.long, device=DEVICE), torch.ones(2, dtype=torch.long, device=DEVICE)
    launches = {
        "w4a16_matmul": lambda pdl: w4a16_matmul(x, w, pdl=pdl),
        "w8a16_matmul": lambda pdl: w8a16.w8a16_matmul(x, q8, torch.ones(64, device=DEVICE), pdl=pdl),
        "rms_norm": lambda pdl: fused.rms_norm(g, torch.ones(64, device=DEVICE), 1e-6, pdl=pdl),
        "add_rms_norm": lambda pdl: fused.add_rms_norm(g, g, torch.ones(64, device=DEVICE), 1e-6, pdl=pdl),
        "silu_mul": lambda pdl: fused.silu_mul(g, g, pdl=pdl),
        "silu_mul_pairs": lambda pdl: fused.silu_mul_pairs(g, pdl=pdl),
        "paged_decode_attention": lambda pdl: attention.paged_decode_attention(q, kc, kc, tables, lens, 0.25, pdl=pdl),
    }
    for name, launch in launches.items():
        assert torch.isfinite(launch(0) if name != "add_rms_norm" else launch(0)[1]).all(), name
        with pytest.raises(ValueError, match="programmatic dependent launch needs"):
            launch(1)
    assert_close(w4a16_matmul(x, w), _expect(x, codes, scales, zeros, 32, None, None), torch.float16, "pdl 0")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 300])
def test_gpu_programmatic_dependent_launch(poisoned, m):
    """The op at PDL level 1 (Hopper): the same output as level 0, eagerly and replayed from a CUDA graph."""
    _need_cuda()
    from spear.kernels import _common

    if not _common.PDL_AVAILABLE or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs griddepcontrol (Triton) and a Hopper GPU")
    dtype = torch.float16
    codes, scales, zeros, w, e = _layer(4096, 4096, 128, dtype, "cuda", r=16, h=16)
    x = torch.randn(m, 4096, generator=torch.Generator().manual_seed(m)).to(dtype).cuda()
    expect = _expect(x, codes, scales, zeros, 128, None, e)
    assert_close(w4a16_linear(x, w, None, e, pdl=1), expect, dtype, f"PDL M={m}")
    graph, y = capture(lambda: w4a16_linear(x, w, None, e, pdl=1))
    graph.replay()
    torch.cuda.synchronize()
    assert_close(y, expect, dtype, f"PDL graph replay M={m}")
    assert int(w.locks.abs().sum()) == 0
