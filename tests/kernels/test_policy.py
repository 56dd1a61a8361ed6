"""The kernel policy (spear/kernels/policy.py) and the planner (spear/kernels/planner.py):
validation; the kernel, launch and compensator form ``plan`` gives every token class of either
layout on a CPU, an Ampere-class and a Hopper device (the device's capability faked); the op's
integer form of a policy read back; two policies in one process keeping to their own plans."""

from __future__ import annotations

import dataclasses
import json
import pickle

import pytest
import torch

from spear.kernels import launch, planner
from spear.kernels.launch import BUILTIN, GluonConfig, pick_triton
from spear.kernels.layout import Layout, WeightFormat
from spear.kernels.planner import EC, Kernel, plan
from spear.kernels.policy import KernelPolicy

N, K, GROUP = 4096, 4096, 128
FRAGMENT, NMAJOR = WeightFormat(Layout.FRAGMENT, GROUP), WeightFormat(Layout.NMAJOR, GROUP)
CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def _fake_gpu(monkeypatch, capability):
    """The planner's capability query answers ``capability`` for every device (a CPU one too), so
    plans are made as on that GPU."""
    monkeypatch.setattr(planner, "capability", lambda device: capability)
    monkeypatch.setattr(planner, "_have_gluon", lambda: True)


@pytest.fixture()
def ampere(monkeypatch):
    _fake_gpu(monkeypatch, (8, 0))


@pytest.fixture()
def hopper(monkeypatch):
    _fake_gpu(monkeypatch, (9, 0))


T, C = Kernel.TRITON, Kernel.CUBLAS
# (policy, weight, {tokens: (kernel without a compensator, (kernel, EC form) with one)})
CASES = [
    ("default, fragment", KernelPolicy(), FRAGMENT,
     {1: (T, (T, EC.FUSED)), 64: (T, (T, EC.FUSED)), 65: (T, (T, EC.SEMI)), 256: (T, (T, EC.SEMI)),
      257: (C, (C, EC.SEMI)), 4096: (C, (C, EC.SEMI))}),
    ("default, N-major", KernelPolicy(), NMAJOR,
     {1: (T, (T, EC.FUSED)), 64: (T, (T, EC.FUSED)), 65: (T, (T, EC.SEMI)), 127: (T, (T, EC.SEMI)),
      128: (C, (C, EC.SEMI)), 4096: (C, (C, EC.SEMI))}),
    ("fused to 16, cuBLAS from 65", KernelPolicy(fused_max_m=16, fragment_cublas_min_m=65, nmajor_cublas_min_m=65),
     FRAGMENT, {1: (T, (T, EC.FUSED)), 16: (T, (T, EC.FUSED)), 17: (T, (T, EC.SEMI)), 65: (C, (C, EC.SEMI))}),
    ("never fused, cuBLAS from 2", KernelPolicy(fused_max_m=0, nmajor_cublas_min_m=2), NMAJOR,
     {1: (T, (T, EC.SEMI)), 2: (C, (C, EC.SEMI)), 4096: (C, (C, EC.SEMI))}),
    ("the GEMM at every count", KernelPolicy(fragment_cublas_min_m=0), FRAGMENT,
     {1: (T, (T, EC.FUSED)), 4096: (T, (T, EC.SEMI))}),
]


@pytest.mark.parametrize("name,policy,weight,paths", CASES, ids=[c[0] for c in CASES])
def test_plan_gives_each_token_count_its_kernel(ampere, name, policy, weight, paths):
    fragment = weight.layout is Layout.FRAGMENT
    for tokens, (plain, (kernel, ec)) in paths.items():
        p = plan(tokens, N, K, 0, weight, CUDA, policy)
        assert (p.kernel, p.ec) == (plain, EC.NONE), (name, tokens)
        # the Triton GEMM's launch where it runs the W4 part; none for cuBLAS
        expect = pick_triton(tokens, N, K, fragment, GROUP, policy.launch_table) if plain is T else None
        assert p.config == expect, (name, tokens)
        e = plan(tokens, N, K, 16, weight, CUDA, policy)
        assert (e.kernel, e.ec) == (kernel, ec), (name, tokens)
        if ec is EC.FUSED:  # the fused EC's u programs: the entry's u_split, else the policy's
            assert e.config == dataclasses.replace(pick_triton(tokens, N, K, fragment, GROUP, policy.launch_table),
                                                   u_split=policy.u_split_max)
        else:  # semi-fused: the W4 part's launch, and ec_gate's split as the kernel computes it
            from spear.kernels.ec import gate_splits

            assert e.config == p.config and e.gate_splits == gate_splits(tokens, K, policy.gate_programs)


