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


def test_bench_decode_options_set_the_module_constants(tmp_path, monkeypatch):
    from spear.kernels import ec, ops
    from spear.serve import model_runner

    for mod, name in ((ops, "FUSED_MAX_M"), (ec, "GATE_PROGRAMS"), (model_runner, "ROPE_IN_ATTENTION")):
        monkeypatch.setattr(mod, name, getattr(mod, name))  # restored after the test
    spec = importlib.util.spec_from_file_location("bench_decode", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    with pytest.raises(SystemExit):
        bench.main(["--tiny", "--fused-max-m", "0"])
    assert bench.main(["--tiny", "--batches", "1", "--gen", "2", "--warmup", "1", "--fused-max-m", "8",
                       "--gate-programs", "3", "--no-rope-in-attention", "--out", str(tmp_path)]) == 0
    assert (ops.FUSED_MAX_M, ec.GATE_PROGRAMS, model_runner.ROPE_IN_ATTENTION) == (8, 3, False)
