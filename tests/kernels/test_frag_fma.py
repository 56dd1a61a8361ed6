"""The fragment layout's CUDA-core loop (``_frag_fma.py``, 1-4 tokens) against the fp32 reference:
every packed layout (fp16 / bf16, symmetric / asymmetric, groups 32 / 64 / 128 and per-channel) at
M = 1, 2, 3, 4 with launches that cover tile widths 16-64, steps of 64-256 inputs, split-K 1-4
(an empty last split included), the register prefetch on and off, and token classes wider than M;
the fused compensator and the v-epilogue, SiLU·mul; the fp16x2 PTX path run through a PTX
interpreter (tests/kernels/_ptx.py); the launch table and the policy's integers for the new entries
(the tuner's: test_tune.py). Outputs and workspaces start as NaN (``poisoned``)."""

from __future__ import annotations

import itertools
import json
import re

import pytest
import torch

from spear.kernels import _frag_fma_ptx, launch
from spear.kernels import reference as ref
from spear.kernels.policy import KernelPolicy, plan, settings
from spear.kernels.w4a16 import Config, w4a16_matmul
from tests.kernels import _ptx
from tests.kernels._helpers import DEVICE, INTERPRET, assert_close, make_ec, setup_case, sqnr_db

N, K = 48, 256  # three 16-row tiles (a 32-wide tile leaves half of one masked, a 64-wide one more), four blocks
LAYOUT_CASES = list(itertools.product((torch.float16, torch.bfloat16), (False, True), (32, 64, 128, 0)))


def _launch(case: int, m: int) -> Config:
    """A launch for M = m tokens: the token class of m (even cases) or the widest (odd cases), tile
    width, step, split-K (K / BK steps split 1-4 ways: some splits get an empty range), prefetch and
    warps cycling with the case."""
    mv = (1, 2, 4, 4)[m - 1] if case % 2 == 0 else 4
    i = case + m
    bk = (64, 128, 256)[(case + 2 * m) % 3]
    return Config(16, (16, 32, 64)[i % 3], bk, 1 + i % 4, (2, 4)[i % 2], 1, mv=mv, prefetch=i % 2 == 0)


@pytest.mark.parametrize("case", range(len(LAYOUT_CASES)))
def test_every_layout_at_one_to_four_tokens(poisoned, case):
    dtype, sym, gs = LAYOUT_CASES[case]
    for m in (1, 2, 3, 4):
        x, w, b, _, expect = setup_case(m, K, N, gs, sym, dtype, seed=10 * case + m, bias=m % 2 == 1, layout="mma")
        cfg = _launch(case, m)
        out = w4a16_matmul(x, w, b, config=cfg)
        assert_close(out, expect, dtype, f"frag-fma M={m} g={gs} sym={sym} {dtype} {cfg}")
        assert int(w.locks.abs().sum()) == 0, "split-K counters not re-armed"


ON = {"fma_mma_max_m": 4}  # the built-in table keeps the loop off until a table of one's own turns it on


@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_as_dispatched(poisoned, m):
    """Without a launch: a table's CUDA-core launch for the fragment layout (the one the policy
    plans), on a layer of two 256-input groups per row and two column tiles."""
    x, w, b, _, expect = setup_case(m, 512, 80, 256, m % 2 == 0, torch.float16, seed=m, layout="mma")
    table = launch.merged_table(ON)
    cfg = launch.pick_config(m, 80, 512, 256, "mma", table)
    assert cfg.mv >= m and cfg == plan(m, 80, 512, 256, "mma", 0, KernelPolicy(launch_table=ON)).config
    assert_close(w4a16_matmul(x, w, b, table=table), expect, torch.float16, f"frag-fma dispatched M={m}")