def test_off_cuda_every_plan_is_the_reference(hopper, monkeypatch):
    monkeypatch.setattr(planner, "capability", lambda device: None)
    for tokens in (1, 100, 4096):
        assert plan(tokens, N, K, 0, FRAGMENT, CPU, KernelPolicy()) == planner.Plan(Kernel.REFERENCE, None)
        assert plan(tokens, N, K, 16, NMAJOR, CPU, KernelPolicy()).ec is EC.FUSED  # the reference's whole layer


def test_the_real_capability_query_says_cpu_here():
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine")
    assert planner.capability(CPU) is None and planner.target(CPU) == planner.Target(False, False)
    assert plan(1, N, K, 16, FRAGMENT, CPU, KernelPolicy()).kernel is Kernel.REFERENCE


def test_the_planner_asks_the_device_for_gluon(monkeypatch):
    """Only sm_90 with a Triton that has Gluon runs the Gluon GEMM: the planner reads that from the
    device itself, so its callers cannot disagree about it."""
    pol = KernelPolicy()
    for cap, gluon, want in (((9, 0), True, Kernel.GLUON), ((9, 0), False, T), ((8, 0), True, T), ((10, 0), True, T)):
        monkeypatch.setattr(planner, "capability", lambda device, cap=cap: cap)
        monkeypatch.setattr(planner, "_have_gluon", lambda gluon=gluon: gluon)
        assert plan(128, N, K, 0, FRAGMENT, CUDA, pol).kernel is want, (cap, gluon)


GLUON_TABLE = {"gluon": {"128": dict(BN=256, BM=128, BK=64, num_stages=4),
                         "big": dict(BN=128, BM=256, BK=64, num_stages=3, programs=264)}}


def test_plan_takes_the_gluon_gemm_for_the_classes_its_table_holds(hopper):
    """Fragment layout on a Hopper GPU: the classes of the table's "gluon" run the Gluon GEMM (with
    the K split that brings the tiles up to the entry's programs), beside a compensator too above
    fused_max_m; every other class, the N-major layout, or KernelPolicy(gluon=False) keeps the
    Triton kernel or cuBLAS."""
    pol = KernelPolicy(launch_table=GLUON_TABLE)
    for m in (65, 100, 128):
        p = plan(m, N, K, 0, FRAGMENT, CUDA, pol)
        # 4096 / 256 = 16 tiles of 64 steps of 64: split 8, 128 units of 8 (+ 2) steps on 132 programs
        assert (p.kernel, p.config) == (Kernel.GLUON, GluonConfig(128, 128, 64, 4, 8)), m
        assert str(p) == "gluon (BN=256 BM=128 BK=64 stages=4 split=8)"
        s = plan(m, N, K, 16, FRAGMENT, CUDA, pol)
        assert (s.kernel, s.ec, s.config) == (Kernel.GLUON, EC.SEMI, p.config)
    assert plan(4096, N, K, 0, FRAGMENT, CUDA, pol).config == GluonConfig(64, 256, 64, 3, 1)  # 512 tiles: no split
    # 28672 output features: the "gluon_wide" classes (here the built-in ones, which hold no "big")
    assert plan(2048, 28672, K, 0, FRAGMENT, CUDA, pol).kernel is C
    wide = pol.replace(launch_table={**GLUON_TABLE, "gluon_wide": {"big": GLUON_TABLE["gluon"]["big"]}})
    assert plan(2048, 28672, K, 0, FRAGMENT, CUDA, wide).config.split_k == 1
    assert plan(2048, launch.GLUON_WIDE_N - 16, K, 0, FRAGMENT, CUDA, wide).kernel is Kernel.GLUON
    for m in (1, 16, 64, 129, 256):  # classes without an entry here or in the built-in table
        assert plan(m, N, K, 0, FRAGMENT, CUDA, pol).kernel in (T, C), m
    builtin = BUILTIN["gluon"]["1024"]  # a table of one's own is merged over the built-in one
    assert plan(1024, N, K, 0, FRAGMENT, CUDA, pol).config == GluonConfig(builtin.BN // 2, builtin.BM, builtin.BK,
                                                                          builtin.num_stages, 1)
    fused = plan(64, N, K, 16, FRAGMENT, CUDA, pol)
    assert (fused.kernel, fused.ec) == (T, EC.FUSED)
    for other in (plan(128, N, K, 0, NMAJOR, CUDA, pol), plan(128, N, K, 0, FRAGMENT, CUDA, pol.replace(gluon=False)),
                  plan(256, N, K, 0, FRAGMENT, CUDA, KernelPolicy())):
        assert other.kernel in (T, C)


