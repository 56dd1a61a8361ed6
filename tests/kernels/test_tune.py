"""spear.kernels.tune and ``spear tune-kernels``: the sweep's grid, the shapes a model's layers
give, the table a sweep's rows give, and the command's refusals; the sweep itself on a GPU (marker
gpu)."""

import pytest
import torch
from transformers import LlamaConfig

from spear.cli import main
from spear.kernels import launch, tune
from tests.kernels._helpers import DEVICE


def plain(t):
    return {k: plain(v) for k, v in t.items()} if hasattr(t, "items") else t


def test_grid_spans_num_stages_and_prefetch_only_for_kmajor():
    grid = dict(BN=[64], num_warps=[2], programs=[528], prefetch=[0, 1], num_stages=[1, 3])
    for m, mv in ((1, 1), (2, 2), (3, 4)):
        kmajor = list(tune.fma_configs(m, 4096, 4096, True, grid))
        nmajor = list(tune.fma_configs(m, 4096, 4096, False, grid))
        assert sorted((c.prefetch, c.num_stages) for _, c in kmajor) == [(False, 1), (False, 3), (True, 1), (True, 3)]
        assert sorted((c.prefetch, c.num_stages) for _, c in nmajor) == [(False, 1), (False, 3)]
        assert all(c.mv == mv and c.BN == 64 and c.num_warps == 2 and c.BK == 128 for _, c in kmajor + nmajor)
        # split-K from the program count: 64 column tiles x 16 >= 528
        assert all(c.split_k == 16 for _, c in kmajor) and all(lc["programs"] == 528 for lc, _ in kmajor)


def test_tc_config_is_the_tensor_core_launch_without_touching_the_table():
    for kmajor in (True, False):
        key = "fma_kmajor_max_m" if kmajor else "fma_max_m"
        c = tune.tc_config(1, 4096, 4096, kmajor)
        assert c.mv == 0 and c == launch.pick_config(1, 4096, 4096, tune.GROUP, "kmajor" if kmajor else "nmajor", launch.merged_table({key: 0}))
        assert launch.pick_config(1, 4096, 4096, tune.GROUP, "kmajor" if kmajor else "nmajor").mv == 1  # the built-in table: the loop
    assert launch.BUILTIN["fma_kmajor_max_m"] == 4 and launch.BUILTIN["fma_max_m"] == 1


def test_launch_table_takes_the_best_geomean_and_its_stages():
    def row(m, fast_us, slow_us, tc_us):
        sweep = {"BN64_w2_p528_pf_s3": dict(launch=dict(BN=64, num_warps=2, programs=528, prefetch=True,
                                                        num_stages=3), us=fast_us),
                 "BN64_w2_p528_pf": dict(launch=dict(BN=64, num_warps=2, programs=528, prefetch=True,
                                                     num_stages=1), us=slow_us)}
        return {"m": m, "kmajor": {"sweep": sweep, "tc_us": tc_us}}

    # M = 1: the 3-stage launch wins on both shapes; M = 2: it still beats the tensor-core tiles;
    # M = 4: it loses to them, so the CUDA-core loop is used up to M = 2
    rows = [row(1, 8.0, 9.0, 12.0), row(1, 20.0, 21.0, 30.0), row(2, 11.0, 12.0, 12.5), row(4, 14.0, 15.0, 12.0)]
    table = tune.launch_table(rows, {"kmajor": True})
    assert table["fma_kmajor"] == dict(BN=64, BK=128, num_warps=2, num_stages=3, programs=528, prefetch=True)
    assert table["fma_kmajor_max_m"] == 2
    assert table["fma_kmajor_by_mv"] == {}  # M = 2's best is M = 1's launch
    launch.check_table(table)


def test_launch_table_keeps_a_token_class_launch_of_its_own():
    def row(m, us_by_key, tc_us):
        launches = {"A": dict(BN=64, num_warps=2, programs=528, prefetch=True, num_stages=1),
                    "B": dict(BN=64, num_warps=4, programs=264, prefetch=False, num_stages=2)}
        return {"m": m, "kmajor": {"sweep": {k: dict(launch=launches[k], us=us) for k, us in us_by_key.items()},
                                   "tc_us": tc_us}}

    # M = 1: A best; M = 2: B best and ahead of the tiles; M = 4: B best but behind the tiles
    rows = [row(1, dict(A=8.0, B=9.0), 12.0), row(2, dict(A=12.0, B=10.0), 11.0),
            row(4, dict(A=16.0, B=13.0), 12.5)]
    table = tune.launch_table(rows, {"kmajor": True})
    assert table["fma_kmajor"]["num_warps"] == 2 and table["fma_kmajor"]["prefetch"]
    assert table["fma_kmajor_by_mv"] == {"2": dict(BN=64, BK=128, num_warps=4, num_stages=2, programs=264)}
    assert table["fma_kmajor_max_m"] == 2
    launch.check_table(table)


def test_model_shapes_are_the_engines_fused_gemms():
    llama2 = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32)
    assert tune.model_shapes(llama2) == [("qkv", 12288, 4096), ("o", 4096, 4096), ("gate_up", 22016, 4096),
                                         ("down", 4096, 11008)]
    llama3 = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8)
    assert tune.model_shapes(llama3)[0] == ("qkv", 6144, 4096)


def _row(m, n, us_by_launch, tc_us):
    sweep = {tune.launch_key(lc): dict(launch=lc, us=us) for lc, us in us_by_launch}
    return {"m": m, "n": n, "k": 4096, "kmajor": {"sweep": sweep, "tc_us": tc_us}}


A = dict(BN=64, num_warps=2, programs=528, prefetch=True, num_stages=1)
B = dict(BN=64, num_warps=4, programs=264, prefetch=False, num_stages=2)


