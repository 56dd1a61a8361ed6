import pytest

from spear.serve.core.block_manager import BlockManager, blocks_for
from spear.serve.core.messages import SamplingParams
from spear.serve.core.sequence import Sequence


def seq(n_tokens: int, rid: str = "r") -> Sequence:
    return Sequence(rid, list(range(1, n_tokens + 1)), SamplingParams())


@pytest.mark.parametrize("tokens,size,blocks", [(1, 4, 1), (4, 4, 1), (5, 4, 2), (16, 16, 1), (17, 16, 2)])
def test_blocks_for(tokens, size, blocks):
    assert blocks_for(tokens, size) == blocks


def test_allocate_grow_free_and_usage_back_to_zero():
    bm = BlockManager(num_blocks=6, block_size=4)
    a, b = seq(5, "a"), seq(3, "b")
    bm.allocate(a)
    bm.allocate(b)
    assert len(a.block_table) == 2 and len(b.block_table) == 1
    assert set(a.block_table).isdisjoint(b.block_table)
    assert bm.num_used_blocks == 3 and bm.usage == pytest.approx(0.5)
    # growing to 8 tokens stays within 2 blocks; 9 needs a third
    assert bm.blocks_needed(a, 8) == 0 and bm.blocks_needed(a, 9) == 1
    bm.allocate(a, 9)
    assert len(a.block_table) == 3
    bm.free(a)
    bm.free(b)
    bm.free(b)  # idempotent
    assert a.block_table == [] and bm.num_free_blocks == 6 and bm.usage == 0.0


def test_exhaustion_is_refused_not_partial():
    bm = BlockManager(num_blocks=3, block_size=4)
    a, b = seq(8, "a"), seq(8, "b")
    bm.allocate(a)
    assert not bm.can_allocate(b) and bm.can_allocate(b, 4)
    with pytest.raises(RuntimeError, match="KV cache exhausted"):
        bm.allocate(b)
    assert b.block_table == [] and bm.num_free_blocks == 1  # nothing taken by the failed call
    bm.free(a)
    assert bm.can_allocate(b)


def test_every_block_is_handed_out_once():
    bm = BlockManager(num_blocks=10, block_size=2)
    seqs = [seq(4, str(i)) for i in range(5)]
    for s in seqs:
        bm.allocate(s)
    owned = [b for s in seqs for b in s.block_table]
    assert sorted(owned) == list(range(10)) and bm.usage == 1.0


def test_bad_sizes():
    with pytest.raises(ValueError):
        BlockManager(0, 16)
