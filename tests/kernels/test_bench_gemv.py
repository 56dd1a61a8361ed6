"""benchmarks/bench_gemv.py's sweep grid and launch-table choice (pure Python; the timing needs a GPU)."""

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_gemv.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_gemv", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_grid_spans_num_stages_and_prefetch_only_for_kmajor():
    g = _load()
    grid = dict(BN=[64], num_warps=[2], programs=[528], prefetch=[0, 1], num_stages=[1, 3])
    kmajor = list(g.fma_configs(1, 4096, 4096, True, grid))
    nmajor = list(g.fma_configs(1, 4096, 4096, False, grid))
    assert sorted((c.prefetch, c.num_stages) for _, c in kmajor) == [(False, 1), (False, 3), (True, 1), (True, 3)]
    assert sorted((c.prefetch, c.num_stages) for _, c in nmajor) == [(False, 1), (False, 3)]
    assert all(c.mv == 1 and c.BN == 64 and c.num_warps == 2 for _, c in kmajor)


def test_grid_spans_the_pipeline_without_the_register_prefetch():
    g = _load()
    grid = dict(BN=[64], num_warps=[2], programs=[528], prefetch=[0, 1], num_stages=[1], pipeline=[1, 3])
    kmajor = sorted((c.prefetch, c.pipeline) for _, c in g.fma_configs(2, 4096, 4096, True, grid))
    assert kmajor == [(False, 1), (False, 3), (True, 1)]  # the two are alternatives
    assert [(c.prefetch, c.pipeline) for _, c in g.fma_configs(2, 4096, 4096, False, grid)] == [(False, 1)]
    assert g._launch_entry(dict(BN=64, num_warps=2, programs=528, pipeline=3))["pipeline"] == 3
    assert "pipeline" not in g._launch_entry(dict(BN=64, num_warps=2, programs=528, pipeline=1))


def test_launch_table_takes_the_best_geomean_and_its_stages():
    g = _load()

    def row(m, fast_us, slow_us, tc_us):
        sweep = {"BN64_w2_p528_pf_s3": dict(launch=dict(BN=64, num_warps=2, programs=528, prefetch=True,
                                                        num_stages=3), us=fast_us),
                 "BN64_w2_p528_pf": dict(launch=dict(BN=64, num_warps=2, programs=528, prefetch=True,
                                                     num_stages=1), us=slow_us)}
        return {"m": m, "kmajor": {"sweep": sweep, "tc_us": tc_us}}

    # M = 1: the 3-stage launch wins on both shapes; M = 2: it still beats the tensor-core tiles;
    # M = 4: it loses to them, so the CUDA-core loop is used up to M = 2
    rows = [row(1, 8.0, 9.0, 12.0), row(1, 20.0, 21.0, 30.0), row(2, 11.0, 12.0, 12.5), row(4, 14.0, 15.0, 12.0)]
    table = g.launch_table(rows, {"kmajor": True})
    assert table["fma_kmajor"] == dict(BN=64, BK=128, num_warps=2, num_stages=3, programs=528, prefetch=True)
    assert table["fma_kmajor_max_m"] == 2
    assert table["fma_kmajor_by_mv"] == {}  # M = 2's best is M = 1's launch


def test_launch_table_keeps_a_token_class_launch_of_its_own():
    g = _load()

    def row(m, us_by_key, tc_us):
        launches = {"A": dict(BN=64, num_warps=2, programs=528, prefetch=True, num_stages=1),
                    "B": dict(BN=64, num_warps=4, programs=264, prefetch=False, num_stages=2)}
        return {"m": m, "kmajor": {"sweep": {k: dict(launch=launches[k], us=us) for k, us in us_by_key.items()},
                                   "tc_us": tc_us}}

    # M = 1: A best; M = 2: B best and ahead of the tiles; M = 4: B best but behind the tiles
    rows = [row(1, dict(A=8.0, B=9.0), 12.0), row(2, dict(A=12.0, B=10.0), 11.0),
            row(4, dict(A=16.0, B=13.0), 12.5)]
    table = g.launch_table(rows, {"kmajor": True})
    assert table["fma_kmajor"]["num_warps"] == 2 and table["fma_kmajor"]["prefetch"]
    assert table["fma_kmajor_by_mv"] == {"2": dict(BN=64, BK=128, num_warps=4, num_stages=2, programs=264)}
    assert table["fma_kmajor_max_m"] == 2
