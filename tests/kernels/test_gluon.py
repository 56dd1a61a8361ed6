"""The warp-specialized Gluon W4A16 GEMM (spear/kernels/gluon_w4.py).

Gluon does not run under Triton's interpreter. On the CPU: the schedule's arithmetic (units,
K splits) against a plain enumeration, and a compile of the kernel for sm_90 (PTX: register-A
wgmma, no weight tile stored to shared memory in the main loop, partitions with register
budgets). Marked ``gpu``: every weight variant at odd shapes and Llama-3-8B's shapes against the
fp32 reference, with and without a K split, bias and SiLU·mul, fp16 and bf16."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch

from spear.kernels import ec as ec_kernels
from spear.kernels import gluon_w4 as G
from spear.kernels import reference as ref
from spear.kernels.layout import Layout
from spear.kernels.planner import target
from tests.kernels._helpers import DEVICE, assert_close, make_ec, setup_case

ON_HOPPER = DEVICE == "cuda" and target(torch.device("cuda")).gluon


# ---------------------------------------------------------------------------- the schedule (CPU)
@pytest.mark.parametrize("steps", [1, 2, 5, 31, 64, 224])
@pytest.mark.parametrize("n_split", [1, 2, 3, 4, 7, 16])
def test_split_ranges_cover_every_step_once(steps, n_split):
    covered = []
    for s in range(n_split):
        lo, hi = G.split_range(s, steps, n_split)
        assert 0 <= lo <= hi <= steps
        covered += list(range(lo, hi))
    assert covered == list(range(steps))


@pytest.mark.parametrize("rows,overhead", [(16, 2), (64, 6), (128, 12), (256, 24)])
@pytest.mark.parametrize("tiles,steps,programs", [(16, 64, 132), (112, 64, 132), (256, 64, 132), (16, 224, 132),
                                                  (1, 4, 132), (1, 1, 132), (32, 3, 264), (33, 64, 132),
                                                  (96, 32, 132), (96, 112, 132), (64, 112, 132)])
def test_pick_split_takes_the_shortest_critical_path(tiles, steps, programs, rows, overhead):
    """Against an enumeration of every split: the chosen one has the fewest K steps (plus the split's
    overhead: 2 steps for small tiles, 12 per 128 rows) on the busiest program of the persistent grid
    (ties: the smallest split), no split shorter than two steps unless K itself is, and none empty."""
    def valid(s):
        per = -(-steps // s)
        return (s == 1 or per >= 2) and (s - 1) * per < steps

    def cost(s):
        return -(-(tiles * s) // programs) * (-(-steps // s) + (overhead if s > 1 else 0))

    s = G.pick_split(tiles, steps, programs, rows)
    assert valid(s)
    best = min((cost(c), c) for c in range(1, 65) if valid(c))
    assert (cost(s), s) == best


def test_a_split_of_128_row_tiles_pays_for_its_reduction():
    """The measured cases (H100, 2026-12-07): q/o and down at 300 tokens (3 x 32 tiles of 128 rows) run
    unsplit, down at 256 tokens (2 x 32 tiles, 112 steps) keeps its split of 2 and at 128 tokens its 4,
    and tiles of 16 rows still split where one wave would leave most SMs idle."""
    assert G.pick_split(96, 32, 132, 128) == 1
    assert G.pick_split(96, 112, 132, 128) == 1
    assert G.pick_split(64, 112, 132, 128) == 2
    assert G.pick_split(32, 112, 132, 128) == 4
    assert G.pick_split(32, 32, 132, 16) == 4


def test_units_enumerate_each_tile_and_split_once():
    cfg = G.GluonConfig(BNC=64, BM=32, BK=64, stages=4, split_k=3)
    m, n = 70, 300
    mt, nt, nu = G.units(m, n, cfg)
    assert (mt, nt) == (3, 3) and nu == 27
    seen = {G.unit_of(u, mt, cfg.split_k) for u in range(nu)}
    assert seen == {(a, b, c) for a in range(mt) for b in range(nt) for c in range(3)}
    # the splits of one tile are consecutive units; the tiles of one weight slab consecutive tiles
    assert [G.unit_of(u, mt, 3) for u in range(4)] == [(0, 0, 0), (0, 0, 1), (0, 0, 2), (1, 0, 0)]


@pytest.mark.parametrize("kw", [dict(BNC=32), dict(BM=512), dict(BK=256), dict(stages=1), dict(split_k=0),
                                dict(BNC=128, BM=256)])
def test_config_refuses_what_the_kernel_cannot_run(kw):
    base = dict(BNC=128, BM=128, BK=64, stages=4)
    with pytest.raises(ValueError):
        G.GluonConfig(**{**base, **kw})


# ---------------------------------------------------------------------------- sm_90 compile (CPU)
@pytest.mark.skipif(not G.HAVE_GLUON, reason="this Triton has no Gluon")
def test_compiles_for_hopper():
    """The kernel compiles for sm_90 in fp16 and bf16 (runs ptxas); its PTX has the register-A
    wgmma, 16-byte shared loads of the words, no store to shared memory inside the main loop, and
    the partitions' register budgets."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run([sys.executable, "-m", "tests.kernels._compile_gluon"], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-2000:] + proc.stderr[-4000:]


# ---------------------------------------------------------------------------- GPU
def _run(m, n, k, gs, sym, dtype, cfg, bias=True, act=0, seed=0, ec=None):
    x, w, b, e, expect = setup_case(m, k, n, gs, sym, dtype, seed, bias=bias, layout=Layout.FRAGMENT, ec=ec)
    v = None if e is None else ec_kernels.ec_gate(x, e)
    out = G.gluon_w4a16(x, w, b, cfg, act=act, ec=e, v=v)
    if act:
        expect = ref.silu_mul_pairs(expect)
    assert_close(out, expect, dtype, f"gluon M={m} {n}x{k} g={gs} sym={sym} {dtype} {cfg} act={act}")
    assert int(w.locks.abs().sum()) == 0, "the K split left a counter set"


