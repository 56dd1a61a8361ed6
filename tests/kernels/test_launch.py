"""The W4 kernel's launch table: checking a table, reading one from JSON, merging one over the
read-only built-in table, and the launches ``pick_config`` makes from a table."""

import json
from types import MappingProxyType

import pytest

from spear.kernels import launch


def plain(t):
    """A table (read-only mappings) as the plain dicts JSON gives back."""
    return {k: plain(v) for k, v in t.items()} if isinstance(t, (dict, MappingProxyType)) else t


def test_the_built_in_table_and_a_json_roundtrip_are_valid(tmp_path):
    assert launch.check_table(launch.BUILTIN) is launch.BUILTIN
    path = tmp_path / "launch_table.json"
    path.write_text(json.dumps(plain(launch.BUILTIN)))
    assert launch.read_table(path) == plain(launch.BUILTIN)
    assert launch.merged_table(path) == launch.BUILTIN and launch.merged_table() is launch.BUILTIN


def test_the_built_in_table_is_read_only():
    """No caller can change the launches of every other caller in the process."""
    with pytest.raises(TypeError):
        launch.BUILTIN["tc"] = dict(launch.BUILTIN["tc"], BN=32)
    with pytest.raises(TypeError):
        launch.BUILTIN["tc"]["BN"] = 32
    with pytest.raises(TypeError):
        launch.BUILTIN["fma_kmajor_by_mv"]["2"]["num_warps"] = 8
    merged = launch.merged_table({"tc": dict(plain(launch.BUILTIN["tc"]), BN=32)})
    with pytest.raises(TypeError):
        merged["tc"]["BN"] = 16
    assert launch.BUILTIN["tc"]["BN"] == 64


@pytest.mark.parametrize("bad,message", [
    ([1, 2], "must be a JSON object"),
    ({"fma_wide": {}}, "unknown launch table key 'fma_wide'"),
    ({"fma": {"BN": 64, "warps": 2}}, r"fma: unknown field\(s\) \['warps'\]"),
    ({"fma": {"BN": 48}}, "fma.BN must be a power of two, got 48"),
    ({"tc": {"programs": 0}}, "tc.programs must be a positive integer, got 0"),
    ({"tc": {"num_stages": 2.5}}, "tc.num_stages must be a positive integer"),
    ({"tc": {"num_stages": True}}, "tc.num_stages must be a positive integer"),
    ({"fma_kmajor": {"prefetch": "yes"}}, "fma_kmajor.prefetch must be true or false"),
    # a field the kernel does not take (the pipeline depth) is refused, not ignored
    ({"fma_kmajor": {"BN": 64, "pipeline": 3}}, r"fma_kmajor: unknown field\(s\) \['pipeline'\]"),
    ({"fma_kmajor_by_mv": {"2": {"BN": 64, "pipeline": 3}}}, r"fma_kmajor_by_mv.2: unknown field\(s\) \['pipeline'\]"),
    ({"fma_kmajor_max_m": 8}, "fma_kmajor_max_m must be an integer from 0 to 4"),
    ({"fma_kmajor_by_mv": {"3": {"BN": 64}}}, "token classes"),
    ({"fma_kmajor_by_mv": {"2": {"BN": 96}}}, r"fma_kmajor_by_mv.2.BN must be a power of two"),
    ({"prefill": None}, "prefill: a launch entry must be an object"),
    ({"tc": {"u_split": 0}}, "tc.u_split must be a positive integer, got 0"),
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
    broken.write_text('{"fma": ')
    with pytest.raises(ValueError, match="is not valid JSON"):
        launch.read_table(broken)


def test_a_merged_table_changes_the_launch_key_by_key(tmp_path):
    before = launch.pick_config(2, 4096, 4096, 128, layout="kmajor")
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"fma_kmajor_by_mv": {"2": dict(BN=32, BK=128, num_warps=4, num_stages=1,
                                                              programs=264)},
                                "fma_kmajor_narrow": None}))
    table = launch.merged_table(path)
    two = launch.pick_config(2, 4096, 4096, 128, layout="kmajor", table=table)
    assert (two.BN, two.num_warps, two.num_stages, two.prefetch) == (32, 4, 1, False)
    assert (before.BN, before.num_warps, before.num_stages) == (64, 2, 3)
    # keys the file does not name keep the built-in values; the narrow launch is off in the merged
    # table only, and the file's "by_mv" replaces the built-in one whole (class "4" is gone)
    assert table["tc"] == launch.BUILTIN["tc"] and table["fma_kmajor_narrow"] is None
    assert launch.BUILTIN["fma_kmajor_narrow"] is not None and set(table["fma_kmajor_by_mv"]) == {"2"}
    one = launch.pick_config(1, 4096, 4096, 128, layout="kmajor", table=table)
    assert (one.num_warps, one.split_k) == (launch.BUILTIN["fma_kmajor"]["num_warps"], 16)
    narrow = launch.pick_config(1, 4096, 4096, 128, layout="kmajor")  # the built-in table: the narrow launch
    assert (narrow.num_warps, narrow.split_k) == (4, 8)
    four = launch.pick_config(4, 4096, 4096, 128, layout="kmajor", table=table)
    assert (four.mv, four.num_warps, four.num_stages) == (4, 2, 1)  # no class "4" launch: M = 1's
    # the built-in table did not change under the merge
    assert launch.pick_config(2, 4096, 4096, 128, layout="kmajor") == before
    with pytest.raises(ValueError, match="power of two"):
        launch.merged_table({"tc": {"BN": 100}})
    assert launch.BUILTIN["tc"]["BN"] != 100


