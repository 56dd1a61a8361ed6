"""The kernel policy (spear/kernels/policy.py): validation, ``plan``'s path for every token class,
the op's integer form of a policy (thresholds and launch table) read back, and two policies in one
process keeping to their own paths."""

from __future__ import annotations

import dataclasses
import json

import pytest

from spear.kernels import launch
from spear.kernels.launch import BUILTIN, pick_config
from spear.kernels.policy import PATHS, KernelPolicy, plan, settings

TOKENS = (1, 2, 4, 5, 16, 17, 64, 65, 127, 128, 2048)
N, K, GROUP = 4096, 4096, 128
CUSTOM_TABLE = {"fma_kmajor_narrow": None, "fma_kmajor_max_m": 2,
                "fma_kmajor_by_mv": {"4": dict(BN=32, BK=64, num_warps=4, num_stages=2, programs=264, u_split=8)},
                "tc": dict(BN=32, BK=64, num_warps=8, num_stages=4, programs=1024, u_split=16),
                "prefill": dict(BM=64, BN=256, BK=32, num_warps=4, num_stages=4)}
# (policy, {tokens: (path without a compensator, path with one)}), every token count of TOKENS
G, D, F, S = "gemm", "dequant_cublas", "fused_ec", "semi_fused_ec"
CASES = [
    ("default", KernelPolicy(),
     {1: (G, F), 2: (G, F), 4: (G, F), 5: (G, F), 16: (G, F), 17: (G, F), 64: (G, F), 65: (G, S),
      127: (G, S), 128: (D, S), 2048: (D, S)}),
    ("fused to 16, cuBLAS from 65", KernelPolicy(fused_max_m=16, dequant_mm_min_m=65),
     {1: (G, F), 2: (G, F), 4: (G, F), 5: (G, F), 16: (G, F), 17: (G, S), 64: (G, S), 65: (D, S),
      127: (D, S), 128: (D, S), 2048: (D, S)}),
    ("never fused, cuBLAS from 2", KernelPolicy(fused_max_m=0, dequant_mm_min_m=2, launch_table=CUSTOM_TABLE),
     {1: (G, S), 2: (D, S), 4: (D, S), 5: (D, S), 16: (D, S), 17: (D, S), 64: (D, S), 65: (D, S),
      127: (D, S), 128: (D, S), 2048: (D, S)}),
    ("fused to 4, cuBLAS from 5", KernelPolicy(fused_max_m=4, dequant_mm_min_m=5, semi_fused_overlap=False),
     {1: (G, F), 2: (G, F), 4: (G, F), 5: (D, S), 16: (D, S), 17: (D, S), 64: (D, S), 65: (D, S),
      127: (D, S), 128: (D, S), 2048: (D, S)}),
]


