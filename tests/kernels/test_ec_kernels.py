"""The compensator inside the W4A16 kernel against the fp32 reference: fused (on each tile's
last split, or in EC programs of their own), semi-fused (ec_gate, ec_up, the v-epilogue),
both layouts, gated and not. Outputs and workspaces start as NaN.

On the CPU these run through TRITON_INTERPRET=1 at small shapes (conftest.py); the tests
marked ``gpu`` repeat them at real Llama shapes.
"""

from __future__ import annotations

import pytest
import torch

from spear.kernels import reference as ref
from spear.kernels.ec import ec_gate, ec_up
from spear.kernels.w4a16 import Config, pick_config, w4a16_matmul
from tests.kernels._helpers import DEVICE, K_SMALL, N_SMALL, assert_close, make_ec, setup_case


@pytest.mark.parametrize("m,gs,dtype,r,h,split,mv,prefetch", [(1, 64, torch.float16, 8, 12, 2, 1, False),
                                                               (2, 32, torch.float16, 8, None, 3, 2, True),
                                                               (5, 128, torch.bfloat16, 16, None, 2, 0, False)])
def test_fused_ec_kmajor(poisoned, m, gs, dtype, r, h, split, mv, prefetch):
    ec = make_ec(N_SMALL, K_SMALL, r, h, dtype, seed=r)
    x, w, b, e, expect = setup_case(m, K_SMALL, N_SMALL, gs, False, dtype, seed=m + r, ec=ec, kmajor=True)
    cfg = Config(16, 64, min(128, gs), split, 4, 2, mv=mv, prefetch=prefetch)
    for _ in range(2):
        out = w4a16_matmul(x, w, b, e, ec_mode=1, config=cfg)
        assert_close(out, expect, dtype, f"K-major fused EC M={m} g={gs} r={r} h={h}")
        assert int(w.locks.abs().sum()) == 0


# (M, group, symmetric, dtype, rank, gate hidden or None, split_k, mv, u_split)
FUSED_CASES = [
    (1, 0, True, torch.float16, 8, 12, 1, 0, 0),
    (3, 64, False, torch.bfloat16, 20, 16, 3, 0, 1),
    (17, 128, False, torch.float16, 16, None, 2, 0, 0),
    (1, 32, True, torch.bfloat16, 8, None, 4, 1, 3),
    (33, 0, False, torch.float16, 32, 32, 2, 0, 0),
    (2, 64, False, torch.float16, 16, 8, 2, 2, 0),
    (1, 64, True, torch.float16, 16, 16, 2, 1, 0),
    (3, 0, False, torch.bfloat16, 8, 8, 2, 4, 3),
]


@pytest.mark.parametrize("m,gs,sym,dtype,r,h,split,mv,u_split", FUSED_CASES)
def test_fused_ec(poisoned, m, gs, sym, dtype, r, h, split, mv, u_split):
    ec = make_ec(N_SMALL, K_SMALL, r, h, dtype, seed=r)
    x, w, b, e, expect = setup_case(m, K_SMALL, N_SMALL, gs, sym, dtype, seed=m + r, ec=ec)
    bk = min(64, gs or 64)
    cfg = Config(16, 64, bk, split, 4, 2, mv=mv, u_split=u_split)
    for _ in range(2):  # the second call checks that the counters were re-armed
        out = w4a16_matmul(x, w, b, e, ec_mode=1, config=cfg)
        assert_close(out, expect, dtype, f"fused EC M={m} g={gs} r={r} h={h} split={split}")
        assert int(w.locks.abs().sum()) == 0, "fused-EC counters not re-armed"


# (M, group, dtype, gate hidden or None, split_k, mv, K-major, act, EC tiles per program, EC programs last)
EC_PROGRAM_CASES = [
    (1, 64, torch.float16, 12, 2, 1, True, 0, 1, False),
    (1, 32, torch.float16, None, 1, 1, False, 0, 2, True),   # no split-K: the EC partial is the second
    (2, 64, torch.bfloat16, 8, 3, 2, True, 1, 2, True),      # SiLU·mul finished by an EC program
    (3, 0, torch.float16, None, 2, 4, False, 0, 4, False),
    (7, 128, torch.float16, 16, 2, 0, True, 0, 2, True),     # tensor-core tiles
]


