"""The kernels' packed model forms on the CPU: the warm-up's token counts cover every kernel
signature a step can meet, one count each; the packed model computes what the dense one does.

The model's linears are packed for the kernels on the CPU too (the ops then run their torch
references), so the runner plans as it would on a GPU: the W4 paths and launches by token count,
the compensators' ec_gate splits."""

import torch

from spear.config import QuantConfig
from spear.kernels.policy import KernelPolicy
from spear.quant import quantize_model_rtn
from spear.serve import EngineConfig, LLMEngine, SamplingParams
from spear.serve.model.layers.quant_method import W4Method


def _kernel_engine(tiny_llama_path, policy):
    from spear.compensate.lowrank import LowRankCompensator
    from spear.kernels.layout import MAX_RANK
    from spear.models.loading import load_model
    from spear.serve.model import loader
    from spear.serve.model.llama import build_model

    model, tok = load_model(tiny_llama_path)
    mods = quantize_model_rtn(model, QuantConfig(bits=4, group_size=32), progress=False)
    g = torch.Generator().manual_seed(0)
    for q in list(mods.values())[::3]:
        q.compensator = LowRankCompensator(torch.randn(4, q.in_features, generator=g) * 0.01,
                                           torch.randn(q.out_features, 4, generator=g) * 0.01)
    eng = LLMEngine(model, tok, EngineConfig(num_blocks=64, max_model_len=512, max_num_batched_tokens=256,
                                             kernels=policy), dtype=torch.float16)
    cfg, quantized, tensors = loader.from_module(model)
    eng.core.model, _ = build_model(cfg, quantized, tensors, "cpu", torch.float16, MAX_RANK, kernels=True)
    eng.core.runner.model = eng.core.model
    return eng


def test_warmup_counts_cover_every_signature_once(tiny_llama_path):
    """Catches: a threshold of the policy (fused EC, dequant + cuBLAS, a launch class) or an ec_gate
    split that the warm-up never runs, which a request would then compile."""
    for policy in (KernelPolicy(), KernelPolicy(fused_max_m=16, fragment_cublas_min_m=100, gate_programs=64)):
        runner = _kernel_engine(tiny_llama_path, policy).core.runner
        assert any(isinstance(lin.method, W4Method) for lin in runner.linears()), "no layer on the kernel path"
        counts = runner.warmup_token_counts(256)
        every = {runner.kernel_signature(t) for t in range(1, 257)}
        chosen = [runner.kernel_signature(t) for t in counts]
        assert set(chosen) == every and len(set(chosen[:-1])) == len(chosen) - 1, counts
        for t in (1, 2, 3, 5, policy.fused_max_m, policy.fused_max_m + 1, policy.fragment_cublas_min_m):
            assert runner.kernel_signature(t) in chosen


def test_warmup_steps_leave_the_engine_serving_the_same(tiny_llama_path):
    eng = _kernel_engine(tiny_llama_path, KernelPolicy())
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    before = eng.generate([list(range(5, 40))], params)[0].output_token_ids
    eng.core.runner.warmup(eng.core.runner.warmup_token_counts(64))
    assert eng.generate([list(range(5, 40))], params)[0].output_token_ids == before
    assert eng.stats().kv_usage == 0.0


def test_the_packed_model_computes_the_dense_one(tiny_llama_path):
    """The same checkpoint built in the kernels' packed forms (merged q/k/v and gate/up codes,
    block-diagonal ECs, interleaved gate/up with the SiLU·mul epilogue; the ops' references on the
    CPU, in fp16) and in the dense form (fp32) give the same greedy tokens.
    Catches: a member's rows out of order in a merged pack, the interleave of gate/up, the merged
    compensator's blocks."""
    eng = _kernel_engine(tiny_llama_path, KernelPolicy())
    from spear.kernels.layout import MAX_RANK
    from spear.models.loading import load_model
    from spear.serve.model import loader
    from spear.serve.model.llama import build_model

    assert all(isinstance(lin.method, W4Method) for layer in eng.core.model.layers
               for lin in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj))
    assert eng.core.model.layers[0].gate_up_proj.interleaved
    model, _ = load_model(tiny_llama_path)
    mods = quantize_model_rtn(model, QuantConfig(bits=4, group_size=32), progress=False)
    from spear.compensate.lowrank import LowRankCompensator

    g = torch.Generator().manual_seed(0)
    for q in list(mods.values())[::3]:
        q.compensator = LowRankCompensator(torch.randn(4, q.in_features, generator=g) * 0.01,
                                           torch.randn(q.out_features, 4, generator=g) * 0.01)
    dense, _ = build_model(*loader.from_module(model), "cpu", torch.float32, MAX_RANK, kernels=False)
    ids = list(range(5, 40))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    packed_tokens = eng.generate([ids], params)[0].output_token_ids
    eng.core.model, eng.core.runner.model = dense, dense
    eng.core.runner.kv_caches = [(k.float(), v.float()) for k, v in eng.core.runner.kv_caches]
    eng.core.runner.cos, eng.core.runner.sin = eng.core.runner.cos.float(), eng.core.runner.sin.float()
    assert eng.generate([ids], params)[0].output_token_ids == packed_tokens