@pytest.mark.parametrize("name,policy,paths", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("layout", ["kmajor", "nmajor"])
def test_plan_gives_each_token_count_its_path(name, policy, paths, layout):
    assert set(paths) == set(TOKENS)
    for tokens in TOKENS:
        for rank, path in zip((0, 16), paths[tokens]):
            p = plan(tokens, N, K, GROUP, layout, rank, policy)
            assert p.path == path, f"{name}: {tokens} tokens, rank {rank}: {p.path}, expected {path}"
            # the Triton GEMM's launch where the path runs it (the W4 part below the cuBLAS threshold)
            if tokens < policy.dequant_mm_min_m:
                assert p.config == pick_config(tokens, N, K, GROUP, layout, policy.launch_table), (name, tokens)
            else:
                assert p.config is None, (name, tokens)
            off = plan(tokens, N, K, GROUP, layout, rank, policy, cuda=False)
            assert off.path == "reference" and off.config is None, (name, tokens, rank)


def test_plan_uses_the_policys_launch_table():
    """The launch of a planned GEMM comes from the policy's table (merged over the built-in one)."""
    p = KernelPolicy(launch_table=CUSTOM_TABLE)
    one, three, sixteen, wide = (plan(m, N, K, GROUP, "kmajor", 16, p).config for m in (1, 3, 16, 40))
    assert (one.mv, one.BN, one.num_warps, one.split_k) == (1, 64, 2, 16)  # no narrow launch: fma_kmajor
    assert three.mv == 0 and (three.BN, three.BK, three.num_warps, three.u_split) == (32, 64, 8, 16)  # max_m 2
    assert (sixteen.BN, sixteen.num_stages) == (32, 4)
    assert (wide.BN, wide.BM, wide.num_warps) == (64, 64, 4)  # tc_wide: built in
    prefill = KernelPolicy(launch_table=CUSTOM_TABLE, dequant_mm_min_m=1024)
    assert plan(512, N, K, GROUP, "kmajor", 0, prefill).config == launch.Config(64, 256, 32, 1, 4, 4)
    default = plan(1, N, K, GROUP, "kmajor", 16, KernelPolicy()).config
    assert (default.num_warps, default.split_k) == (4, 8)  # the built-in narrow launch at N = 4096


def _check_round_trip(policy: KernelPolicy) -> None:
    args = policy.op_args
    assert isinstance(args, tuple) and all(type(a) is int for a in args)
    s = settings(list(args))  # as the op receives them: a list of ints
    assert (s.fused_max_m, s.dequant_mm_min_m, s.semi_fused_overlap, s.u_split_max, s.gate_programs) == (
        policy.fused_max_m, policy.dequant_mm_min_m, policy.semi_fused_overlap, policy.u_split_max,
        policy.gate_programs)
    assert s.table == policy.launch_table
    assert json.loads(json.dumps(_plain(s.table))) == _plain(policy.launch_table)


def _plain(t):
    return {k: _plain(v) for k, v in t.items()} if hasattr(t, "items") else t


def test_the_ops_integers_read_back_as_the_policy(tmp_path):
    _check_round_trip(KernelPolicy())
    assert settings(KernelPolicy().op_args).table == BUILTIN
    full = KernelPolicy(fused_max_m=7, dequant_mm_min_m=300, semi_fused_overlap=False, u_split_max=5,
                        gate_programs=99, launch_table=CUSTOM_TABLE)
    _check_round_trip(full)
    s = settings(full.op_args)
    assert s.table["fma_kmajor_narrow"] is None and BUILTIN["fma_kmajor_narrow"] is not None
    assert set(s.table["fma_kmajor_by_mv"]) == {"4"} and s.table["fma_kmajor_by_mv"]["4"]["u_split"] == 8
    assert s.table["tc"] == CUSTOM_TABLE["tc"] and s.table["prefill"] == CUSTOM_TABLE["prefill"]
    assert s.table["fma_kmajor_max_m"] == 2 and s.table["fma"] == BUILTIN["fma"]
    # every field an entry may hold, and a table read from a JSON file
    every = dict(BM=32, BN=16, BK=32, num_warps=2, num_stages=5, programs=77, max_n=2048, u_split=3, prefetch=True)
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"fma_kmajor_narrow": every, "fma_kmajor_by_mv": {}, "fma_max_m": 0}))
    from_file = KernelPolicy(launch_table=str(path))
    _check_round_trip(from_file)
    assert settings(from_file.op_args).table["fma_kmajor_narrow"] == every
    assert settings(from_file.op_args).table["fma_kmajor_by_mv"] == {}
    # the integers tell the policies apart (and are what equality compares)
    variants = [KernelPolicy(), full, from_file, KernelPolicy(launch_table={"fma_kmajor_narrow": None}),
                KernelPolicy(launch_table={"tc": dict(_plain(BUILTIN["tc"]), num_stages=4)}),
                KernelPolicy(u_split_max=16), KernelPolicy(gate_programs=132), KernelPolicy(semi_fused_overlap=False)]
    assert len({v.op_args for v in variants}) == len(variants)
    assert KernelPolicy(launch_table={"tc": _plain(BUILTIN["tc"])}) == KernelPolicy()
    with pytest.raises(ValueError, match="unknown version"):
        settings([99] + list(KernelPolicy().op_args[1:]))


