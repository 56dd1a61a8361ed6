"""The W4 kernels over the N-major fallback layout against the fp32 torch reference (the fragment
layout: test_fragment.py; the compensator forms: test_ec_kernels.py): odd M, group sizes, sym/asym,
fp16/bf16, bias, split-K, the one-token loop, SiLU·mul, dequantize. Outputs and workspaces start as NaN.

On the CPU these run through TRITON_INTERPRET=1 at small shapes (conftest.py); the tests
marked ``gpu`` repeat them at real Llama shapes.
"""

from __future__ import annotations

import pytest
import torch

from spear.kernels import reference as ref
from spear.kernels.ec import ec_gate, ec_up
from spear.kernels.dequant import dequantize
from spear.kernels.launch import TritonConfig as Config
from spear.kernels.layout import LOCK_SLOTS, Layout, pack, pack_ec, unpack
from spear.kernels.ops import w4a16_linear
from spear.kernels.w4a16 import w4a16_matmul
from tests.kernels._helpers import (DEVICE, INTERPRET, K_SMALL, N_SMALL, assert_close, make_ec, make_layer,
                                   setup_case)

def test_pack_roundtrip_and_footprint():
    codes, scales, zeros = make_layer(64, 256, 128, False, 0)
    w = pack(codes, scales, zeros, 128, layout=Layout.NMAJOR)
    c, s, z = unpack(w)
    assert torch.equal(c, codes) and torch.equal(s, scales) and torch.equal(z, zeros)
    bits = 8 * sum(t.numel() * t.element_size() for t in (w.qweight, w.scales, w.zeros)) / codes.numel()
    assert bits <= 4.25, f"{bits:.3f} bits per weight at group 128"
    assert w.locks.shape == (LOCK_SLOTS,) and int(w.locks.abs().sum()) == 0


# (M, group, symmetric, dtype, bias, config): decode tiles with split-K 1/2/3, prefill-like tiles
GEMM_CASES = [
    (1, 0, True, torch.float16, False, Config(16, 64, 128, 1, 4, 2)),
    (3, 32, False, torch.float16, True, Config(16, 64, 32, 3, 4, 2)),
    (17, 64, True, torch.bfloat16, True, Config(16, 64, 64, 2, 4, 2)),
    (33, 128, False, torch.bfloat16, False, Config(16, 32, 128, 2, 4, 2)),
    (33, 0, False, torch.bfloat16, True, Config(32, 64, 64, 1, 4, 2)),
    (17, 128, True, torch.float16, False, Config(64, 64, 64, 1, 4, 2)),
    (1, 64, False, torch.bfloat16, False, None),
    (33, 32, True, torch.float16, True, None),
    # the one-token loop on CUDA cores (mv=1), an empty last split of K among them
    (1, 128, False, torch.float16, True, Config(16, 32, 128, 2, 4, 2, mv=1)),
    (1, 0, True, torch.bfloat16, False, Config(16, 64, 128, 1, 4, 2, mv=1)),
    (1, 32, False, torch.bfloat16, True, Config(16, 64, 32, 3, 4, 2, mv=1)),
]


@pytest.mark.parametrize("m,gs,sym,dtype,bias,cfg", GEMM_CASES)
def test_w4a16_gemm(poisoned, m, gs, sym, dtype, bias, cfg):
    x, w, b, _, expect = setup_case(m, K_SMALL, N_SMALL, gs, sym, dtype, seed=m + gs, bias=bias)
    out = w4a16_matmul(x, w, b, config=cfg)
    assert_close(out, expect, dtype, f"W4 M={m} g={gs} sym={sym} {dtype} cfg={cfg}")
    assert int(w.locks.abs().sum()) == 0, "split-K counters not re-armed"


# SiLU·mul epilogue over interleaved (gate, up) pairs: (M, EC: 0 none, 1 fused, 2 from v, config);
# N = 96 leaves the last tile's pairs half masked
ACT_CASES = [
    (1, 1, Config(16, 64, 64, 2, 4, 2, mv=1)),
    (1, 0, Config(16, 64, 64, 1, 4, 2, mv=1)),
    (3, 2, Config(16, 64, 32, 3, 4, 2)),
    (17, 0, Config(16, 64, 64, 2, 4, 2)),
    (33, 2, Config(32, 64, 64, 1, 4, 2)),
    (5, 1, None),
]