def test_the_warmup_the_op_and_the_log_plan_alike_on_a_hopper(tiny_llama_path, monkeypatch):
    """On a Hopper GPU (the planner's capability query faked, so plans take the Gluon GEMM where its
    table says), the warm-up's kernel signature, the op's plan at run time and the engine's log ask
    the same planner and get the same plan for every W4 layer class at every warm-up token count.

    Catches: a caller that plans for another device than the one the op runs on (the warm-up once
    planned without Gluon on Hopper, so a request paid a Gluon compile mid-run)."""
    from spear.kernels import ops, planner

    monkeypatch.setattr(planner, "capability", lambda device: (9, 0))
    monkeypatch.setattr(planner, "_have_gluon", lambda: True)
    runner = _kernel_engine(tiny_llama_path, KernelPolicy()).core.runner
    counts = runner.warmup_token_counts(256)
    calls: list[tuple[str, int, tuple, object]] = []
    phase = ["warm-up"]

    def recording(real):
        def plan(tokens, n, k, rank, weight, device, policy):
            p = real(tokens, n, k, rank, weight, device, policy)
            calls.append((phase[0], tokens, (n, k, rank, weight), p))
            return p
        return plan

    monkeypatch.setattr(planner, "plan", recording(planner.plan))
    monkeypatch.setattr(ops, "plan", recording(ops.plan))
    # the planned kernels cannot run on the CPU: the op runs the reference whatever its plan says
    monkeypatch.setattr(ops, "run", lambda p, x, w, bias, e, act, pdl, overlap:
                        ops._reference(x, w, bias, None, act, e, None, pdl))
    warm = {t: {key: p for key, p in runner.kernel_signature(t)} for t in counts}
    phase[0] = "op"
    runner.warmup(counts)
    phase[0] = "log"
    report = runner.kernel_report(tokens=tuple(counts))
    assert len(report) == len({key for t in counts for key in warm[t]}) and all("W4" in line for line in report)

    def plans(name):
        out: dict = {}
        for ph, t, key, p in calls:
            if ph == name:
                assert out.setdefault((t, key), p) == p, (name, t, key)
        return out

    expect = {(t, key): p for t, by_key in warm.items() for key, p in by_key.items()}
    assert plans("warm-up") == expect
    assert plans("op") == expect, "the op ran a plan the warm-up did not compile"
    assert plans("log") == expect
    kernels = {p.kernel for p in expect.values()}
    assert planner.Kernel.GLUON in kernels and planner.Kernel.TRITON in kernels, kernels


def test_the_compile_pass_covers_every_w4_launch_the_warmup_makes(tiny_llama_path, monkeypatch):
    """On a Hopper GPU (capability faked as above), every W4 call the warm-up's steps make (its form:
    shape, format, compensator, activation, bias, dtype, PDL level, and the op's plan at its token
    count) is one the parallel compile pass runs, and the pass runs no form twice under one plan.

    Catches: a launch the pass builds differently from the layer's own call (the SiLU·mul epilogue
    of gate/up, a bias, a gated compensator's width, the step's PDL level), so the warm-up would
    still compile it serially."""
    from dataclasses import replace

    from spear.kernels import ops, planner

    monkeypatch.setattr(planner, "capability", lambda device: (9, 0))
    monkeypatch.setattr(planner, "_have_gluon", lambda: True)
    runner = _kernel_engine(tiny_llama_path, KernelPolicy()).core.runner
    launches = runner.kernel_launches()
    planned = {(replace(x, tokens=0), planner.plan(x.tokens, x.n, x.k, x.rank,
                                                    planner.WeightFormat(x.layout, x.group_size),
                                                    runner.device, runner.policy)) for x in launches}
    assert len(planned) == len(launches), "two launches of one form under one plan"
    seen = []
    real = ops.w4a16_ec_impl

    def spy(x, w, bias, ec, act, policy, pdl):
        from spear.kernels.precompile import W4Launch

        form = W4Launch(w.out_features, w.in_features, w.group_size, w.symmetric, w.layout,
                        0 if ec is None else ec.a.shape[0], 0 if ec is None or ec.w1 is None else ec.w1.shape[0],
                        act, bias is not None, x.dtype, 0, pdl)
        seen.append((form, planner.plan(x.shape[0], w.out_features, w.in_features, form.rank, w.format,
                                        x.device, policy)))
        return ops._reference(x, w, bias, None, act, ec, None, pdl)

    monkeypatch.setattr(ops, "w4a16_ec_impl", spy)
    runner.warmup(runner.warmup_token_counts(256))
    assert seen and {f.act for f, _ in seen} == {0, 1} and any(f.rank for f, _ in seen)
    missing = set(seen) - planned
    assert not missing, f"the warm-up made launches the compile pass does not: {sorted(map(str, missing))[:3]}"