def test_narrow_layers_get_their_own_launch_only_when_it_wins_there():
    # A wins the geometric mean at one token; B is faster on the 4096-wide layer
    rows = [_row(1, 4096, [(A, 8.0), (B, 7.0)], 12.0), _row(1, 28672, [(A, 20.0), (B, 26.0)], 40.0)]
    table = tune.launch_table(rows, {"kmajor": True})
    assert table["fma_kmajor"] == dict(BN=64, BK=128, num_warps=2, num_stages=1, programs=528, prefetch=True)
    narrow = tune.narrow_launch(rows, table["fma_kmajor"])
    assert narrow == dict(max_n=4096, BN=64, BK=128, num_warps=4, num_stages=2, programs=264)
    launch.check_table(dict(table, fma_kmajor_narrow=narrow))
    # where the one-token launch is also the best on the narrow layer, there is no narrow launch
    rows[0] = _row(1, 4096, [(A, 7.0), (B, 8.0)], 12.0)
    assert tune.narrow_launch(rows, table["fma_kmajor"]) is None


def test_tuner_grid_and_table_for_the_fragment_loop():
    """``spear tune-kernels --layout mma`` sweeps the CUDA-core loop with the register prefetch on and
    off, times the fragment layout's tensor-core tiles beside it, and writes the "fma_mma" entries."""
    grid = dict(BN=[64], num_warps=[2], programs=[528], prefetch=[0, 1], num_stages=[1])
    cfgs = list(tune.fma_configs(3, 4096, 4096, "mma", grid))
    assert sorted(c.prefetch for _, c in cfgs) == [False, True] and all(c.mv == 4 for _, c in cfgs)
    tc = tune.tc_config(1, 4096, 4096, "mma")
    assert tc.mv == 0 and tc == launch.pick_config(16, 4096, 4096, tune.GROUP, "mma")
    # the class sweep of the tensor-core tiles times them at one token too, not the CUDA-core loop
    assert tune.mma_config(1, 4096, 4096, dict(launch.BUILTIN["mma"]["16"])).mv == 0

    def row(m, n, us, tc_us):
        sweep = {tune.launch_key(lc): dict(launch=lc, us=u) for lc, u in us}
        return {"m": m, "n": n, "k": 4096, "mma": {"sweep": sweep, "tc_us": tc_us}}

    a = dict(BN=64, num_warps=2, programs=528, prefetch=True, num_stages=1)
    b = dict(BN=128, num_warps=4, programs=264, prefetch=False, num_stages=1)
    rows = [row(1, 4096, [(a, 8.0), (b, 7.0)], 9.0), row(1, 28672, [(a, 20.0), (b, 30.0)], 30.0),
            row(2, 4096, [(a, 9.0), (b, 8.0)], 9.5), row(2, 28672, [(a, 22.0), (b, 21.0)], 30.0),
            row(4, 4096, [(a, 12.0), (b, 13.0)], 10.0), row(4, 28672, [(a, 30.0), (b, 32.0)], 29.0)]
    table = tune.launch_table(rows, ("mma",))
    assert table["fma_mma"] == dict(BN=64, BK=128, num_warps=2, num_stages=1, programs=528, prefetch=True)
    assert table["fma_mma_by_mv"] == {"2": dict(BN=128, BK=128, num_warps=4, num_stages=1, programs=264)}
    assert table["fma_mma_max_m"] == 2  # at 4 tokens the tiles win
    narrow = tune.narrow_launch(rows, table["fma_mma"], layout="mma")
    assert narrow == dict(max_n=4096, BN=128, BK=128, num_warps=4, num_stages=1, programs=264)
    launch.check_table(dict(table, fma_mma_narrow=narrow))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal without a GPU")
def test_tune_kernels_needs_a_gpu_and_checks_its_arguments(tmp_path, capsys):
    out = tmp_path / "table.json"
    assert main(["tune-kernels", "--out", str(out)]) == 2
    assert "on a CUDA GPU; none is available here" in capsys.readouterr().err
    assert not out.exists()
    with pytest.raises(SystemExit) as e:
        main(["tune-kernels", "--out", str(out), "--tokens", "1,3"])
    assert e.value.code == 2 and "token counts are 1, 2 and 4" in capsys.readouterr().err
    with pytest.raises(RuntimeError, match="CUDA GPU"):
        tune.tune([("t", 256, 256)])


def test_the_table_is_written_whole(tmp_path):
    from spear.cli.tune_kernels import _write_json

    path = tmp_path / "sub" / "table.json"
    _write_json(path, plain(launch.BUILTIN))
    assert launch.read_table(path) == plain(launch.BUILTIN)
    assert [p.name for p in path.parent.iterdir()] == ["table.json"]  # no temporary file left
    with pytest.raises(TypeError):
        _write_json(path, {"x": object()})
    assert [p.name for p in path.parent.iterdir()] == ["table.json"]
    assert launch.read_table(path) == plain(launch.BUILTIN)  # the old table intact


@pytest.mark.gpu
def test_gpu_tune_writes_a_table_the_engine_takes():
    if DEVICE != "cuda":
        pytest.skip("needs CUDA")
    grid = dict(BN=[64], num_warps=[2, 4], programs=[264], prefetch=[0, 1], num_stages=[1, 2])
    table, rows = tune.tune([("o", 1024, 1024), ("up", 4096, 1024)], tokens=(1, 2), grid=grid, progress=False)
    assert len(rows) == 4 and all(len(r["kmajor"]["sweep"]) == 8 for r in rows)
    assert all("us" in v for r in rows for v in r["kmajor"]["sweep"].values()), "a launch failed its check"
    merged = launch.merged_table(table)
    assert launch.pick_config(1, 1024, 1024, 128, layout="kmajor", table=merged).BN == 64