def test_a_compensator_takes_ring_stages_and_the_plan_says_so(hopper):
    pol = KernelPolicy(launch_table={"gluon": {"1024": dict(BN=128, BM=256, BK=128, num_stages=3)}})
    assert plan(1024, N, K, 0, FRAGMENT, CUDA, pol).config.stages == 3
    assert plan(1024, N, K, 16, FRAGMENT, CUDA, pol).config.stages == 2


def test_a_table_without_wide_classes_sends_every_layer_to_its_gluon_classes():
    own = launch.check_table({"gluon": {"256": dict(BN=128, BM=128, BK=128, num_stages=4)}})
    for n, k in ((4096, K), (28672, K), (4096, 14336)):
        assert launch.pick_gluon(256, n, k, own).BM == 128
    # by input features: down (4096 x 14336) takes "gluon_deep", q/o (4096 x 4096) "gluon"
    deep = launch.check_table({**launch.to_json(own), "gluon_deep": {"256": dict(BN=128, BM=64, BK=128,
                                                                                  num_stages=4)}})
    assert launch.pick_gluon(256, 4096, 14336, deep).BM == 64 and launch.pick_gluon(256, 4096, 4096, deep).BM == 128
    assert launch.pick_gluon(256, 4096, launch.GLUON_DEEP_K - 64, deep).BM == 128
    assert launch.pick_gluon(256, 4096, 14336, launch.check_table({**launch.to_json(own), "gluon_deep": {}})) is None
    assert [launch.gluon_family(n, k) for n, k in ((4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336),
                                                   (28672, 14336))] == ["gluon", "gluon", "gluon_wide",
                                                                        "gluon_deep", "gluon_wide"]
    both = launch.check_table({**launch.to_json(own), "gluon_wide": {"256": dict(BN=128, BM=256, BK=128,
                                                                                  num_stages=2)}})
    assert launch.pick_gluon(256, 4096, K, both).BM == 128 and launch.pick_gluon(256, 28672, K, both).BM == 256
    assert launch.pick_gluon(256, 28672, K, launch.check_table({**launch.to_json(own), "gluon_wide": {}})) is None


def test_describe_names_each_run_of_token_counts_by_its_kernel(hopper):
    pol = KernelPolicy(launch_table=GLUON_TABLE)
    assert planner.describe(N, K, 0, FRAGMENT, CUDA, pol, tokens=(1, 64, 65, 128, 129, 256, 512, 4096)) == (
        "1-64 tokens: triton; 65-128 tokens: gluon; 129-256 tokens: triton; 512-4096 tokens: gluon")
    assert planner.describe(N, K, 16, NMAJOR, CUDA, pol, tokens=(1, 64, 65, 4096)) == (
        "1-64 tokens: triton, fused EC; 65 tokens: triton, semi-fused EC; 4096 tokens: cublas, semi-fused EC")


def _plain(t):
    return {k: _plain(v) for k, v in t.items()} if hasattr(t, "items") else t


CUSTOM_TABLE = {"nmajor": {"1": dict(BM=16, BN=32, BK=64, num_warps=4, num_stages=2, programs=264, u_split=8),
                           "big": dict(BM=64, BN=256, BK=32, num_warps=4, num_stages=4)},
                "fragment": {"64": dict(BM=64, BN=128, BK=64, num_warps=8, num_stages=4, programs=77)},
                "gluon": {"16": dict(BN=128, BM=16, BK=64, num_stages=5, programs=99)}}


