"""The prefill W4 GEMM (spear/kernels/w4a16_prefill.py) against the fp32 reference, on the
interpreter at small shapes: both packed layouts, per-channel and grouped scales, symmetric and
asymmetric zero points, bias, the SiLU·mul epilogue, odd token counts and a column mask."""

import pytest
import torch

from spear.kernels import reference as ref
from spear.kernels.w4a16_prefill import PrefillConfig, w4a16_prefill_matmul
from tests.kernels._helpers import assert_close, setup_case

SMALL = PrefillConfig(BM=32, BN=64, BK=32, num_warps=4, num_stages=1, GROUP_M=2)


@pytest.mark.parametrize("m", [1, 17, 70])
@pytest.mark.parametrize("gs,sym,kmajor,dtype", [
    (0, True, True, torch.float16), (32, False, True, torch.float16), (64, True, False, torch.bfloat16),
    (0, False, False, torch.float16), (128, False, True, torch.bfloat16),
])
def test_prefill_gemm_equals_the_reference(m, gs, sym, kmajor, dtype, poisoned):
    """Catches: the K-major nibble order or word stride wrong, a group's scale from the wrong step,
    per-channel scales applied twice, the row / column masks, the grouped program order."""
    k = 256 if kmajor else 192  # N-major: K a multiple of 32 and 64 but not of 128
    x, w, bias, _, expect = setup_case(m, k, 96, gs, sym, dtype, seed=m + gs, bias=True, kmajor=kmajor)
    out = w4a16_prefill_matmul(x, w, bias, config=SMALL)
    assert_close(out, expect, dtype, f"M={m} g{gs} {'sym' if sym else 'asym'} {'K' if kmajor else 'N'}-major")


@pytest.mark.parametrize("kmajor", [True, False])
def test_prefill_gemm_silu_mul_epilogue(kmajor, poisoned):
    x, w, bias, _, expect = setup_case(33, 256, 128, 64, True, torch.float16, seed=3, bias=True, kmajor=kmajor)
    out = w4a16_prefill_matmul(x, w, bias, config=SMALL, act=1)
    assert_close(out, ref.silu_mul_pairs(expect), torch.float16, "act 1")


def test_prefill_gemm_refuses_what_it_cannot_take():
    x, w, _, _, _ = setup_case(4, 256, 96, 64, True, torch.float16, seed=0, bias=False, kmajor=True)
    with pytest.raises(ValueError, match="BK=48"):
        w4a16_prefill_matmul(x, w, config=PrefillConfig(BK=48))
    with pytest.raises(ValueError, match="x must be 2-D fp16/bf16"):
        w4a16_prefill_matmul(x.float(), w)
    with pytest.raises(ValueError, match="in_features"):
        w4a16_prefill_matmul(x[:, :128], w)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [128, 512, 2048])
@pytest.mark.parametrize("n,k", [(4096, 4096), (28672, 4096), (4096, 14336)])
def test_prefill_gemm_at_llama_shapes(m, n, k):
    """The built-in prefill launch at Llama-3-8B's layer shapes on the GPU, K-major g128 as served."""
    from spear.kernels.launch import BUILTIN

    e = BUILTIN["prefill_mm"]
    cfg = PrefillConfig(e["BM"], e["BN"], e["BK"], e["num_warps"], e["num_stages"])
    x, w, bias, _, expect = setup_case(m, k, n, 128, False, torch.float16, seed=1, bias=True, kmajor=True)
    assert_close(w4a16_prefill_matmul(x, w, bias, config=cfg), expect, torch.float16, f"{n}x{k} M={m}")