def test_compile_launches_runs_each_launch_and_reports_what_fails(monkeypatch):
    """The pass runs every launch (in process and in worker processes; on the CPU the op runs its
    torch reference) and reports a launch, or a worker, that cannot run instead of raising."""
    from spear.kernels import precompile
    from spear.kernels.layout import Layout
    from spear.kernels.precompile import W4Launch, compile_launches

    good = [W4Launch(64, 128, 32, False, Layout.FRAGMENT, 16, 16, 0, True, torch.float16, 5, 0),
            W4Launch(32, 64, 0, True, Layout.NMAJOR, 0, 0, 1, False, torch.float16, 1, 0)]
    bad = W4Launch(64, 100, 32, False, Layout.FRAGMENT, 0, 0, 0, False, torch.float16, 3, 0)  # 100 % 32 != 0
    ran = []
    monkeypatch.setattr(precompile, "run_launch", lambda x, d, p, real=precompile.run_launch: (ran.append(x),
                                                                                              real(x, d, p)))
    report = compile_launches(good + [bad], "cpu", KernelPolicy(), workers=0)
    assert report.launches == 3 and len(report.failed) == 1 and "W4Launch(n=64, k=100" in report.failed[0]
    assert sorted(ran, key=str) == sorted(good + [bad], key=str)
    # the first launch returns at once on the CPU (no compile): the cache counts as warm, no pool
    ran.clear()
    report = compile_launches(good, "cpu", KernelPolicy(), workers=2)
    assert report.cached and report.failed == [] and len(ran) == 1
    # a slow first launch (a compile): the rest run in worker processes
    report = compile_launches(good + [bad], "cpu", KernelPolicy(), workers=2, cached_s=0.0)
    assert not report.cached and report.workers == 2 and len(report.failed) == 1, report
    if not torch.cuda.is_available():  # workers that cannot reach the device exit: reported, not raised
        report = compile_launches(good + [bad], "cuda:0", KernelPolicy(), workers=2)
        assert len(report.failed) == 3 and sum("compile worker exited with code 1" in f for f in report.failed) == 2


def test_compile_workers_do_not_rerun_an_unguarded_main_script(tmp_path):
    """A script that builds an engine at its top level, without ``if __name__ == "__main__"``: the
    workers are plain interpreters, so its top level runs once (multiprocessing's spawned children
    would run it again in each, loading the model again)."""
    import subprocess
    import sys
    from pathlib import Path

    marker, script = tmp_path / "runs.txt", tmp_path / "embed.py"
    script.write_text(
        "import torch\n"
        "from spear.kernels import precompile\n"
        "from spear.kernels.layout import Layout\n"
        "from spear.kernels.policy import KernelPolicy\n"
        f"open({str(marker)!r}, 'a').write('run\\n')\n"
        "L = [precompile.W4Launch(64, 128, 32, False, Layout.FRAGMENT, 0, 0, 0, False, torch.float16, t, 0)"
        " for t in (1, 2, 3)]\n"
        "r = precompile.compile_launches(L, 'cpu', KernelPolicy(), workers=2, cached_s=0.0)\n"
        "assert r.failed == [] and not r.cached, r\n")
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert marker.read_text() == "run\n"


def test_compile_workers_is_checked():
    import pytest

    from spear.errors import SpearError

    for bad in (-1, 1.5, True):
        with pytest.raises(SpearError, match="compile_workers"):
            EngineConfig(compile_workers=bad)
    assert EngineConfig(compile_workers=0).compile_workers == 0
