"""The W8A16 head GEMM (spear/kernels/w8a16.py) against its fp32 reference: odd M and N, K that the
tile does or does not divide, fp16/bf16, bias on/off, every launch class; outputs start as NaN.

On the CPU the kernel runs through TRITON_INTERPRET=1 at small shapes (conftest.py); the tests
marked ``gpu`` repeat it at the heads of Llama-2-7B and Llama-3-8B and under a CUDA graph.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from spear.kernels import reference as ref
from spear.kernels import w8a16 as w8
from spear.kernels.w8a16 import pack_w8, w8a16_linear, w8a16_matmul
from spear.quant.linear import QuantLinear
from spear.quant.primitives import dequantize, rtn
from tests.kernels._helpers import DEVICE, SQNR_FLOOR, assert_close, capture, sqnr_db


def make_w8(n: int, k: int, seed: int, device: str = DEVICE):
    """Random int8 weight over the full range, per-row scales around 1e-2 (none equal to 1)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scale = (0.5 + torch.rand(n, generator=g)) * 1e-2
    return q.to(device), scale.to(device)


def make_case(m, n, k, dtype, seed, bias=True, device=DEVICE):
    q, scale = make_w8(n, k, seed, device)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, k, generator=g).to(dtype).to(device)
    # bias of the output's order of magnitude: leaving it out fails the comparison
    b = (torch.randn(n, generator=g) * 4).to(dtype).to(device) if bias else None
    return x, q, scale, b


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k", [64, 256])
@pytest.mark.parametrize("n", [100, 257])
@pytest.mark.parametrize("m", [1, 3, 16, 17, 33])
def test_w8a16_gemm(poisoned, m, n, k, dtype, bias):
    x, q, scale, b = make_case(m, n, k, dtype, seed=m + n + k)
    out = w8a16_matmul(x, q, scale, b)
    assert out.dtype == dtype
    assert_close(out, ref.w8a16(x, q, scale, b), dtype, f"W8 M={m} N={n} K={k} {dtype} bias={bias}")


# Every launch class at a token count inside it, and launches that the defaults do not reach at
# these shapes: a K that BK does not divide (masked K), several K steps for one token, CUDA-core
# tiles of several tokens (and of one token per program), tensor-core tiles wider than M
LAUNCH_CASES = [(m, None) for m in (1, 2, 5, 12, 64, 70)] + [
    (1, dict(BK=64, BN=64)),
    (1, dict(BK=32, BN=32, num_warps=2)),
    (3, dict(BM=1, dot=False)),
    (3, dict(BM=4, BN=32, BK=256, dot=False)),
    (4, dict(BM=4, BK=64, BN=16, dot=False)),
    (9, dict(BM=16, BN=32, BK=32, dot=True)),
    (20, dict(BM=64, BN=16, BK=16, dot=True)),
]


@pytest.mark.parametrize("k", [256, 80])
@pytest.mark.parametrize("m,cfg", LAUNCH_CASES)
def test_w8a16_launches(poisoned, m, cfg, k):
    dtype = torch.bfloat16 if m % 2 else torch.float16
    x, q, scale, b = make_case(m, 257, k, dtype, seed=m + k)
    assert_close(w8a16_matmul(x, q, scale, b, config=cfg), ref.w8a16(x, q, scale, b), dtype,
                 f"W8 M={m} K={k} cfg={cfg}")


def test_comparison_sees_the_scale_and_the_bias(poisoned):
    """The reference comparison fails for a kernel that dropped the per-row scale or the bias."""
    dtype = torch.float16
    for m in (1, 3, 17):
        x, q, scale, b = make_case(m, 100, 256, dtype, seed=7)
        out = w8a16_matmul(x, q, scale, b)
        assert_close(out, ref.w8a16(x, q, scale, b), dtype, f"M={m}")
        for what, wrong in (("no scale", ref.w8a16(x, q, torch.ones_like(scale), b)),
                            ("no bias", ref.w8a16(x, q, scale)),
                            ("one scale", ref.w8a16(x, q, scale.mean().expand_as(scale), b))):
            assert sqnr_db(wrong, out.float()) < SQNR_FLOOR[dtype] - 20, f"M={m}: output matches '{what}'"


