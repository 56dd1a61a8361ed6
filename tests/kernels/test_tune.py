"""spear.kernels.tune and ``spear tune-kernels``: each token class's launch grid, the launches it
makes, the shapes a model's layers give, the table a sweep's rows give, and the command's refusals;
the sweep itself on a GPU (marker gpu)."""

import pytest
import torch
from transformers import LlamaConfig

from spear.cli import main
from spear.kernels import launch, tune
from tests.kernels._helpers import DEVICE


def test_every_class_has_a_grid_of_valid_launches():
    """Each class's grid holds only launches the table accepts and the fragment GEMM takes; split-K
    follows from an entry's programs as the engine's launches do."""
    assert set(tune.FRAGMENT_TOKENS) == set(launch.FRAGMENT_CLASSES)
    for cls in launch.FRAGMENT_CLASSES:
        grid = tune._fragment_grid(cls)
        assert grid and len({tune.launch_key(e) for e in grid}) == len(grid), cls
        for e in grid:
            launch.check_table({"fragment": {cls: e}})
            for m in tune.FRAGMENT_TOKENS[cls]:
                cfg = tune.fragment_config(m, 4096, 4096, e)
                assert (cfg.BM, cfg.BN, cfg.num_warps, cfg.mv) == (e["BM"], e["BN"], e["num_warps"], 0)
                if not e.get("programs"):
                    assert cfg.split_k == 1
    e = dict(BM=16, BN=64, BK=128, num_warps=4, num_stages=3, programs=264)
    assert tune.fragment_config(1, 4096, 4096, e) == launch.pick_triton(1, 4096, 4096, True, tune.GROUP)


def test_fragment_table_takes_the_best_geomean_per_class():
    def row(cls, m, **us):
        return {"class": cls, "m": m, "sweep": {k: dict(launch=dict(BM=16, BN=int(k[2:]), BK=128, num_warps=4,
                                                                    num_stages=3), us=v) for k, v in us.items()}}

    # class 16: BN64 wins the geometric mean over its two token counts though BN128 wins one of them
    rows = [row("16", 1, BN64=10.0, BN128=9.0), row("16", 16, BN64=10.0, BN128=12.0),
            row("32", 32, BN64=10.0, BN128=8.0)]
    rows[2]["sweep"]["BN256"] = dict(launch={}, error="out of resources")
    table = tune.fragment_table(rows)
    assert {c: e["BN"] for c, e in table.items()} == {"16": 64, "32": 128}
    launch.check_table({"fragment": table})


def test_model_shapes_are_the_engines_fused_gemms():
    llama2 = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32)
    assert tune.model_shapes(llama2) == [("qkv", 12288, 4096), ("o", 4096, 4096), ("gate_up", 22016, 4096),
                                         ("down", 4096, 11008)]
    llama3 = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8)
    assert tune.model_shapes(llama3)[0] == ("qkv", 6144, 4096)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal without a GPU")
def test_tune_kernels_needs_a_gpu_and_checks_its_arguments(tmp_path, capsys):
    out = tmp_path / "table.json"
    assert main(["tune-kernels", "--out", str(out)]) == 2
    assert "on a CUDA GPU; none is available here" in capsys.readouterr().err
    assert not out.exists()
    for bad, message in ((["--kernel", "kmajor"], "invalid choice: 'kmajor'"), (["--classes", "8"], "token classes"),
                         (["--shapes", "4096x4000"], "the fragment layout's tile")):
        with pytest.raises(SystemExit) as e:
            main(["tune-kernels", "--out", str(out), *bad])
        assert e.value.code == 2 and message in capsys.readouterr().err
    with pytest.raises(RuntimeError, match="CUDA GPU"):
        tune.tune_fragment([("t", 256, 256)])


def test_the_table_is_written_whole(tmp_path):
    from spear.cli.tune_kernels import _write_json

    path = tmp_path / "sub" / "table.json"
    _write_json(path, launch.to_json(launch.BUILTIN))
    assert launch.read_table(path) == launch.BUILTIN
    assert [p.name for p in path.parent.iterdir()] == ["table.json"]  # no temporary file left
    with pytest.raises(TypeError):
        _write_json(path, {"x": object()})
    assert [p.name for p in path.parent.iterdir()] == ["table.json"]
    assert launch.read_table(path) == launch.BUILTIN  # the old table intact


@pytest.mark.gpu
def test_gpu_tune_writes_a_table_the_engine_takes():
    if DEVICE != "cuda":
        pytest.skip("needs CUDA")
    table, rows = tune.tune_fragment([("o", 1024, 1024), ("up", 4096, 1024)], classes=["16", "64"], progress=False)
    assert len(rows) == 6 and all(r["sweep"] and "fp16_us" in r and "default_us" in r for r in rows)
    assert all("us" in v for r in rows for v in r["sweep"].values()), "a launch failed its check"
    merged = launch.merged_table(table)
    assert set(table["fragment"]) == {"16", "64"} and merged["fragment"]["32"] == launch.BUILTIN["fragment"]["32"]