def test_an_entrys_u_split_reaches_the_fused_launch():
    """A launch entry may cap the fused EC's u programs for its token class only."""
    assert launch.pick_config(8, 4096, 4096, 128, layout="kmajor").u_split == 0  # built in: w4a16.U_SPLIT_MAX
    table = launch.merged_table({"tc": dict(plain(launch.BUILTIN["tc"]), u_split=16)})
    assert launch.pick_config(8, 4096, 4096, 128, layout="kmajor", table=table).u_split == 16
    assert launch.pick_config(16, 4096, 4096, 128, layout="kmajor", table=table).u_split == 16
    assert launch.pick_config(32, 4096, 4096, 128, layout="kmajor", table=table).u_split == 0  # tc_wide
    assert launch.pick_config(1, 4096, 4096, 128, layout="kmajor", table=table).u_split == 0   # the CUDA-core loop
    assert launch.pick_config(8, 4096, 4096, 128, layout="kmajor").u_split == 0  # the built-in table unchanged


def test_pick_config_reads_a_token_class_launch():
    table = launch.merged_table(dict(
        fma_kmajor_max_m=4, fma_kmajor_narrow=None,
        fma_kmajor=dict(BN=64, BK=128, num_warps=2, num_stages=1, programs=528, prefetch=True),
        fma_kmajor_by_mv={"4": dict(BN=64, BK=128, num_warps=4, num_stages=2, programs=264)}))
    one, two, four = (launch.pick_config(m, 4096, 4096, 128, layout="kmajor", table=table) for m in (1, 2, 3))
    assert (one.mv, one.num_warps, one.prefetch) == (1, 2, True)
    assert (two.mv, two.num_warps, two.num_stages, two.prefetch) == (2, 2, 1, True)  # no class launch: M = 1's
    assert (four.mv, four.num_warps, four.num_stages, four.prefetch) == (4, 4, 2, False)
    # smallest power-of-two split reaching the programs: 64 column tiles x 8 >= 264; x 16 >= 528
    assert (four.split_k, one.split_k) == (8, 16)
    assert launch.pick_config(5, 4096, 4096, 128, layout="kmajor", table=table).mv == 0  # above max_m: tensor cores
    # one token on a narrow layer: the narrow launch (not for 2+ tokens, wider layers, N-major)
    narrow_entry = dict(max_n=4096, BN=64, BK=128, num_warps=4, num_stages=2, programs=264, prefetch=True)
    with_narrow = launch.merged_table(dict(plain(table), fma_kmajor_narrow=narrow_entry))
    narrow = launch.pick_config(1, 4096, 4096, 128, layout="kmajor", table=with_narrow)
    assert (narrow.num_warps, narrow.num_stages, narrow.split_k, narrow.prefetch) == (4, 2, 8, True)
    assert launch.pick_config(1, 4096, 4096, 128, layout="nmajor", table=with_narrow).num_warps == \
        launch.BUILTIN["fma"]["num_warps"]
    assert launch.pick_config(1, 11008, 4096, 128, layout="kmajor", table=with_narrow).num_warps == 2
    assert launch.pick_config(2, 4096, 4096, 128, layout="kmajor", table=with_narrow).num_warps == 2
    # 17-64 tokens read "tc_wide": BM by token count, split-K from its program target (64 tiles x 2 >= 128)
    wide_table = launch.merged_table({"tc_wide": dict(BN=64, BK=128, num_warps=8, num_stages=3, programs=128)})
    wide = launch.pick_config(64, 4096, 4096, 128, layout="kmajor", table=wide_table)
    tc16 = launch.pick_config(16, 4096, 4096, 128, table=wide_table)
    assert (wide.BM, wide.num_warps, wide.split_k) == (64, 8, 2) and tc16.num_warps == launch.BUILTIN["tc"]["num_warps"]
    assert launch.pick_config(32, 4096, 4096, 128, table=wide_table).BM == 32
    off = launch.merged_table(dict(plain(with_narrow), fma_kmajor_narrow=dict(narrow_entry, max_n=1)))
    assert launch.pick_config(1, 4096, 4096, 128, layout="kmajor", table=off).split_k == 16


def test_pick_config_fills_the_gpu_at_decode():
    for m in (1, 3, 16):
        cfg = launch.pick_config(m, 4096, 4096, 128)
        assert cfg.BM == 16 and (4096 // cfg.BN) * cfg.split_k >= 132 and (cfg.mv >= m or cfg.mv == 0)
    assert launch.pick_config(2048, 4096, 4096, 128).split_k == 1