def test_pack_w8_matches_quantlinear_dequantization():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 96, generator=g) * 0.05
    w[3] = 0.0  # an all-zero row (scale 1 by convention)
    codes, scales, zeros = rtn(w, 8, 0, symmetric=True)
    layer = QuantLinear(96, 48, bits=8, group_size=0, symmetric=True)
    layer.set_quantized(codes, scales, zeros)
    qweight, scale = pack_w8(layer.codes, layer.scales, layer.zeros)
    assert qweight.dtype == torch.int8 and qweight.shape == (48, 96) and qweight.is_contiguous()
    assert scale.dtype == torch.float32 and scale.shape == (48,)
    assert int(qweight.min()) >= -128 and int(qweight.max()) <= 127
    expect = dequantize(layer.codes, layer.scales, layer.zeros, 0)
    assert torch.equal(qweight.float() * scale[:, None], expect)
    assert torch.equal(layer.dequantized_weight(torch.float32), expect)
    # the extremes of the code range: 0 -> -128, 255 -> 127
    q, _ = pack_w8(torch.tensor([[0, 128, 255, 1] * 4], dtype=torch.uint8), torch.ones(1, 1, dtype=torch.float16))
    assert q[0, :4].tolist() == [-128, 0, 127, -127]


def test_bad_inputs_raise():
    torch.manual_seed(0)
    codes = torch.randint(0, 256, (8, 32), dtype=torch.uint8)
    scales = torch.rand(8, 1).half()
    with pytest.raises(ValueError, match="codes must be uint8"):
        pack_w8(codes.to(torch.int8), scales)
    with pytest.raises(ValueError, match="per-channel"):
        pack_w8(codes, torch.rand(8, 2).half())  # grouped scales
    with pytest.raises(ValueError, match="per-channel"):
        pack_w8(codes, torch.randint(1, 3, (8, 1)))
    with pytest.raises(ValueError, match="symmetric"):
        pack_w8(codes, scales, torch.full((8, 1), 127, dtype=torch.uint8))
    q, s = pack_w8(codes, scales)
    x = torch.randn(3, 32).half()
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        w8a16_matmul(x.float(), q, s)
    with pytest.raises(ValueError, match="qweight must be contiguous int8"):
        w8a16_matmul(x, codes, s)
    with pytest.raises(ValueError, match="scale must be contiguous fp32"):
        w8a16_matmul(x, q, s.half())
    with pytest.raises(ValueError, match="in_features=32"):
        w8a16_matmul(torch.randn(3, 48).half(), q, s)
    with pytest.raises(ValueError, match="multiple of 16"):
        w8a16_matmul(torch.randn(3, 40).half(), pack_w8(torch.zeros(8, 40, dtype=torch.uint8), scales)[0], s)
    with pytest.raises(ValueError, match="bias must be"):
        w8a16_matmul(x, q, s, torch.zeros(9).half())
    with pytest.raises(ValueError, match="unit stride"):
        w8a16_matmul(torch.randn(32, 3).half().t(), q, s)
    with pytest.raises(ValueError, match="unknown launch key"):
        w8a16_matmul(x, q, s, config=dict(BLOCK_N=32))
    with pytest.raises(ValueError, match="powers of 2"):
        w8a16_matmul(x, q, s, config=dict(BN=48))
    with pytest.raises(ValueError, match="in_features=32"):
        w8a16_linear(torch.randn(2, 5, 48).half(), q, s)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cpu_fallback_against_fp64(dtype):
    """The registered op on CPU tensors (its torch fallback) against x (q · scale)ᵀ + bias computed
    in fp64 from the int8 codes and fp32 scales.

    Catches: ``reference.w8a16`` returning ``y`` without the bias: the fallback is that reference, so
    the old test (fallback against the same reference, atol 0) passed."""
    q, scale = make_w8(64, 128, seed=3, device="cpu")
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 5, 128, generator=g).to(dtype)
    bias = (torch.randn(64, generator=g) * 4).to(dtype)  # as large as the output: leaving it out fails
    w = q.double() * scale.double()[:, None]
    expect = x.double() @ w.t() + bias.double()
    y = w8a16_linear(x, q, scale, bias)
    assert y.shape == (2, 5, 64) and y.dtype == dtype
    assert_close(y, expect, dtype, "with bias")
    assert_close(w8a16_linear(x, q, scale), x.double() @ w.t(), dtype, "no bias")
    assert w8a16_linear(torch.zeros(0, 128).to(dtype), q, scale).shape == (0, 64)


def test_launch_table_is_well_formed():
    assert sorted(w8.LAUNCH) == list(w8.LAUNCH)
    for key, e in w8.LAUNCH.items():
        assert set(e) == set(w8._KEYS), key
        # every class up to 64 tokens is one m-tile: the weight is read once
        assert e["BM"] >= key and e["BK"] % w8.K_STEP == 0, key
        assert not e["dot"] or min(e["BM"], e["BN"]) >= 16, key
    assert w8.pick_config(1)["BM"] == 1 and w8.pick_config(9)["BM"] == 16 and w8.pick_config(1000)["BM"] == 64


