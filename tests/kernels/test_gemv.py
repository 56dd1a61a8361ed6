"""The K-major decode GEMV against the fp32 reference (CPU: Triton interpreter, small shapes)."""

import pytest
import torch

from spear.kernels import reference
from spear.kernels.gemv import KMAJOR_NIBBLE_K, GemvConfig, from_packed, pack_kmajor, w4_gemv
from spear.kernels.layout import pack, unpack
from tests.kernels._helpers import DEVICE, assert_close, make_layer


@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("group_size,symmetric", [(0, True), (32, False), (64, True), (128, False)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gemv_matches_reference(poisoned, m, group_size, symmetric, dtype):
    n, k = 80, 256  # N not a multiple of BN: masked columns
    codes, scales, zeros = make_layer(n, k, group_size, symmetric, seed=m + group_size)
    w = pack_kmajor(codes, scales, zeros, group_size, symmetric)
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 0.5).to(dtype).to(DEVICE)
    ref = reference.w4a16_ec(x, codes, scales, zeros, group_size)
    # fp16: packed fp16 products (PTX on CUDA, the Triton form in the interpreter) and the exact fp32 loop
    # (bf16 always takes the fp32 loop: one configuration covers it)
    cfgs = (GemvConfig(BN=64, BK=32, split_k=1, num_warps=2), GemvConfig(BN=32, BK=32, split_k=4, num_warps=1),
            GemvConfig(BN=32, BK=32, split_k=2, num_warps=1, half=False))
    for cfg in cfgs if dtype == torch.float16 else cfgs[1:2]:
        out = w4_gemv(x, w, cfg)
        assert_close(out, ref, dtype, f"m={m} g={group_size} sym={symmetric} {cfg}")
        assert int(w.locks.abs().sum()) == 0, "split-K counters must be re-armed"


def test_kmajor_layout_holds_the_same_codes():
    codes, scales, zeros = make_layer(48, 64, 32, False, seed=3)
    kw = from_packed(pack(codes, scales, zeros, 32))
    direct = pack_kmajor(codes, scales, zeros, 32)
    assert torch.equal(kw.qweight_t, direct.qweight_t)
    qt = kw.qweight_t.to(torch.int64) & 0xFFFFFFFF
    nib = [(qt >> (4 * i)) & 0xF for i in range(8)]
    rebuilt = torch.stack([nib[KMAJOR_NIBBLE_K.index(koff)] for koff in range(8)], dim=1).reshape(64, 48).t()
    assert torch.equal(rebuilt.to(torch.uint8), codes)
    assert torch.equal(unpack(pack(codes, scales, zeros, 32))[0], codes)


def test_gemv_rejects_bad_inputs():
    codes, scales, zeros = make_layer(32, 64, 0, True, seed=0)
    w = pack_kmajor(codes, scales, zeros, 0, True)
    with pytest.raises(ValueError, match="1..4 tokens"):
        w4_gemv(torch.zeros(5, 64, dtype=torch.float16, device=DEVICE), w)
    with pytest.raises(ValueError, match="features"):
        w4_gemv(torch.zeros(1, 32, dtype=torch.float16, device=DEVICE), w)
    with pytest.raises(ValueError, match="symmetric"):
        pack_kmajor(codes, scales, torch.full_like(zeros, 7), 0, True)


def test_fp16_path_survives_large_activations(poisoned):
    """Products are formed in fp16: outlier activations (thousands) must not overflow."""
    codes, scales, zeros = make_layer(32, 128, 0, False, seed=5)
    w = pack_kmajor(codes, scales, zeros, 0)
    x = torch.randn(1, 128, generator=torch.Generator().manual_seed(0))
    x[0, :8] = 6000.0
    x = x.half().to(DEVICE)
    out = w4_gemv(x, w, GemvConfig(BN=32, BK=32, split_k=2, num_warps=1))
    assert_close(out, reference.w4a16_ec(x, codes, scales, zeros, 0), torch.float16, "outliers")