# N not a multiple of either tile height (17 and 33 16-row tiles); K of 5 BK = 128 steps, or (groups of
# 32, 64, per channel) 4.5, the last step half past K
ODD = [(1, 272, 576), (3, 272, 576), (17, 528, 640), (65, 272, 576), (129, 528, 1088), (257, 272, 576),
       (1000, 528, 640)]
WEIGHTS = [(128, False, torch.float16), (128, True, torch.bfloat16), (64, False, torch.bfloat16),
           (32, False, torch.float16), (32, True, torch.bfloat16), (0, False, torch.float16), (0, True, torch.bfloat16)]


# The compiled kernel's shared memory ("Required" of Triton's OutOfResources) for BN=128 BM=256
# BK=128, 3 stages, groups of 128, beside a compensator of rank 16, 32, 64 (H100, 2026-12-06)
COMPILED_SMEM = {16: 242_880, 32: 271_552, 64: 304_576}


@pytest.mark.parametrize("rank", sorted(COMPILED_SMEM))
def test_shared_memory_estimate_bounds_the_compiled_kernel(rank):
    cfg = G.GluonConfig(64, 256, 128, 3, 3)
    est = G.gluon_smem(cfg, 128, rank)
    assert COMPILED_SMEM[rank] <= est <= 1.06 * COMPILED_SMEM[rank]
    fitted = G.fit_gluon(cfg, 128, rank)
    assert fitted == G.GluonConfig(64, 256, 128, 2, 3)  # none of the three fit at 3 stages, all at 2
    assert G.gluon_smem(fitted, 128, rank) <= G.GLUON_SMEM_LIMIT < est


def test_a_compensator_takes_ring_stages():
    """(The plan's side of it: tests/kernels/test_policy.py.)"""
    assert G.fit_gluon(G.GluonConfig(64, 256, 128, 2), 128, 256) is None  # v tiles of 256 KB
    w = types.SimpleNamespace(layout=Layout.FRAGMENT, group_size=128)
    with pytest.raises(ValueError, match="2 stages fit"):
        G.check(torch.zeros(1, 64, dtype=torch.float16), w, G.GluonConfig(64, 256, 128, 3), rank=16)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU and Gluon")
@pytest.mark.parametrize("m,n,k", ODD)
@pytest.mark.parametrize("gs,sym,dtype", WEIGHTS)
def test_gpu_odd_shapes(poisoned, m, n, k, gs, sym, dtype):
    """N not a multiple of the tile, K not of BK = 128, M past the tile: every weight variant, with
    a K split and without, one config of each tile shape."""
    if gs and k % gs:
        k = 640  # groups of 128 divide in_features
    for cfg in (G.GluonConfig(128, 64 if m <= 64 else 128, 64, 4, 1), G.GluonConfig(64, 128, 128, 4, 3),
                G.GluonConfig(64, 256, 64, 3, 2)):
        _run(m, n, k, gs, sym, dtype, cfg, seed=m)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU and Gluon")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [5, 130])
def test_gpu_silu_mul_and_no_bias(poisoned, dtype, m):
    _run(m, 528, 640, 128, False, dtype, G.GluonConfig(128, 128, 64, 4, 2), bias=False, act=1, seed=m)
    _run(m, 528, 640, 0, True, dtype, G.GluonConfig(64, 128, 128, 4, 1), bias=True, act=1, seed=m + 1)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU and Gluon")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("r,h,act", [(16, 16, 0), (32, None, 1), (64, 32, 0)])
@pytest.mark.parametrize("m", [3, 65, 257])
def test_gpu_compensator_epilogue(poisoned, dtype, r, h, act, m):
    """alpha · v Bᵀ in the epilogue (v from ec_gate), with and without a K split and SiLU·mul."""
    n, k = 528, 640
    for cfg in (G.GluonConfig(128, 128, 64, 4, 1), G.fit_gluon(G.GluonConfig(64, 256, 128, 3, 3), 128, r)):
        _run(m, n, k, 128, False, dtype, cfg, act=act, seed=m, ec=make_ec(n, k, r, h, dtype, seed=m))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU and Gluon")
@pytest.mark.parametrize("n,k", [(4096, 4096), (28672, 4096), (4096, 14336)])
@pytest.mark.parametrize("m", [16, 128, 256, 1024])
def test_gpu_real_shapes(poisoned, n, k, m):
    bm = min(128, max(16, 1 << (m - 1).bit_length()))
    tiles = -(-m // bm) * -(-n // 256)
    cfg = G.GluonConfig(128, bm, 64, 4, G.pick_split(tiles, k // 64, 132))
    _run(m, n, k, 128, False, torch.float16, cfg, seed=m)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU and Gluon")
def test_gpu_graph_replays_leave_counters_zero(poisoned):
    """Replays of a captured call with a K split give the same output each time."""
    from tests.kernels._helpers import capture

    x, w, b, _, expect = setup_case(64, 4096, 4096, 128, False, torch.float16, 3, layout=Layout.FRAGMENT)
    cfg = G.GluonConfig(128, 64, 64, 4, 8)
    graph, out = capture(lambda: G.gluon_w4a16(x, w, b, cfg))
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, expect, torch.float16, "graph replay")
    assert int(w.locks.abs().sum()) == 0
