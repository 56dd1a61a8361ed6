"""The W4 GEMMs' launch table: checking a table against its declared families, reading one from
JSON, merging one over the read-only built-in table, and the launches ``pick_triton`` makes."""

import json

import pytest

from spear.kernels import launch


def test_the_built_in_table_and_a_json_roundtrip_are_valid(tmp_path):
    assert set(launch.BUILTIN) == set(launch.FAMILIES)
    for key in ("fragment", "nmajor"):  # the Triton families hold every class
        assert tuple(launch.BUILTIN[key]) == launch.FAMILIES[key].classes
    path = tmp_path / "launch_table.json"
    path.write_text(json.dumps(launch.to_json(launch.BUILTIN)))
    assert launch.read_table(path) == launch.BUILTIN
    assert launch.merged_table(path) == launch.BUILTIN and launch.merged_table() is launch.BUILTIN


def test_the_built_in_table_is_read_only():
    """No caller can change the launches of every other caller in the process."""
    with pytest.raises(TypeError):
        launch.BUILTIN["nmajor"] = {}
    with pytest.raises(TypeError):
        launch.BUILTIN["nmajor"]["16"] = launch.Entry(BN=32)
    with pytest.raises(AttributeError):
        launch.BUILTIN["nmajor"]["16"].BN = 32
    merged = launch.merged_table({"nmajor": {"16": dict(BM=16, BN=32, BK=128, num_warps=4, num_stages=3)}})
    with pytest.raises(TypeError):
        merged["nmajor"]["16"] = None
    assert launch.BUILTIN["nmajor"]["16"].BN == 64 and merged["nmajor"]["16"].BN == 32


E = dict(BM=16, BN=64, BK=128, num_warps=4, num_stages=3)


@pytest.mark.parametrize("bad,message", [
    ([1, 2], "must be a JSON object"),
    ({"fma": {}}, "unknown launch table key 'fma'"),
    ({"mma": {}}, "unknown launch table key 'mma'"),
    ({"nmajor": {"2": E}}, "token classes among 1, 16, 32, 64, big"),
    ({"nmajor": {"16": dict(E, warps=2)}}, r"nmajor.16: unknown field\(s\) \['warps'\]"),
    ({"nmajor": {"16": dict(E, BN=48)}}, "nmajor.16.BN must be a power of two, got 48"),
    ({"nmajor": {"16": dict(E, programs=0)}}, "nmajor.16.programs must be a positive integer, got 0"),
    ({"nmajor": {"16": dict(E, num_stages=2.5)}}, "nmajor.16.num_stages must be a positive integer"),
    ({"nmajor": {"16": dict(E, num_stages=True)}}, "nmajor.16.num_stages must be a positive integer"),
    ({"nmajor": {"16": dict(BM=16, BN=64)}}, r"nmajor.16: missing \['BK', 'num_warps', 'num_stages'\]"),
    ({"nmajor": {"16": dict(E, prefetch=True)}}, r"unknown field\(s\) \['prefetch'\]"),
    ({"nmajor": {"16": None}}, "nmajor.16: a launch entry must be an object"),
    ({"fragment": {"16": dict(E, BK=32)}}, "fragment.16: the fragment GEMM takes BK 64 or 128"),
    ({"gluon": {"128": dict(BN=512, BM=128, BK=64, num_stages=4)}}, "gluon.128: BNC must be 64 or 128"),
    ({"gluon_wide": {"128": dict(BN=256, BM=128, BK=64)}}, r"gluon_wide.128: missing \['num_stages'\]"),
])
def test_bad_tables_are_refused_with_the_key(bad, message):
    with pytest.raises(ValueError, match=message):
        launch.check_table(bad)
    if isinstance(bad, dict):
        with pytest.raises(ValueError, match=message):
            launch.merged_table(bad)


def test_unreadable_files_are_refused(tmp_path):
    with pytest.raises(ValueError, match="cannot read the launch table"):
        launch.read_table(tmp_path / "missing.json")
    broken = tmp_path / "broken.json"
    broken.write_text('{"nmajor": ')
    with pytest.raises(ValueError, match="is not valid JSON"):
        launch.read_table(broken)


def test_a_merged_table_changes_the_launch_class_by_class(tmp_path):
    before = launch.pick_triton(20, 4096, 4096, False, 128)
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"nmajor": {"32": dict(BM=32, BN=32, BK=128, num_warps=8, num_stages=2, programs=64)}}))
    table = launch.merged_table(path)
    after = launch.pick_triton(20, 4096, 4096, False, 128, table)
    assert (after.BN, after.num_warps, after.num_stages) == (32, 8, 2)  # 128 tiles x 1 >= 64 programs
    assert after.split_k == 1 and (before.BN, before.num_warps, before.split_k) == (64, 4, 4)
    # the classes and families the file does not name keep the built-in launches
    assert table["nmajor"]["16"] == launch.BUILTIN["nmajor"]["16"] and table["fragment"] == launch.BUILTIN["fragment"]
    assert launch.pick_triton(20, 4096, 4096, False, 128) == before  # the built-in table did not change


def test_an_entrys_u_split_reaches_the_launch():
    """A launch entry may cap the fused EC's u programs for its token class only."""
    assert launch.pick_triton(8, 4096, 4096, False, 128).u_split == 0  # built in: the policy's u_split_max
    table = launch.merged_table({"nmajor": {"16": dict(E, programs=512, u_split=16)}})
    assert launch.pick_triton(8, 4096, 4096, False, 128, table).u_split == 16
    assert launch.pick_triton(32, 4096, 4096, False, 128, table).u_split == 0  # another class


def test_nmajor_launches_by_token_class():
    """One token: the CUDA-core loop (mv 1), its split-K from its programs over the column tiles;
    2-64 tokens: split-K tensor-core tiles, BM by class; above: the prefill tiles, no split; BK never
    crosses a quantization group."""
    one = launch.pick_triton(1, 4096, 4096, False, 128)
    assert (one.mv, one.BN, one.num_warps, one.split_k) == (1, 64, 2, 16)  # 64 tiles x 16 >= 1024 programs
    for m, bm in ((2, 16), (16, 16), (17, 32), (33, 64), (64, 64)):
        c = launch.pick_triton(m, 4096, 4096, False, 128)
        assert c.mv == 0 and c.BM == bm and (4096 // c.BN) * c.split_k >= 132, m
    big = launch.pick_triton(65, 4096, 4096, False, 128)
    assert (big.BM, big.BN, big.BK, big.split_k) == (128, 128, 64, 1)
    assert launch.pick_triton(16, 4096, 4096, False, 32).BK == 32 and launch.pick_triton(16, 4096, 4096, False, 0).BK == 128