@pytest.mark.parametrize("m,ec_mode,cfg", ACT_CASES)
def test_silu_mul_epilogue(poisoned, m, ec_mode, cfg):
    gs = 32 if m == 3 else 64
    ec = make_ec(N_SMALL, K_SMALL, 16, 16, torch.float16, seed=m) if ec_mode else None
    x, w, b, e, expect = setup_case(m, K_SMALL, N_SMALL, gs, False, torch.float16, seed=m, ec=ec)
    v = ec_gate(x, e) if ec_mode == 2 else None
    out = w4a16_matmul(x, w, b, e, v=v, config=cfg, act=1)
    assert_close(out, ref.silu_mul_pairs(expect), torch.float16, f"SiLU·mul M={m} ec_mode={ec_mode} cfg={cfg}")
    assert int(w.locks.abs().sum()) == 0
    with pytest.raises(ValueError, match="even out_features"):
        w4a16_matmul(x[:, :], pack(*make_layer(95, K_SMALL, gs, False, 0), gs), act=1)


@pytest.mark.parametrize("gs,dtype", [(0, torch.bfloat16), (32, torch.float16)])
def test_dequantize(poisoned, gs, dtype):
    codes, scales, zeros = make_layer(N_SMALL, K_SMALL, gs, False, 5)
    w_hat = dequantize(pack(codes, scales, zeros, gs, layout=Layout.NMAJOR), dtype)
    expect = ref.dequantize(codes, scales, zeros, gs).to(dtype)
    if INTERPRET and dtype == torch.bfloat16:
        # the interpreter truncates fp32 -> bf16 (the GPU rounds to nearest even): one ulp
        torch.testing.assert_close(w_hat.float(), expect.float(), rtol=2**-7, atol=0)
    else:
        assert torch.equal(w_hat, expect), "dequantize must round W_hat exactly as the reference"


