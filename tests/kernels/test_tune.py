"""spear.kernels.tune and ``spear tune-kernels``: the shapes a model's layers give, the table a
sweep's rows give, and the command's refusals; the sweep itself on a GPU (marker gpu)."""

import json

import pytest
import torch
from transformers import LlamaConfig

from spear.cli import main
from spear.kernels import launch, tune
from tests.kernels._helpers import DEVICE


def test_model_shapes_are_the_engines_fused_gemms():
    llama2 = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32)
    assert tune.model_shapes(llama2) == [("qkv", 12288, 4096), ("o", 4096, 4096), ("gate_up", 22016, 4096),
                                         ("down", 4096, 11008)]
    llama3 = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8)
    assert tune.model_shapes(llama3)[0] == ("qkv", 6144, 4096)


def _row(m, n, us_by_launch, tc_us):
    sweep = {tune.launch_key(lc): dict(launch=lc, us=us) for lc, us in us_by_launch}
    return {"m": m, "n": n, "k": 4096, "kmajor": {"sweep": sweep, "tc_us": tc_us}}


A = dict(BN=64, num_warps=2, programs=528, prefetch=True, num_stages=1, pipeline=1)
B = dict(BN=64, num_warps=4, programs=264, prefetch=False, num_stages=1, pipeline=3)


def test_narrow_layers_get_their_own_launch_only_when_it_wins_there():
    # A wins the geometric mean at one token; B is faster on the 4096-wide layer
    rows = [_row(1, 4096, [(A, 8.0), (B, 7.0)], 12.0), _row(1, 28672, [(A, 20.0), (B, 26.0)], 40.0)]
    table = tune.launch_table(rows, {"kmajor": True})
    assert table["fma_kmajor"] == dict(BN=64, BK=128, num_warps=2, num_stages=1, programs=528, prefetch=True)
    narrow = tune.narrow_launch(rows, table["fma_kmajor"])
    assert narrow == dict(max_n=4096, BN=64, BK=128, num_warps=4, num_stages=1, programs=264, pipeline=3)
    launch.check_table(dict(table, fma_kmajor_narrow=narrow))
    # where the one-token launch is also the best on the narrow layer, there is no narrow launch
    rows[0] = _row(1, 4096, [(A, 7.0), (B, 8.0)], 12.0)
    assert tune.narrow_launch(rows, table["fma_kmajor"]) is None


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
    _write_json(path, dict(launch.LAUNCH))
    assert launch.read_table(path) == json.loads(json.dumps(launch.LAUNCH))
    assert [p.name for p in path.parent.iterdir()] == ["table.json"]  # no temporary file left
    with pytest.raises(TypeError):
        _write_json(path, {"x": object()})
    assert [p.name for p in path.parent.iterdir()] == ["table.json"]
    assert launch.read_table(path) == json.loads(json.dumps(launch.LAUNCH))  # the old table intact


@pytest.mark.gpu
def test_gpu_tune_writes_a_table_the_engine_takes(monkeypatch):
    if DEVICE != "cuda":
        pytest.skip("needs CUDA")
    monkeypatch.setattr(launch, "LAUNCH", json.loads(json.dumps(launch.LAUNCH)))
    grid = dict(BN=[64], num_warps=[2, 4], programs=[264], prefetch=[0, 1], num_stages=[1], pipeline=[1, 3])
    table, rows = tune.tune([("o", 1024, 1024), ("up", 4096, 1024)], tokens=(1, 2), grid=grid, progress=False)
    assert len(rows) == 4 and all(len(r["kmajor"]["sweep"]) == 6 for r in rows)
    assert all("us" in v for r in rows for v in r["kmajor"]["sweep"].values()), "a launch failed its check"
    launch.use_table(table)
    assert launch.pick_config(1, 1024, 1024, 128, kmajor=True).BN == 64