def test_rows_starting_at_odd_elements():
    """The loop reads x as 32-bit pairs: a view whose rows start at odd elements is copied first."""
    x0, w, b, _, _ = setup_case(3, K, N, 64, False, torch.float16, seed=7, layout="mma")
    wide = torch.zeros(3, K + 1, dtype=torch.float16, device=DEVICE)
    wide[:, 1:] = x0
    x = wide[:, 1:]
    assert x.storage_offset() % 2 == 1 and x.stride(0) % 2 == 1
    out = w4a16_matmul(x, w, b, config=Config(16, 32, 128, 2, 2, 1, mv=4, prefetch=True))
    torch.testing.assert_close(out, w4a16_matmul(x0, w, b, config=Config(16, 32, 128, 2, 2, 1, mv=4)), rtol=0, atol=0)


# the compensator on the new loop: fused (ec_mode 1) and the v-epilogue (ec_mode 2, the semi-fused
# path's GEMM); gated and static; SiLU·mul over interleaved pairs; split-K 1 and 2
EC_CASES = [(1, 1, 16, 16, 0, torch.float16, 1), (2, 1, 8, None, 1, torch.bfloat16, 2),
            (3, 1, 32, 32, 1, torch.float16, 2), (4, 1, 16, None, 0, torch.bfloat16, 1),
            (1, 2, 16, 16, 1, torch.bfloat16, 2), (4, 2, 8, None, 0, torch.float16, 1)]


@pytest.mark.parametrize("m,ec_mode,r,h,act,dtype,split", EC_CASES)
def test_compensator_and_silu_mul(poisoned, m, ec_mode, r, h, act, dtype, split):
    ec = make_ec(N, K, r, h, dtype, seed=m)
    x, w, b, e, expect = setup_case(m, K, N, 128, False, dtype, seed=m, ec=ec, layout="mma")
    v = None
    if ec_mode == 2:
        v = ref.ec_gate(x.float() @ e.a.float().t(), e.w1, e.b1, e.w2, e.b2, e.bound).to(dtype)
    cfg = Config(16, 32, 64, split, 2, 1, mv=(1, 2, 4, 4)[m - 1], prefetch=m % 2 == 1)
    out = w4a16_matmul(x, w, b, e, ec_mode=ec_mode, v=v, config=cfg, act=act)
    if act:
        expect = ref.silu_mul_pairs(expect)
    assert_close(out, expect, dtype, f"frag-fma EC mode {ec_mode} M={m} r={r} h={h} act={act} split={split}")
    assert int(w.locks.abs().sum()) == 0, "counters not re-armed"


# ---------------------------------------------------------------------------- the fp16x2 PTX path
@pytest.fixture()
def ptx_path(monkeypatch):
    """The inline assembly of the CUDA path (PTX products, inline-asm loads) run by the PTX
    interpreter of tests/kernels/_ptx.py inside Triton's interpreter; the tests launch with
    ``native=True``."""
    if not INTERPRET:
        pytest.skip("runs the CUDA path inside Triton's CPU interpreter")
    _ptx.install(monkeypatch)