# Output heads of Llama-2-7B and Llama-3-8B
GPU_SHAPES = [(32000, 4096), (128256, 4096)]


def _need_cuda():
    if DEVICE != "cuda":
        pytest.skip("needs CUDA")


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", GPU_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 4, 16, 64])
def test_gpu_real_shapes(poisoned, n, k, dtype, m):
    _need_cuda()
    x, q, scale, b = make_case(m, n, k, dtype, seed=m)
    expect = ref.w8a16(x, q, scale, b)
    assert_close(w8a16_matmul(x, q, scale, b), expect, dtype, f"W8 {n}x{k} M={m} {dtype}")
    assert_close(w8a16_linear(x[None], q, scale, b)[0], expect, dtype, f"op {n}x{k} M={m} {dtype}")
    assert_close(w8a16_matmul(x, q, scale), ref.w8a16(x, q, scale), dtype, f"no bias {n}x{k} M={m}")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 16])
def test_gpu_cuda_graph_replay(m):
    """Capture the op, replay on new activations written into the captured input."""
    _need_cuda()
    dtype = torch.bfloat16
    n, k = GPU_SHAPES[0]
    x, q, scale, b = make_case(m, n, k, dtype, seed=5)
    graph, y = capture(lambda: w8a16_linear(x, q, scale, b))
    for seed in range(3):
        x.copy_(torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(y, ref.w8a16(x, q, scale, b), dtype, f"graph replay {seed} M={m}")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16])
def test_gpu_programmatic_dependent_launch(poisoned, m):
    """The op at PDL level 1 (Hopper) gives the level-0 result, eagerly and replayed from a CUDA graph."""
    _need_cuda()
    from spear.kernels import _common

    if not _common.PDL_AVAILABLE or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs griddepcontrol (Triton) and a Hopper GPU")
    dtype = torch.float16
    n, k = GPU_SHAPES[0]
    x, q, scale, b = make_case(m, n, k, dtype, seed=6)
    expect = ref.w8a16(x, q, scale, b)
    assert_close(w8a16_linear(x, q, scale, b, pdl=1), expect, dtype, f"PDL M={m}")
    graph, y = capture(lambda: w8a16_linear(x, q, scale, b, pdl=1))
    graph.replay()
    torch.cuda.synchronize()
    assert_close(y, expect, dtype, f"PDL graph replay M={m}")


# ---------------------------------------------------------------------------- sm_90 compile check


@pytest.mark.skipif(os.environ.get("SPEAR_COMPILE_CHECK") != "1",
                    reason="set SPEAR_COMPILE_CHECK=1 (compiles for sm_90 in a subprocess, ~15 s)")
def test_kernel_compiles_for_sm90():
    """Every launch class, both dtypes, masked K, PDL, compiled for Hopper; the weight tile's loads
    must stay 16 bytes wide (ld.global.v4 on CUDA cores, 16-byte cp.async into the tensor cores)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-2000:] + res.stderr[-4000:]


_COMPILE_SCRIPT = r"""
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from spear.kernels.w8a16 import LAUNCH, _w8a16_kernel as fn

def compile(cfg, dt, even_k, bias, pdl):
    ptrs = dict(x_ptr=dt, w_ptr="i8", scale_ptr="fp32", bias_ptr=dt if bias else "fp32", out_ptr=dt)
    consts = dict(HAS_BIAS=bias, EVEN_K=even_k, BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], DOT=cfg["dot"],
                  DOT_F32=False, PDL=pdl)
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        sig[name] = "*" + ptrs[name] if name in ptrs else ("constexpr" if name in consts else "i32")
        if name in ptrs or name in ("K", "stride_xm", "stride_om"):  # the launcher's K % 16 == 0
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, sig, consts, attrs)
    opts = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return triton.compile(src, target=GPUTarget("cuda", 90, 128), options=opts).asm["ptx"]

for m, cfg in LAUNCH.items():
    for dt in ("fp16", "bf16"):
        for even_k in (True, False):
            ptx = compile(cfg, dt, even_k, bias=even_k, pdl=1 if m == 1 and even_k else 0)
            wide = (r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10" if cfg["dot"]
                    else r"ld\.global(\.\w+)*\.v4\.b32")
            assert re.search(wide, ptx), f"M <= {m} {dt} even_k={even_k}: no 16-byte weight loads"
print("ok")
"""