def test_two_policies_in_one_process_keep_their_own_paths():
    """Plans under two policies, interleaved: each gets the paths and launches it asks for, whatever
    the other asked for before (no decoded setting or table is shared between them)."""
    a = KernelPolicy()
    b = KernelPolicy(fused_max_m=8, dequant_mm_min_m=32, semi_fused_overlap=False, launch_table=CUSTOM_TABLE)
    expect = {(a, 16): ("fused_ec", 64), (b, 16): ("semi_fused_ec", 32), (a, 48): ("fused_ec", 64),
              (b, 48): ("semi_fused_ec", None), (a, 1): ("fused_ec", 64), (b, 1): ("fused_ec", 64)}
    for _ in range(2):
        for (policy, tokens), (path, bn) in expect.items():
            p = plan(tokens, N, K, GROUP, "kmajor", 16, policy)
            assert p.path == path and (p.config.BN if p.config else None) == bn, (policy.fused_max_m, tokens)
            assert plan(1, N, K, GROUP, "kmajor", 16, policy).config.split_k == (8 if policy is a else 16)
    assert settings(a.op_args).semi_fused_overlap and not settings(b.op_args).semi_fused_overlap
    assert a == KernelPolicy() and b != a  # neither was changed by the other's plans


def test_a_policy_is_frozen_and_replace_validates():
    p = KernelPolicy(launch_table=CUSTOM_TABLE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.fused_max_m = 8
    with pytest.raises(TypeError):
        p.launch_table["tc"]["BN"] = 64
    q = p.replace(fused_max_m=8)  # keeps the table (already merged) and re-encodes
    assert q.fused_max_m == 8 and q.launch_table == p.launch_table and q.op_args != p.op_args
    assert settings(q.op_args).fused_max_m == 8 and p.fused_max_m == 64
    with pytest.raises(ValueError, match="fused_max_m is at most 64"):
        p.replace(fused_max_m=65)


@pytest.mark.parametrize("changes,message", [
    (dict(fused_max_m=-1), "fused_max_m must be a whole number >= 0, got -1"),
    (dict(fused_max_m=65), "fused_max_m is at most 64"),
    (dict(dequant_mm_min_m=0), "dequant_mm_min_m must be a whole number >= 1, got 0"),
    (dict(u_split_max=2.0), "u_split_max must be a whole number"),
    (dict(gate_programs=True), "gate_programs must be a whole number"),
    (dict(attention_min_split_tiles=0), "attention_min_split_tiles must be a whole number >= 1"),
    (dict(attention_max_splits=0), "attention_max_splits must be a whole number >= 1"),
    (dict(semi_fused_overlap=1), "semi_fused_overlap must be True or False"),
    (dict(rope_in_attention="yes"), "rope_in_attention must be True or False"),
    (dict(pdl="trigger"), "pdl must be one of off, wait, auto, got 'trigger'"),
    (dict(launch_table={"fma_kmajor": {"BN": 64, "pipeline": 3}}), r"unknown field\(s\) \['pipeline'\]"),
    (dict(launch_table={"tc": {"BN": 48}}), "tc.BN must be a power of two"),
])
def test_bad_policies_are_refused_with_the_field(changes, message):
    with pytest.raises(ValueError, match=message):
        KernelPolicy(**changes)


def test_pdl_level():
    """"off" never, "wait" on every step, "auto" on decode graphs of up to pdl_auto_max_batch
    sequences; never where the GPU or Triton has no programmatic dependent launch."""
    for batch in (None, 1, 32, 33, 64):
        assert KernelPolicy(pdl="off").pdl_level(batch, True) == 0
        assert KernelPolicy(pdl="wait").pdl_level(batch, True) == 1
        for mode in ("off", "wait", "auto"):
            assert KernelPolicy(pdl=mode).pdl_level(batch, False) == 0
    auto = KernelPolicy()
    assert [auto.pdl_level(b, True) for b in (None, 1, 32, 33, 64)] == [0, 1, 1, 0, 0]
    assert [KernelPolicy(pdl_auto_max_batch=64).pdl_level(b, True) for b in (None, 33, 64, 65)] == [0, 1, 1, 0]


GLUON_TABLE = {"gluon": {"128": dict(BN=256, BM=128, BK=64, num_stages=4),
                          "big": dict(BN=128, BM=256, BK=64, num_stages=3, programs=264)}}


def test_paths_are_the_documented_ones():
    gl = KernelPolicy(launch_table=GLUON_TABLE)
    seen = {plan(m, N, K, GROUP, layout, r, pol, cuda=c, gluon=True).path
            for m in TOKENS for r in (0, 16) for c in (True, False) for layout, pol in
            (("kmajor", KernelPolicy()), ("mma", gl))}
    assert seen == set(PATHS)


def test_plan_takes_the_gluon_gemm_for_the_classes_its_table_holds():
    """Fragment layout on a Hopper GPU: the classes of the table's "gluon" run the Gluon GEMM (with
    the K split that brings the tiles up to the entry's programs), beside a compensator too above
    fused_max_m; every other class, another layout, a device without it, or KernelPolicy(gluon=
    False) keeps the Triton kernel or cuBLAS."""
    from spear.kernels.launch import GluonConfig

    pol = KernelPolicy(launch_table=GLUON_TABLE)
    for m in (65, 100, 128):
        p = plan(m, N, K, GROUP, "mma", 0, pol, gluon=True)
        # 4096 / 256 = 16 tiles of 64 steps of 64: split 8, 128 units of 8 (+ 2) steps on 132 programs
        assert (p.path, p.config) == ("gluon", GluonConfig(128, 128, 64, 4, 8)), m
        assert p.w4 == "gluon" and str(p) == "gluon (gluon: BN=256 BM=128 BK=64 stages=4 split=8)"
        s = plan(m, N, K, GROUP, "mma", 16, pol, gluon=True)
        assert (s.path, s.config) == ("semi_fused_ec", p.config)
    big = plan(4096, N, K, GROUP, "mma", 0, pol, gluon=True)
    assert big.config == GluonConfig(64, 256, 64, 3, 1)  # 16 x 32 = 512 tiles: no split
    # 28672 output features: the "gluon_wide" classes (here the built-in ones, which hold no "big")
    assert plan(2048, 28672, K, GROUP, "mma", 0, pol, gluon=True).w4 == "cublas"
    wide = pol.replace(launch_table={**GLUON_TABLE, "gluon_wide": {"big": GLUON_TABLE["gluon"]["big"]}})
    assert plan(2048, 28672, K, GROUP, "mma", 0, wide, gluon=True).config.split_k == 1
    assert plan(2048, launch.GLUON_WIDE_N - 16, K, GROUP, "mma", 0, wide, gluon=True).w4 == "gluon"
    for m in (1, 16, 64, 129, 256):  # classes without an entry here or in the built-in table
        assert plan(m, N, K, GROUP, "mma", 0, pol, gluon=True).w4 in ("triton", "cublas"), m
    builtin = BUILTIN["gluon"]["1024"]  # a table of one's own is merged over the built-in one
    assert plan(1024, N, K, GROUP, "mma", 0, pol, gluon=True).config == GluonConfig(
        builtin["BN"] // 2, builtin["BM"], builtin["BK"], builtin["num_stages"], 1)
    fused = plan(64, N, K, GROUP, "mma", 16, pol, gluon=True)
    assert fused.path == "fused_ec" and fused.w4 == "triton"
    for other in (plan(128, N, K, GROUP, "mma", 0, pol, gluon=False),
                  plan(128, N, K, GROUP, "kmajor", 0, pol, gluon=True),
                  plan(128, N, K, GROUP, "mma", 0, pol.replace(gluon=False), gluon=True),
                  plan(256, N, K, GROUP, "mma", 0, KernelPolicy(), gluon=True)):
        assert other.w4 in ("triton", "cublas")
    assert KernelPolicy(launch_table=GLUON_TABLE).op_args != KernelPolicy().op_args


def test_a_table_without_wide_classes_sends_every_layer_to_its_gluon_classes():
    from spear.kernels.launch import pick_gluon

    own = {"gluon": {"256": dict(BN=128, BM=128, BK=128, num_stages=4)}}
    for n in (4096, 28672):
        assert pick_gluon(256, n, K, own).BM == 128
    both = {**own, "gluon_wide": {"256": dict(BN=128, BM=256, BK=128, num_stages=2)}}
    assert pick_gluon(256, 4096, K, both).BM == 128 and pick_gluon(256, 28672, K, both).BM == 256
    assert pick_gluon(256, 28672, K, {**own, "gluon_wide": {}}) is None  # wide layers: none


def test_the_builtin_gluon_classes_are_what_the_tuner_makes_of_its_h100_sweep():
    """launch.BUILTIN's "gluon" and "gluon_wide" = tune_gluon.gluon_table over the stored sweep (the raw
    timings of `spear tune-kernels --layout gluon` on the H100, 2026-12-06)."""
    from pathlib import Path

    from spear.kernels import tune_gluon

    rows = json.loads((Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "run21-h100-2026-12-06" / "tune"
                       / "gluon_rows.json").read_text())["rows"]
    assert tune_gluon.gluon_table(rows) == {k: launch._thaw(BUILTIN[k]) for k in ("gluon", "gluon_wide")}


def test_gluon_table_keeps_a_class_only_beyond_the_margin_and_per_width():
    from spear.kernels import tune_gluon

    def row(n, cls, without, **sweep):
        return {"n": n, "class": cls, "without_us": without,
                "sweep": {k: {"launch": dict(BN=128, BM=int(k[2:]), BK=128, num_stages=4), "us": us}
                          for k, us in sweep.items()}}

    rows = [row(4096, "128", 10.0, BM64=9.0, BM128=9.6), row(4096, "256", 10.0, BM128=9.6),
            row(28672, "256", 10.0, BM128=9.4, BM256=8.0)]
    assert tune_gluon.gluon_table(rows) == {"gluon": {"128": dict(BN=128, BM=64, BK=128, num_stages=4)},
                                      "gluon_wide": {"256": dict(BN=128, BM=256, BK=128, num_stages=4)}}
    assert tune_gluon.gluon_table(rows[:2]) == {"gluon": {"128": dict(BN=128, BM=64, BK=128, num_stages=4)}}


@pytest.mark.parametrize("entry", [dict(BN=512, BM=128, BK=64, num_stages=4), dict(BN=256, BM=256, BK=64, num_stages=4),
                                   dict(BN=256, BM=128, BK=32, num_stages=4), dict(BN=256, BM=128, BK=64),
                                   dict(BN=256, BM=128, BK=64, num_stages=9)])
def test_gluon_entries_the_kernel_cannot_run_are_refused(entry):
    with pytest.raises(ValueError, match="gluon"):
        KernelPolicy(launch_table={"gluon": {"128": entry}})
    with pytest.raises(ValueError, match="gluon"):
        KernelPolicy(launch_table={"gluon": {"100": dict(BN=256, BM=128, BK=64, num_stages=4)}})


def test_describe_names_each_run_of_token_counts_by_its_kernel():
    from spear.kernels.policy import describe

    pol = KernelPolicy(launch_table=GLUON_TABLE)
    assert describe(pol, N, K, GROUP, "mma", 0, gluon=True, tokens=(1, 64, 65, 128, 129, 256, 512, 4096)) == (
        "1-64 tokens: gemm (triton); 65-128 tokens: gluon (gluon); 129-256 tokens: gemm (triton); "
        "512-4096 tokens: gluon (gluon)")  # 512: the built-in table's class under this one
    assert describe(pol, N, K, GROUP, "mma", 16, gluon=False, tokens=(1, 64, 65, 4096)) == (
        "1-64 tokens: fused_ec (triton); 65 tokens: semi_fused_ec (triton); 4096 tokens: semi_fused_ec (cublas)")