def test_the_ops_integers_read_back_as_the_policy(tmp_path):
    """``of_op_args`` gives back a policy whose thresholds, table and integers are the original's,
    from the plain list the op receives; every entry field survives, a file's table too."""
    for policy in (KernelPolicy(), KernelPolicy(fused_max_m=7, nmajor_cublas_min_m=300, fragment_cublas_min_m=0,
                                                semi_fused_overlap=False, u_split_max=5, gate_programs=99,
                                                gluon=False, launch_table=CUSTOM_TABLE)):
        args = policy.op_args
        assert isinstance(args, tuple) and all(type(a) is int for a in args)
        back = KernelPolicy.of_op_args(list(args))
        for f in ("fused_max_m", "nmajor_cublas_min_m", "fragment_cublas_min_m", "semi_fused_overlap", "u_split_max",
                  "gate_programs", "gluon"):
            assert getattr(back, f) == getattr(policy, f), f
        assert back.launch_table == policy.launch_table and back.op_args == args
        assert json.loads(json.dumps(launch.to_json(back.launch_table))) == launch.to_json(policy.launch_table)
    assert KernelPolicy.of_op_args(KernelPolicy().op_args).launch_table == BUILTIN
    path = tmp_path / "table.json"
    path.write_text(json.dumps(CUSTOM_TABLE))
    from_file = KernelPolicy(launch_table=str(path))
    assert KernelPolicy.of_op_args(from_file.op_args).launch_table["nmajor"]["1"].u_split == 8
    # the integers tell the policies apart (and are what equality compares)
    variants = [KernelPolicy(), from_file, KernelPolicy(launch_table={"nmajor": {"16": dict(BM=16, BN=64, BK=128,
                                                                                         num_warps=4, num_stages=4)}}),
                KernelPolicy(u_split_max=16), KernelPolicy(gate_programs=132), KernelPolicy(semi_fused_overlap=False),
                KernelPolicy(gluon=False), KernelPolicy(fragment_cublas_min_m=513)]
    assert len({v.op_args for v in variants}) == len(variants)
    assert KernelPolicy(launch_table=launch.to_json(BUILTIN)) == KernelPolicy()
    # one family a kernel (the Gluon GEMM's three by layer shape), every class an entry of its own
    # fields: 240 integers against the 351 of old
    assert len(KernelPolicy().op_args) == 1 + 7 + sum(len(f.classes) * (1 + len(f.fields))
                                                      for f in launch.FAMILIES.values()) == 240
    with pytest.raises(ValueError, match="unknown version"):
        KernelPolicy.of_op_args([99] + list(KernelPolicy().op_args[1:]))


def test_a_policy_pickles_with_its_table():
    """Tensor-parallel ranks receive the engine's policy pickled: the same policy comes back."""
    p = KernelPolicy(gate_programs=100, launch_table=CUSTOM_TABLE)
    q = pickle.loads(pickle.dumps(p))
    assert q == p and q.launch_table == p.launch_table and hash(q) == hash(p)
    assert pickle.loads(pickle.dumps(KernelPolicy())).launch_table is BUILTIN


def test_two_policies_in_one_process_keep_their_own_plans(ampere):
    """Plans under two policies, interleaved: each gets the kernels and launches it asks for,
    whatever the other asked for before (no decoded setting or table is shared between them)."""
    a = KernelPolicy()
    b = KernelPolicy(fused_max_m=8, nmajor_cublas_min_m=32, semi_fused_overlap=False, launch_table=CUSTOM_TABLE)
    expect = {(a, 16): (EC.FUSED, 64), (b, 16): (EC.SEMI, 64), (a, 48): (EC.FUSED, 64),
              (b, 48): (EC.SEMI, None), (a, 1): (EC.FUSED, 64), (b, 1): (EC.FUSED, 32)}
    for _ in range(2):
        for (policy, tokens), (ec, bn) in expect.items():
            p = plan(tokens, N, K, 16, NMAJOR, CUDA, policy)
            assert p.ec is ec and (p.config.BN if p.config else None) == bn, (policy.fused_max_m, tokens)
    assert a == KernelPolicy() and b != a  # neither was changed by the other's plans


