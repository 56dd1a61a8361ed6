"""benchmarks/bench_decode.py --tiny runs on the CPU and writes its table."""

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_decode.py"


def test_bench_decode_tiny(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_decode", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--tiny", "--batches", "1,4", "--gen", "4", "--warmup", "2", "--w4-head",
                       "--w8-head", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["results"]
    assert [r["variant"] for r in rows] == ["fp32", "w4", "w4+ec", "w4 head", "w4 w8-head"]
    assert all(r["tok_s@1"] > 0 and r["tok_s@4"] > 0 for r in rows)
    assert 0 < rows[2]["extra_pct"] < 2
    assert "| tiny | w4+ec |" in (tmp_path / "table.md").read_text()


def test_bench_decode_inputs_runs(capsys):
    spec = importlib.util.spec_from_file_location("bench_decode_inputs", BENCH.parent / "bench_decode_inputs.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--batch", "3", "--cases", "12:16,28:32"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| 12 | 16 |", "| 28 | 32 |"))]
    assert len(rows) == 2
    with pytest.raises(SystemExit):
        bench.main(["--cases", "30:32"])  # no room to grow


@pytest.mark.parametrize("bad", ["0", "1,x", ","])
def test_bench_decode_refuses_bad_profile_batches(bad, capsys):
    spec = importlib.util.spec_from_file_location("bench_decode", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    with pytest.raises(SystemExit) as e:
        bench.main(["--tiny", "--profile", bad])
    assert e.value.code == 2 and "batch sizes >= 1" in capsys.readouterr().err
    assert bench._batch_list("8, 16") == [8, 16]


def test_bench_decode_options_build_the_kernel_policy(tmp_path):
    """Each kernel option reaches the engine as a KernelPolicy field; nothing is set process-wide."""
    from types import SimpleNamespace

    from spear.kernels.policy import KernelPolicy

    spec = importlib.util.spec_from_file_location("bench_decode", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    with pytest.raises(SystemExit):
        bench.main(["--tiny", "--fused-max-m", "65"])  # beyond the fused kernel's tiles
    opts = {dest: None for dest, _ in bench.POLICY_OPTIONS}
    p = bench.policy_from(SimpleNamespace(**{**opts, "fused_max_m": 8, "gate_programs": 3, "rope_in_attention": False}))
    assert p == KernelPolicy(fused_max_m=8, gate_programs=3, rope_in_attention=False) != KernelPolicy()
    assert bench.main(["--tiny", "--batches", "1", "--gen", "2", "--warmup", "1", "--fused-max-m", "8",
                       "--gate-programs", "3", "--no-rope-in-attention", "--out", str(tmp_path)]) == 0
    assert KernelPolicy().fused_max_m == 64  # the defaults untouched
