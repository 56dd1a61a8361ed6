"""The fragment layout (``Layout.FRAGMENT``) and its tensor-core GEMM against the fp32 reference:
every packed layout spear makes (symmetric / asymmetric, groups 32 / 64 / 128 and per-channel,
fp16 and bf16), odd token counts, split-K, bias, the compensator fused and as a v-epilogue,
SiLU·mul. Outputs and workspaces start as NaN. Interpreter at small shapes in CI; the tests
marked ``gpu`` repeat them at Llama-3-8B's shapes."""

from __future__ import annotations

import itertools

import pytest
import torch

from spear.kernels import launch
from spear.kernels import reference as ref
from spear.kernels.dequant import dequantize
from spear.kernels.launch import TritonConfig
from spear.kernels.layout import Layout, layout_for, pack, unpack
from spear.kernels.ops import w4a16_linear
from spear.kernels.w4a16 import w4a16_matmul
from tests.kernels._helpers import DEVICE, assert_close, make_ec, make_layer, setup_case

N, K = 48, 256  # three 16-row tiles (a 32-wide tile leaves half of one masked), four 64-input blocks
LAYOUT_CASES = list(itertools.product((torch.float16, torch.bfloat16), (True, False), (32, 64, 128, 0)))


@pytest.mark.parametrize("n,k", [(16, 64), (48, 192), (32, 512)])
def test_pack_roundtrip(n, k):
    codes, scales, zeros = make_layer(n, k, 32, False, 0, "cpu")
    w = pack(codes, scales, zeros, 32, layout=Layout.FRAGMENT)
    assert w.layout is Layout.FRAGMENT and (w.out_features, w.in_features) == (n, k) and w.qweight.shape == (n // 16, 2 * k)
    c, s, z = unpack(w)
    assert torch.equal(c, codes) and torch.equal(s, scales) and torch.equal(z, zeros)


def test_pack_places_each_code_in_its_lane_word():
    """Code (row 16 t + 8 j0 + g, k 64 kb + 16 c + 8 j1 + 2 q + h) sits in word 128 kb + 4 (4 g + q) + c
    of tile row t, nibble (2 j1 + j0) + 4 h (layout.py's docstring, written out by hand)."""
    n, k = 32, 128
    for (t, j0, g, kb, c, j1, q, h) in [(0, 0, 0, 0, 0, 0, 0, 0), (1, 1, 7, 1, 3, 1, 3, 1), (0, 1, 2, 0, 1, 0, 2, 1)]:
        codes = torch.zeros(n, k, dtype=torch.uint8)
        codes[16 * t + 8 * j0 + g, 64 * kb + 16 * c + 8 * j1 + 2 * q + h] = 11
        w = pack(codes, torch.ones(n, 1, dtype=torch.float16), torch.full((n, 1), 8, dtype=torch.uint8), 0, True,
                 layout=Layout.FRAGMENT)
        words = w.qweight.to(torch.int64) & 0xFFFFFFFF
        nz = words.nonzero().tolist()
        assert nz == [[t, 128 * kb + 4 * (4 * g + q) + c]]
        assert int(words[t, nz[0][1]]) == 11 << (4 * (2 * j1 + j0 + 4 * h))


def test_pack_refuses_shapes_the_layout_cannot_take():
    codes, scales, zeros = make_layer(40, 128, 32, False, 0, "cpu")
    with pytest.raises(ValueError, match="multiple of 16"):
        pack(codes, scales, zeros, 32, layout=Layout.FRAGMENT)
    with pytest.raises(ValueError, match="layout must be a Layout"):
        pack(codes, scales, zeros, 32, layout="fragment")
    # every other shape the kernels take packs N-major (the fallback), which pack picks by itself
    assert pack(codes, scales, zeros, 32).layout is Layout.NMAJOR
    assert [layout_for(n, k) for n, k in ((40, 128), (48, 96), (48, 192), (16, 64))] == \
        [Layout.NMAJOR, Layout.NMAJOR, Layout.FRAGMENT, Layout.FRAGMENT]
    assert [Layout.of_id(x.id) for x in Layout] == list(Layout)


@pytest.mark.parametrize("dtype,sym,gs", LAYOUT_CASES)
def test_dequantize(poisoned, dtype, sym, gs):
    codes, scales, zeros = make_layer(N, K, gs, sym, gs + 1)
    w_hat = dequantize(pack(codes, scales, zeros, gs, sym, layout=Layout.FRAGMENT), dtype)
    expect = ref.dequantize(codes, scales, zeros, gs).to(dtype)  # rounded once, as the kernel rounds it
    assert torch.equal(w_hat.cpu(), expect.cpu()), f"g={gs} sym={sym} {dtype}"


# every layout at one odd token count each (M 1, 3, 17, 65, 129, 257 in turn), with a launch that
# covers it: a 16/32/64-token tile, split-K 1-3, BK 64 or 128 (groups of 128 and per-channel only)
M_CYCLE = (1, 3, 17, 65, 129, 257)


def _launch(m, gs, i):
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    bk = 128 if gs in (0, 128) and i % 2 else 64
    return TritonConfig(bm, 32 if i % 3 == 0 else 16, bk, 1 + i % 3, 4, 2)


@pytest.mark.parametrize("case", range(len(LAYOUT_CASES)))
def test_gemm_every_layout(poisoned, case):
    dtype, sym, gs = LAYOUT_CASES[case]
    m = M_CYCLE[case % len(M_CYCLE)]
    x, w, b, _, expect = setup_case(m, K, N, gs, sym, dtype, seed=case, bias=case % 2 == 0, layout=Layout.FRAGMENT)
    cfg = _launch(m, gs, case)
    out = w4a16_matmul(x, w, b, config=cfg)
    assert_close(out, expect, dtype, f"fragment M={m} g={gs} sym={sym} {dtype} {cfg}")
    assert int(w.locks.abs().sum()) == 0, "split-K counters not re-armed"


# the compensator on the new loop: fused (ec_mode 1, u programs in the launch) and the v-epilogue
# (ec_mode 2, as the semi-fused path runs it); gated and static; with SiLU·mul on interleaved pairs
EC_CASES = [(1, 1, 16, 16, 0, torch.float16), (3, 1, 8, None, 1, torch.bfloat16), (17, 1, 32, 32, 0, torch.float16),
            (65, 2, 16, 16, 0, torch.bfloat16), (129, 2, 8, None, 1, torch.float16)]


@pytest.mark.parametrize("m,ec_mode,r,h,act,dtype", EC_CASES)
def test_compensator_on_the_fragment_loop(poisoned, m, ec_mode, r, h, act, dtype):
    ec = make_ec(N, K, r, h, dtype, seed=m)
    x, w, b, e, expect = setup_case(m, K, N, 128, False, dtype, seed=m, ec=ec, layout=Layout.FRAGMENT)
    v = None
    if ec_mode == 2:
        v = ref.ec_gate(x.float() @ e.a.float().t(), e.w1, e.b1, e.w2, e.b2, e.bound).to(dtype)
    cfg = TritonConfig(16 if m <= 16 else (32 if m <= 32 else 64), 16, 64, 2, 4, 2)
    out = w4a16_matmul(x, w, b, e, v=v, config=cfg, act=act)
    if act:
        expect = ref.silu_mul_pairs(expect)
    assert_close(out, expect, dtype, f"fragment EC mode {ec_mode} M={m} r={r} h={h} act={act}")
    assert int(w.locks.abs().sum()) == 0, "counters not re-armed"


def test_launch_classes():
    """pick_triton takes the fragment family's launch by token class, with split-K from its
    programs; BK 128 only where no group ends inside a step."""
    classes = launch.FRAGMENT_CLASSES
    assert [launch.token_class(m, classes) for m in (1, 16, 17, 64, 65, 128, 200, 256, 257, 4096)] == \
        ["16", "16", "32", "64", "128", "128", "256", "256", "big", "big"]
    for m in (1, 5, 16, 33, 100, 200, 3000):
        cfg = launch.pick_triton(m, 4096, 4096, True, 128)
        e = launch.BUILTIN["fragment"][launch.token_class(m, classes)]
        assert (cfg.BM, cfg.BN, cfg.num_warps, cfg.mv) == (e.BM, e.BN, e.num_warps, 0)
        if not e.programs:
            assert cfg.split_k == 1
    # 16 tokens: 64 column tiles x split 8 >= the entry's 264 programs
    assert launch.pick_triton(16, 4096, 4096, True, 128).split_k == 8
    assert launch.pick_triton(16, 4096, 4096, True, 32).BK == 64  # groups of 32: 64-input steps
    tuned = launch.merged_table({"fragment": {"32": dict(BM=32, BN=128, BK=64, num_warps=8, num_stages=3)}})
    assert tuned["fragment"]["16"] == launch.BUILTIN["fragment"]["16"], "a class the table leaves out stays built in"
    assert launch.pick_triton(20, 4096, 4096, True, 128, tuned).num_warps == 8
    with pytest.raises(ValueError, match="token classes"):
        launch.merged_table({"fragment": {"8": dict(BM=16)}})
    with pytest.raises(ValueError, match="BK 64 or 128"):
        launch.merged_table({"fragment": {"16": dict(BM=16, BN=64, BK=32, num_warps=4, num_stages=2)}})


def test_gemm_rejects_launches_the_loop_cannot_take():
    x, w, _, _, _ = setup_case(2, K, N, 32, False, torch.float16, seed=0, bias=False, layout=Layout.FRAGMENT)
    for bad in (TritonConfig(16, 16, 128, 1, 4, 2), TritonConfig(16, 24, 64, 1, 4, 2),
                TritonConfig(16, 16, 32, 1, 4, 2), TritonConfig(16, 16, 64, 1, 4, 2, mv=1)):
        with pytest.raises(ValueError, match="fragment layout"):
            w4a16_matmul(x, w, config=bad)


# ---------------------------------------------------------------------------- GPU, real shapes
SHAPES_8B = [(4096, 4096), (28672, 4096), (4096, 14336)]


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("n,k", SHAPES_8B)
@pytest.mark.parametrize("m", [1, 3, 17, 65, 129, 257, 1024])
def test_gpu_real_shapes(poisoned, n, k, m):
    """The op as the engine dispatches it (the policy's launch for each M) at Llama-3-8B's shapes."""
    for dtype, sym, gs in ((torch.float16, False, 128), (torch.bfloat16, True, 128), (torch.float16, True, 0)):
        x, w, b, _, expect = setup_case(m, k, n, gs, sym, dtype, seed=m, layout=Layout.FRAGMENT)
        assert_close(w4a16_linear(x, w, b), expect, dtype, f"fragment {n}x{k} M={m} g={gs} {dtype}")


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 16, 48, 64, 65, 300])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_compensated(poisoned, m, dtype):
    """Fused (M <= 64) and semi-fused compensators on the fragment layout, as dispatched."""
    n, k = 4096, 4096
    ec = make_ec(n, k, 16, 16, dtype, seed=m)
    x, w, b, e, expect = setup_case(m, k, n, 128, False, dtype, seed=m, ec=ec, layout=Layout.FRAGMENT)
    assert_close(w4a16_linear(x, w, b, e), expect, dtype, f"fragment EC M={m} {dtype}")