def test_launcher_errors():
    codes, scales, zeros = make_layer(64, 128, 32, True, 0)
    with pytest.raises(ValueError, match="4-bit codes"):
        pack(codes * 2, scales, zeros, 32)
    with pytest.raises(ValueError, match="group_size"):
        pack(codes, scales, zeros, 48)
    with pytest.raises(ValueError, match="symmetric"):
        pack(codes, scales, zeros + 1, 32, symmetric=True)
    w = pack(codes, scales, zeros, 32, layout=Layout.NMAJOR)
    torch.manual_seed(0)
    x = torch.randn(2, 64, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="in_features=128"):
        w4a16_matmul(x, w)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        w4a16_matmul(torch.randn(2, 128, device=DEVICE), w)
    with pytest.raises(ValueError, match="BK=64 must divide"):
        w4a16_matmul(torch.randn(2, 128, dtype=torch.float16, device=DEVICE), w, config=Config(16, 64, 64, 1, 4, 2))
    with pytest.raises(ValueError, match="one-token loop"):
        w4a16_matmul(torch.randn(3, 128, dtype=torch.float16, device=DEVICE), w, config=Config(16, 64, 32, 1, 4, 2, mv=1))
    with pytest.raises(ValueError, match="mv is 0"):
        Config(16, 64, 32, 1, 4, 2, mv=2)
    with pytest.raises(ValueError, match="rank"):
        pack_ec(torch.randn(200, 128), torch.randn(64, 200), 1.0, torch.float16)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_kernels_compile_for_hopper(dtype):
    """Every constexpr variant the dispatcher uses type-checks and assembles for sm_90 (no GPU needed)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "tests.kernels._compile_check", dtype], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


# Real shapes (q/o and down of Llama-2-7B / Llama-3-8B) on the GPU, same checks.
GPU_SHAPES = [(4096, 4096, 128, False, torch.float16), (4096, 14336, 0, True, torch.bfloat16),
              (11008, 4096, 64, False, torch.bfloat16)]


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,gs,sym,dtype", GPU_SHAPES)
@pytest.mark.parametrize("m", [1, 7, 16, 33, 257, 1000])
def test_gpu_real_shapes(poisoned, n, k, gs, sym, dtype, m):
    if DEVICE != "cuda":
        pytest.skip("needs CUDA")
    ec = make_ec(n, k, 32, 32, dtype, seed=1)
    x, w, b, e, expect = setup_case(m, k, n, gs, sym, dtype, seed=m, ec=ec)
    x_, w_, b_, _, expect_w4 = setup_case(m, k, n, gs, sym, dtype, seed=m)
    assert_close(w4a16_matmul(x_, w_, b_), expect_w4, dtype, f"W4 {n}x{k} M={m}")
    if m <= 64:
        outs = [w4a16_matmul(x, w, b, e) for _ in range(3)]
        assert_close(outs[0], expect, dtype, f"fused {n}x{k} M={m}")
        assert all(torch.equal(outs[0], o) for o in outs[1:]), "fused kernel not deterministic: race?"
        assert int(w.locks.abs().sum()) == 0
    v = ec_gate(x, e)
    assert_close(ec_up(w4a16_matmul(x, w, b), v, e), expect, dtype, f"semi-fused {n}x{k} M={m}")
    assert_close(w4a16_matmul(x, w, b, e, v=v), expect, dtype, f"v-epilogue {n}x{k} M={m}")


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,gs,sym", [(4096, 4096, 128, False), (4096, 11008, 0, True), (11008, 4096, 64, False)])
def test_gpu_ptx_decode_loop(poisoned, n, k, gs, sym):
    """The one-token loop's fp16x2 PTX word product (fp16 on CUDA only), plain and fused EC."""
    if DEVICE != "cuda":
        pytest.skip("needs CUDA: the interpreter cannot run PTX")
    ec = make_ec(n, k, 32, 32, torch.float16, seed=2)
    x, w, b, e, expect = setup_case(1, k, n, gs, sym, torch.float16, seed=1, ec=ec)
    x_, w_, b_, _, expect_w4 = setup_case(1, k, n, gs, sym, torch.float16, seed=1)
    # split 16 of K = 11008 (86 steps of 128) leaves the last split an empty K range
    for split in (1, 8, 16):
        cfg = Config(16, 64, min(128, gs or 128), split, 4, 1, mv=1)
        assert_close(w4a16_matmul(x_, w_, b_, config=cfg), expect_w4, torch.float16, f"PTX W4 {n}x{k} {cfg}")
        assert_close(w4a16_matmul(x, w, b, e, config=cfg), expect, torch.float16, f"PTX fused {n}x{k} {cfg}")
        assert int(w.locks.abs().sum()) == 0
    # activations not 16-byte aligned (a column slice): the loop falls back to its fp32 form
    x_off = torch.zeros(1, k + 1, dtype=x_.dtype, device=x_.device)[:, 1:]
    x_off.copy_(x_)
    assert_close(w4a16_matmul(x_off, w_, b_, config=Config(16, 64, min(128, gs or 128), 8, 4, 1, mv=1)),
                 expect_w4, torch.float16, "unaligned activations")
    # large activations: fp16 products must not overflow
    x_big = x_.clone()
    x_big[:, :16] = 3000.0
    ref_big = ref.w4a16_ec_packed(x_big, w_, b_)
    assert_close(w4a16_matmul(x_big, w_, b_, config=Config(16, 64, min(128, gs or 128), 8, 4, 1, mv=1)),
                 ref_big, torch.float16, "PTX outliers")


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,gs,sym,dtype", GPU_SHAPES)
@pytest.mark.parametrize("m", [1, 3, 7, 16, 33, 257])
def test_gpu_real_shapes_dispatched(poisoned, n, k, gs, sym, dtype, m):
    """The N-major layout through the op's dispatch (every path: the one-token loop, tensor-core
    tiles, dequantize + cuBLAS)."""
    if DEVICE != "cuda":
        pytest.skip("needs CUDA")
    ec = make_ec(n, k, 32, 32, dtype, seed=1)
    x, w, b, e, expect = setup_case(m, k, n, gs, sym, dtype, seed=m, ec=ec)
    x_, w_, b_, _, expect_w4 = setup_case(m, k, n, gs, sym, dtype, seed=m)
    assert_close(w4a16_linear(x_, w_, b_), expect_w4, dtype, f"N-major W4 {n}x{k} M={m}")
    assert_close(w4a16_linear(x, w, b, e), expect, dtype, f"N-major W4+EC {n}x{k} M={m}")
    assert int(w.locks.abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 7, 33, 257])
@pytest.mark.parametrize("with_ec", [False, True])
@pytest.mark.parametrize("layout", list(Layout))
def test_gpu_silu_mul_epilogue(poisoned, m, with_ec, layout):
    """The op with act = 1 at a gate/up shape (interleaved 2 x 11008 features) through every dispatch path."""
    if DEVICE != "cuda":
        pytest.skip("needs CUDA")
    n, k, gs = 22016, 4096, 128
    ec = make_ec(n, k, 32, 32, torch.float16, seed=3) if with_ec else None
    x, w, b, e, expect = setup_case(m, k, n, gs, False, torch.float16, seed=m, ec=ec, layout=layout)
    assert_close(w4a16_linear(x, w, b, e, act=1), ref.silu_mul_pairs(expect), torch.float16,
                 f"SiLU·mul {n}x{k} M={m} EC={with_ec}")
    assert int(w.locks.abs().sum()) == 0
