"""The W4 kernel's launch table: checking a table, reading one from JSON, dispatching with it."""

import json

import pytest

from spear.kernels import launch


@pytest.fixture
def table(monkeypatch):
    """A private copy of the built-in table for one test (``use_table`` updates it in place)."""
    t = json.loads(json.dumps(launch.LAUNCH))
    monkeypatch.setattr(launch, "LAUNCH", t)
    return t


def test_the_built_in_table_and_a_json_roundtrip_are_valid(tmp_path):
    assert launch.check_table(launch.LAUNCH) is launch.LAUNCH
    path = tmp_path / "launch_table.json"
    path.write_text(json.dumps(launch.LAUNCH))
    assert launch.read_table(path) == json.loads(json.dumps(launch.LAUNCH))


@pytest.mark.parametrize("bad,message", [
    ([1, 2], "must be a JSON object"),
    ({"fma_wide": {}}, "unknown launch table key 'fma_wide'"),
    ({"fma": {"BN": 64, "warps": 2}}, r"fma: unknown field\(s\) \['warps'\]"),
    ({"fma": {"BN": 48}}, "fma.BN must be a power of two, got 48"),
    ({"tc": {"programs": 0}}, "tc.programs must be a positive integer, got 0"),
    ({"tc": {"num_stages": 2.5}}, "tc.num_stages must be a positive integer"),
    ({"tc": {"num_stages": True}}, "tc.num_stages must be a positive integer"),
    ({"fma_kmajor": {"prefetch": "yes"}}, "fma_kmajor.prefetch must be true or false"),
    ({"fma_kmajor": {"prefetch": True, "pipeline": 3}}, "alternatives"),
    ({"fma_kmajor_max_m": 8}, "fma_kmajor_max_m must be an integer from 0 to 4"),
    ({"fma_kmajor_by_mv": {"3": {"BN": 64}}}, "token classes"),
    ({"fma_kmajor_by_mv": {"2": {"BN": 96}}}, r"fma_kmajor_by_mv.2.BN must be a power of two"),
    ({"prefill": None}, "prefill: a launch entry must be an object"),
    ({"tc": {"u_split": 0}}, "tc.u_split must be a positive integer, got 0"),
])
def test_bad_tables_are_refused_with_the_key(bad, message):
    with pytest.raises(ValueError, match=message):
        launch.check_table(bad)


def test_unreadable_files_are_refused(tmp_path):
    with pytest.raises(ValueError, match="cannot read the launch table"):
        launch.read_table(tmp_path / "missing.json")
    broken = tmp_path / "broken.json"
    broken.write_text('{"fma": ')
    with pytest.raises(ValueError, match="is not valid JSON"):
        launch.read_table(broken)


def test_use_table_changes_the_dispatch_key_by_key(table, tmp_path):
    before = launch.pick_config(2, 4096, 4096, 128, kmajor=True)
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"fma_kmajor_by_mv": {"2": dict(BN=32, BK=128, num_warps=4, num_stages=1,
                                                              programs=264, pipeline=4)},
                                "fma_kmajor_narrow": None}))
    launch.use_table(path)
    two = launch.pick_config(2, 4096, 4096, 128, kmajor=True)
    assert (two.BN, two.num_warps, two.pipeline, two.prefetch) == (32, 4, 4, False)
    assert (before.BN, before.pipeline) == (64, 1)
    # keys the file does not name keep their values; the narrow launch is now off
    assert table["tc"] == launch.LAUNCH["tc"] and launch.LAUNCH["fma_kmajor_narrow"] is None
    assert launch.pick_config(1, 4096, 4096, 128, kmajor=True).num_warps == table["fma_kmajor"]["num_warps"]
    with pytest.raises(ValueError, match="power of two"):
        launch.use_table({"tc": {"BN": 100}})
    assert launch.LAUNCH["tc"]["BN"] != 100  # nothing applied from a refused table


def test_an_entrys_u_split_reaches_the_fused_launch(table):
    """A launch entry may cap the fused EC's u programs for its token class only."""
    assert launch.pick_config(8, 4096, 4096, 128, kmajor=True).u_split == 0  # built in: w4a16.U_SPLIT_MAX
    launch.use_table({"tc": dict(table["tc"], u_split=16)})
    assert launch.pick_config(8, 4096, 4096, 128, kmajor=True).u_split == 16
    assert launch.pick_config(16, 4096, 4096, 128, kmajor=True).u_split == 16
    assert launch.pick_config(32, 4096, 4096, 128, kmajor=True).u_split == 0  # tc_wide
    assert launch.pick_config(1, 4096, 4096, 128, kmajor=True).u_split == 0   # the CUDA-core loop


def test_the_committed_pipeline_table_is_valid():
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "pipeline" / "table-pl3.json"
    t = launch.read_table(path)
    assert t["fma_kmajor"]["pipeline"] == 3 and "prefetch" not in t["fma_kmajor"]
