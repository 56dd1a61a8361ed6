"""The compensator inside the W4A16 kernel against the fp32 reference: fused (on each tile's
last split, or in EC programs of their own), semi-fused (ec_gate, ec_up, the v-epilogue),
gated and not, over the N-major layout's loops (the fragment layout's: test_fragment.py). Outputs and workspaces start as NaN.

On the CPU these run through TRITON_INTERPRET=1 at small shapes (conftest.py); the tests
marked ``gpu`` repeat them at real Llama shapes.
"""

from __future__ import annotations

import pytest
import torch

from spear.kernels.layout import pack_ec, padded_dim
from spear.kernels import reference as ref
from spear.kernels.ec import ec_gate, ec_up
from spear.kernels.launch import TritonConfig as Config
from spear.kernels.w4a16 import w4a16_matmul
from tests.kernels._helpers import DEVICE, K_SMALL, N_SMALL, allocations, assert_close, make_ec, setup_case


# (M, group, symmetric, dtype, rank, gate hidden or None, split_k, mv, u_split)
FUSED_CASES = [
    (1, 0, True, torch.float16, 8, 12, 1, 0, 0),
    (3, 64, False, torch.bfloat16, 20, 16, 3, 0, 1),
    (17, 128, False, torch.float16, 16, None, 2, 0, 0),
    (1, 32, True, torch.bfloat16, 8, None, 4, 1, 3),
    (33, 0, False, torch.float16, 32, 32, 2, 0, 0),
    (1, 64, False, torch.float16, 16, 8, 2, 1, 0),
    (1, 64, True, torch.float16, 16, 16, 2, 1, 0),
    (1, 0, False, torch.bfloat16, 8, 8, 2, 1, 3),
]


@pytest.mark.parametrize("m,gs,sym,dtype,r,h,split,mv,u_split", FUSED_CASES)
def test_fused_ec(poisoned, m, gs, sym, dtype, r, h, split, mv, u_split):
    ec = make_ec(N_SMALL, K_SMALL, r, h, dtype, seed=r)
    x, w, b, e, expect = setup_case(m, K_SMALL, N_SMALL, gs, sym, dtype, seed=m + r, ec=ec)
    bk = min(64, gs or 64)
    cfg = Config(16, 64, bk, split, 4, 2, mv=mv, u_split=u_split)
    for _ in range(2):  # the second call checks that the counters were re-armed
        out = w4a16_matmul(x, w, b, e, config=cfg)
        assert_close(out, expect, dtype, f"fused EC M={m} g={gs} r={r} h={h} split={split}")
        assert int(w.locks.abs().sum()) == 0, "fused-EC counters not re-armed"


# rank and gate width 64 and more: a 64-wide gate made a Hopper wgmma (N = 16 tokens) that read
# shared memory out of bounds (Triton 3.6); 48 pads to 64 (a merged q/k/v of three rank-16 ECs)
WIDE_GATES = [(1, 48, 48, 1), (3, 64, 64, 0), (16, 64, 64, 0), (33, 128, 128, 0), (1, 64, 16, 1), (40, 64, 16, 0),
              (40, 16, 64, 0)]