def test_a_policy_is_frozen_and_replace_validates():
    p = KernelPolicy(launch_table=CUSTOM_TABLE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.fused_max_m = 8
    with pytest.raises(TypeError):
        p.launch_table["nmajor"]["16"] = None
    q = p.replace(fused_max_m=8)  # keeps the table (already merged) and re-encodes
    assert q.fused_max_m == 8 and q.launch_table == p.launch_table and q.op_args != p.op_args
    assert KernelPolicy.of_op_args(q.op_args).fused_max_m == 8 and p.fused_max_m == 64
    with pytest.raises(ValueError, match="fused_max_m is at most 64"):
        p.replace(fused_max_m=65)


@pytest.mark.parametrize("changes,message", [
    (dict(fused_max_m=-1), "fused_max_m must be a whole number >= 0, got -1"),
    (dict(fused_max_m=65), "fused_max_m is at most 64"),
    (dict(nmajor_cublas_min_m=-1), "nmajor_cublas_min_m must be a whole number >= 0, got -1"),
    (dict(u_split_max=2.0), "u_split_max must be a whole number"),
    (dict(gate_programs=True), "gate_programs must be a whole number"),
    (dict(attention_min_split_tiles=0), "attention_min_split_tiles must be a whole number >= 1"),
    (dict(attention_max_splits=0), "attention_max_splits must be a whole number >= 1"),
    (dict(semi_fused_overlap=1), "semi_fused_overlap must be True or False"),
    (dict(rope_in_attention="yes"), "rope_in_attention must be True or False"),
    (dict(pdl="trigger"), "pdl must be one of off, wait, auto, got 'trigger'"),
    (dict(launch_table={"nmajor": {"16": {"BN": 64, "pipeline": 3}}}), r"unknown field\(s\) \['pipeline'\]"),
    (dict(launch_table={"fma_kmajor": {}}), "unknown launch table key 'fma_kmajor'"),
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


def test_the_builtin_gluon_classes_are_what_the_tuner_makes_of_its_h100_sweep():
    """launch.BUILTIN's Gluon families = tune_gluon.gluon_table over the stored sweep (the raw
    timings of `spear tune-kernels --kernel gluon` on the H100, 2026-12-06)."""
    from pathlib import Path

    from spear.kernels import tune_gluon

    rows = json.loads((Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "run21-h100-2026-12-06" / "tune"
                       / "gluon_rows.json").read_text())["rows"]
    table = launch.to_json(BUILTIN)
    assert tune_gluon.gluon_table(rows) == {k: table[k] for k in ("gluon", "gluon_wide", "gluon_deep")}


def test_gluon_table_keeps_a_class_only_beyond_the_margin_and_per_width():
    from spear.kernels import tune_gluon

    def row(n, cls, without, k=4096, **sweep):
        return {"n": n, "k": k, "class": cls, "without_us": without,
                "sweep": {k: {"launch": dict(BN=128, BM=int(k[2:]), BK=128, num_stages=4), "us": us}
                          for k, us in sweep.items()}}

    rows = [row(4096, "128", 10.0, BM64=9.0, BM128=9.6), row(4096, "256", 10.0, BM128=9.6),
            row(28672, "256", 10.0, BM128=9.4, BM256=8.0), row(4096, "128", 10.0, k=14336, BM64=9.6, BM128=8.0)]
    assert tune_gluon.gluon_table(rows) == {"gluon": {"128": dict(BN=128, BM=64, BK=128, num_stages=4)},
                                            "gluon_wide": {"256": dict(BN=128, BM=256, BK=128, num_stages=4)},
                                            "gluon_deep": {"128": dict(BN=128, BM=128, BK=128, num_stages=4)}}
    assert tune_gluon.gluon_table(rows[:2]) == {"gluon": {"128": dict(BN=128, BM=64, BK=128, num_stages=4)}}


@pytest.mark.parametrize("entry", [dict(BN=512, BM=128, BK=64, num_stages=4), dict(BN=256, BM=256, BK=64, num_stages=4),
                                   dict(BN=256, BM=128, BK=32, num_stages=4), dict(BN=256, BM=128, BK=64),
                                   dict(BN=256, BM=128, BK=64, num_stages=9)])
def test_gluon_entries_the_kernel_cannot_run_are_refused(entry):
    with pytest.raises(ValueError, match="gluon"):
        KernelPolicy(launch_table={"gluon": {"128": entry}})
    with pytest.raises(ValueError, match="gluon"):
        KernelPolicy(launch_table={"gluon": {"100": dict(BN=256, BM=128, BK=64, num_stages=4)}})