def test_ptx_interpreter_runs_the_dequantization_exactly():
    """``_frag_dq`` on every code and zero point: (code - zero)/16 of each nibble pair, exact."""
    codes = torch.randint(0, 16, (4096, 8), generator=torch.Generator().manual_seed(0))
    word = sum(codes[:, i].to(torch.int64) << (4 * i) for i in range(8))
    word = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32).numpy()
    z_lo, z_hi = torch.randint(0, 16, (2, 4096), generator=torch.Generator().manual_seed(1)).numpy()

    def half2(v):
        h = torch.tensor(v, dtype=torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
        return (h | (h << 16)).numpy()

    out = _ptx.run(_frag_fma_ptx._dq_ptx(), "=r,=r,=r,=r,r,r,r", [word, half2(-(1024.0 + z_lo) / 16),
                                                                half2(-(64.0 + z_hi) / 16)])
    for j in range(4):  # pair j: nibbles j (low half) and j + 4; rows g (j even) or g + 8 (j odd)
        z = torch.tensor(z_lo if j % 2 == 0 else z_hi, dtype=torch.float32)
        got = torch.from_numpy(out[j]).view(torch.int16).view(torch.float16).reshape(-1, 2).float()
        torch.testing.assert_close(got[:, 0], (codes[:, j] - z) / 16, rtol=0, atol=0)
        torch.testing.assert_close(got[:, 1], (codes[:, j + 4] - z) / 16, rtol=0, atol=0)


@pytest.mark.parametrize("gs,sym", [(32, False), (64, True), (128, False), (0, True), (0, False)])
def test_ptx_path(poisoned, ptx_path, gs, sym):
    """The fp16 CUDA path (``_frag_dq``, ``_frag_dot``, the inline-asm scale loads) at M = 1..4:
    fp16x2 products in units of 1/16, 8 a lane per accumulator, within fp16's floors."""
    for m in (1, 2, 3, 4):
        x, w, b, _, expect = setup_case(m, K, N, gs, sym, torch.float16, seed=gs + m, bias=m == 2, layout="mma")
        cfg = _launch(gs + m, m)
        assert_close(w4a16_matmul(x, w, b, config=cfg, native=True), expect, torch.float16, f"PTX M={m} g={gs} sym={sym} {cfg}")


def test_ptx_path_is_the_one_taken(ptx_path, monkeypatch):
    """The fixture does reach the PTX path: with the dot's products dropped the result is wrong."""
    x, w, b, _, expect = setup_case(1, K, N, 128, False, torch.float16, seed=3, layout="mma")
    broken = re.sub(r"fma\.rn\.f16x2 al0, (\$\d+), (\$\d+), al0;", r"mul.rn.f16x2 al0, \1, \2;", _frag_fma_ptx._PTX_DOT.value)
    assert broken != _frag_fma_ptx._PTX_DOT.value
    monkeypatch.setattr(_frag_fma_ptx, "_PTX_DOT", type(_frag_fma_ptx._PTX_DOT)(broken))
    out = w4a16_matmul(x, w, b, config=Config(16, 32, 128, 1, 2, 1, mv=1, prefetch=True), native=True)
    assert sqnr_db(expect, out.float()) < 20


# ---------------------------------------------------------------------------- launches and policy
def test_pick_config_takes_the_cuda_core_loop_up_to_max_m():
    t = launch.merged_table(ON)
    for m in (1, 2, 3, 4):  # the built-in table: the tensor-core tiles
        assert launch.pick_config(m, 28672, 4096, 128, "mma").mv == 0
    for m, key in ((1, None), (2, "2"), (3, "4"), (4, "4")):
        cfg = launch.pick_config(m, 28672, 4096, 128, "mma", t)
        e = t["fma_mma_by_mv"][key] if key else t["fma_mma"]
        assert (cfg.mv, cfg.BN, cfg.BK, cfg.num_warps, cfg.prefetch) == (
            (1, 2, 4, 4)[m - 1], e["BN"], e["BK"], e["num_warps"], bool(e.get("prefetch")))
        # split-K until the programs reach the entry's count: 448 column tiles x 2 >= 528, 448 >= 264
        assert cfg.split_k == (2, 2, 1, 1)[m - 1]
    assert launch.pick_config(5, 28672, 4096, 128, "mma", t).mv == 0  # the tensor-core tiles above max_m
    narrow = launch.pick_config(1, 4096, 4096, 128, "mma", t)  # one token, N <= max_n: the narrow launch
    assert (narrow.num_warps, narrow.split_k) == (t["fma_mma_narrow"]["num_warps"], 8)
    # any group size (the loop reads each block's scales): BK stays 128 at groups of 32; K not a
    # multiple of 128 takes 64
    assert launch.pick_config(2, 4096, 4096, 32, "mma", t).BK == 128
    assert launch.pick_config(2, 4096, 4160, 128, "mma", t).BK == 64
    off = launch.merged_table({"fma_mma_max_m": 0})
    assert launch.pick_config(1, 4096, 4096, 128, "mma", off) == launch.pick_config(16, 4096, 4096, 128, "mma")
    two = launch.merged_table({"fma_mma_max_m": 2, "fma_mma_narrow": None,
                               "fma_mma_by_mv": {"2": dict(BN=128, BK=256, num_warps=8, num_stages=1, programs=132)}})
    assert launch.pick_config(3, 4096, 4096, 128, "mma", two).mv == 0
    c2 = launch.pick_config(2, 4096, 4096, 128, "mma", two)
    assert (c2.BN, c2.BK, c2.num_warps, c2.split_k, c2.prefetch) == (128, 256, 8, 8, False)
    c1 = launch.pick_config(1, 4096, 4096, 128, "mma", two)  # no narrow launch, no class "1": fma_mma
    assert (c1.num_warps, c1.split_k) == (t["fma_mma"]["num_warps"], 16)
    # the other layouts keep their own entries
    assert launch.pick_config(1, 4096, 4096, 128, "kmajor", two) == launch.pick_config(1, 4096, 4096, 128, "kmajor")


@pytest.mark.parametrize("bad,message", [
    ({"fma_mma": {"BN": 64, "BK": 32}}, "fma_mma: the fragment layout's CUDA-core loop takes BK a multiple of 64"),
    ({"fma_mma_by_mv": {"4": {"BN": 8, "BK": 128}}}, r"fma_mma_by_mv.4: .* BN of at least 16"),
    ({"fma_mma_narrow": {"max_n": 4096, "BK": 32}}, "fma_mma_narrow: the fragment"),
    ({"fma_mma_by_mv": {"3": {"BN": 64}}}, "token classes"),
    ({"fma_mma_max_m": 5}, "fma_mma_max_m must be an integer from 0 to 4"),
])
def test_bad_fragment_entries_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        launch.merged_table(bad)


def test_the_entries_travel_through_json_and_the_policys_integers(tmp_path):
    table = {"fma_mma_max_m": 2, "fma_mma_narrow": None,
             "fma_mma": dict(BN=128, BK=256, num_warps=4, num_stages=1, programs=264, prefetch=True, u_split=8),
             "fma_mma_by_mv": {"2": dict(BN=32, BK=64, num_warps=2, num_stages=2, programs=1056)}}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(table))
    policy = KernelPolicy(launch_table=str(path))
    s = settings(list(policy.op_args))
    assert s.table == policy.launch_table
    assert s.table["fma_mma_narrow"] is None and s.table["fma_mma_max_m"] == 2
    assert s.table["fma_mma"] == table["fma_mma"] and set(s.table["fma_mma_by_mv"]) == {"2"}
    assert policy != KernelPolicy() and settings(KernelPolicy().op_args).table["fma_mma"] == launch.BUILTIN["fma_mma"]
    one = plan(1, 4096, 4096, 128, "mma", 16, policy)
    assert one.path == "fused_ec" and (one.config.mv, one.config.BN, one.config.BK, one.config.u_split) == (1, 128, 256, 8)
    assert plan(3, 4096, 4096, 128, "mma", 0, policy).config.mv == 0  # max_m 2
    for m in (1, 2, 3, 4):  # a policy with the loop on at 1-4 tokens: the GEMM path; the built-in one: the tiles
        p = plan(m, 4096, 4096, 128, "mma", 0, KernelPolicy(launch_table=ON))
        assert p.path == "gemm" and p.config.mv >= m
        assert plan(m, 4096, 4096, 128, "mma", 0, KernelPolicy()).config.mv == 0


def test_launches_the_loop_cannot_take_are_refused():
    x, w, _, _, _ = setup_case(3, K, N, 32, False, torch.float16, seed=0, bias=False, layout="mma")
    for bad in (Config(16, 32, 32, 1, 2, 1, mv=4), Config(16, 48, 64, 1, 2, 1, mv=4), Config(16, 32, 192, 1, 2, 1, mv=4),
                Config(16, 8, 64, 1, 2, 1, mv=4)):
        with pytest.raises(ValueError, match="fragment layout's CUDA-core loop"):
            w4a16_matmul(x, w, config=bad)
    with pytest.raises(ValueError, match="M <= mv"):
        w4a16_matmul(x, w, config=Config(16, 32, 64, 1, 2, 1, mv=2))