@pytest.mark.parametrize("m,gs,dtype,h,split,mv,kmajor,act,ec_tiles,at_end", EC_PROGRAM_CASES)
def test_fused_ec_programs(poisoned, m, gs, dtype, h, split, mv, kmajor, act, ec_tiles, at_end):
    """The fused EC in programs of its own (Config.ec_tiles): with them last (at_end), the
    interpreter runs them after every W split, so they finish the tiles (epilogue included)."""
    ec = make_ec(N_SMALL, K_SMALL, 16, h, dtype, seed=m)
    x, w, b, e, expect = setup_case(m, K_SMALL, N_SMALL, gs, False, dtype, seed=m, ec=ec, kmajor=kmajor)
    if act:
        expect = ref.silu_mul_pairs(expect)
    bk = min(64, gs or 64)
    cfg = Config(16, 64, bk, split, 4, 2, mv=mv, ec_tiles=ec_tiles, ec_at_end=at_end)
    for _ in range(2):  # the second call checks that the counters were re-armed
        out = w4a16_matmul(x, w, b, e, ec_mode=1, config=cfg, act=act)
        assert_close(out, expect, dtype, f"EC programs M={m} g={gs} tiles={ec_tiles} end={at_end}")
        assert int(w.locks.abs().sum()) == 0, "counters not re-armed"
    with pytest.raises(ValueError, match="power of two"):
        w4a16_matmul(x, w, b, e, ec_mode=1, config=Config(16, 64, bk, split, 4, 2, mv=mv, ec_tiles=3))


@pytest.mark.parametrize("m,dtype,h", [(17, torch.float16, 12), (33, torch.bfloat16, None)])
def test_semi_fused_ec(poisoned, m, dtype, h):
    ec = make_ec(N_SMALL, K_SMALL, 8, h, dtype, seed=3)
    x, w, b, e, expect = setup_case(m, K_SMALL, N_SMALL, 64, False, dtype, seed=m, ec=ec)
    v = ec_gate(x, e)
    u = x.float() @ e.a.float().t()
    assert_close(v, ref.ec_gate(u, e.w1, e.b1, e.w2, e.b2, e.bound), dtype, "ec_gate")
    cfg = Config(32, 64, 64, 1, 4, 2)
    out = ec_up(w4a16_matmul(x, w, b, config=cfg), v, e)
    assert_close(out, expect, dtype, "W4 then ec_up")
    out = w4a16_matmul(x, w, b, e, ec_mode=2, v=v, config=cfg)
    assert_close(out, expect, dtype, "W4 with v epilogue")


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,gs", [(4096, 4096, 128), (22016, 4096, 128), (4096, 11008, 0)])
@pytest.mark.parametrize("m", [1, 3, 7, 16])
@pytest.mark.parametrize("ec_tiles,at_end", [(1, False), (2, False), (4, False), (2, True)])
def test_gpu_fused_ec_programs(poisoned, n, k, gs, m, ec_tiles, at_end):
    """The fused EC in programs of its own at real shapes, through the decode launches, K-major:
    right, deterministic over repeats (a race would show), counters re-armed."""
    if DEVICE != "cuda":
        pytest.skip("needs CUDA")
    ec = make_ec(n, k, 16, 16, torch.float16, seed=4)
    x, w, b, e, expect = setup_case(m, k, n, gs, True, torch.float16, seed=m, ec=ec, kmajor=True)
    c = pick_config(m, n, k, gs, kmajor=True)
    cfg = Config(c.BM, c.BN, c.BK, c.split_k, c.num_warps, c.num_stages, mv=c.mv, prefetch=c.prefetch,
                 ec_tiles=ec_tiles, ec_at_end=at_end)
    outs = [w4a16_matmul(x, w, b, e, ec_mode=1, config=cfg) for _ in range(3)]
    assert_close(outs[0], expect, torch.float16, f"EC programs {n}x{k} M={m} tiles={ec_tiles} end={at_end}")
    assert all(torch.equal(outs[0], o) for o in outs[1:]), "EC programs not deterministic: race?"
    assert int(w.locks.abs().sum()) == 0