@pytest.mark.parametrize("m,r,h,mv", WIDE_GATES)
def test_wide_gates(poisoned, m, r, h, mv):
    """Gated ECs of rank / gate width 48-128 through the fused kernel (the decode token classes) and
    through ec_gate split over K (prefill) equal the reference. On an H200 with the rank-major gate
    products the fused launch at M = 3, r = h = 64 faulted (illegal address) and ec_gate's finish
    kernel read shared memory out of bounds; on the CPU this checks the token-major gate's algebra
    (a transposed W1 or W2 fails it) and that rank and gate width pad to one size (square gate
    products, the only shapes seen clean under compute-sanitizer)."""
    n, k = (N_SMALL, K_SMALL) if DEVICE == "cpu" else (6144, 4096)
    ec = make_ec(n, k, r, h, torch.float16, seed=r + h)
    x, w, b, e, expect = setup_case(m, k, n, 128, False, torch.float16, seed=m + r, ec=ec)
    side = padded_dim(max(r, h))  # rank and gate width padded alike: square gate products
    assert e.a.shape[0] == e.w1.shape[0] == e.w1.shape[1] == e.w2.shape[0] == side and e.rank == r
    cfg = Config(64 if m > 32 else 16, 64, 128, 2, 4, 2, mv=mv)
    for _ in range(2):
        out = w4a16_matmul(x, w, b, e, config=cfg)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        assert_close(out, expect, torch.float16, f"fused EC M={m} r={r} h={h}")
    xs = torch.randn(100, k, generator=torch.Generator().manual_seed(r)).half().to(DEVICE)
    u = xs.float() @ e.a.float().t()
    for splits in (1, 2):
        assert_close(ec_gate(xs, e, splits=splits), ref.ec_gate(u, e.w1, e.b1, e.w2, e.b2, e.bound), torch.float16,
                     f"ec_gate r={r} h={h} splits={splits}")


@pytest.mark.parametrize("m,k,splits,dtype,h", [(17, 256, 1, torch.float16, 12), (17, 256, 3, torch.float16, 12),
                                                 (33, 512, 4, torch.bfloat16, None), (1, 256, 2, torch.float16, 8)])
def test_ec_gate_split_over_k(poisoned, m, k, splits, dtype, h):
    """ec_gate with K split into shares (fp32 workspace, then the gate) equals the reference; the
    shares are uneven where the splits do not divide K's steps. Fails if a share is dropped."""
    from spear.kernels import ec as ec_mod

    e = pack_ec(**make_ec(N_SMALL, k, 8, h, dtype, seed=5))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + k + splits)).to(dtype).to(DEVICE)
    u = x.float() @ e.a.float().t()
    expect = ref.ec_gate(u, e.w1, e.b1, e.w2, e.b2, e.bound) if h else u
    assert_close(ec_gate(x, e, splits=splits), expect, dtype, f"ec_gate M={m} K={k} splits={splits}")
    # the split count the launcher picks: more programs at few token tiles, each with >= GATE_MIN_STEPS,
    # rounded down to a power of two (a constexpr: few compiled variants)
    assert ec_mod.gate_splits(512, 11008) == 8 and ec_mod.gate_splits(4096, 4096) == 1
    assert ec_mod.gate_splits(64, 14336) == 16  # min(264 // 4, 112 // 4) = 28 -> 16
    assert ec_mod.gate_splits(64, 14336, programs=40) == 8  # 40 // 4 = 10 -> 8


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
    out = w4a16_matmul(x, w, b, e, v=v, config=cfg)
    assert_close(out, expect, dtype, "W4 with v epilogue")


def test_ec_gate_programs_set_the_k_splits(poisoned):
    """``programs`` (KernelPolicy.gate_programs) sets how far ec_gate splits K: the fp32 workspace
    holds that many shares, and v is the same either way."""
    from spear.kernels import ec as ec_mod

    assert ec_mod.gate_splits(512, 11008, programs=132) == 4 and ec_mod.gate_splits(512, 11008) == 8
    assert ec_mod.gate_splits(64, 14336, programs=64) == 16
    dtype = torch.float16
    e = pack_ec(**make_ec(N_SMALL, 1024, 8, 8, dtype, seed=5))
    x = torch.randn(17, 1024, generator=torch.Generator().manual_seed(11)).to(dtype).to(DEVICE)
    expect = ref.ec_gate(x.float() @ e.a.float().t(), e.w1, e.b1, e.w2, e.b2, e.bound)
    r = e.a.shape[0]  # the padded rank
    for programs, workspace in ((264, [(2, 17, r)]), (2, [])):  # 2 token tiles; 8 K steps, >= 4 per share
        out = torch.empty(17, r, dtype=dtype, device=DEVICE)
        with allocations() as shapes:
            v = ec_gate(x, e, out=out, programs=programs)
        assert shapes == workspace, f"programs={programs}: allocated {shapes}"
        assert_close(v, expect, dtype, f"ec_gate programs={programs}")
