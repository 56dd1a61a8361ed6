"""The scheduler on scripted arrivals: exact chunks, their order, queueing and preemption.

A fake model step: every chunk that reaches its sequence's end samples token 7.
"""

import pytest

from spear.serve.core.block_manager import BlockManager
from spear.serve.core.scheduler import QueueFull, Scheduler
from spear.serve.core.messages import SamplingParams
from spear.serve.core.sequence import Sequence, Status


def make(num_blocks=64, block_size=4, max_num_seqs=4, budget=8, max_waiting=16):
    return Scheduler(BlockManager(num_blocks, block_size), max_num_seqs, budget, max_waiting)


def add(s: Scheduler, rid: str, n_prompt: int, max_tokens: int = 100) -> Sequence:
    seq = Sequence(rid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens))
    s.add(seq)
    return seq


def step(s: Scheduler):
    """Schedule and fake-run one step; finishes sequences at max_tokens. Returns [(rid, start, n)]."""
    out = s.schedule()
    s.advance(out)
    for c in out.chunks:
        if c.samples:
            c.seq.append_token(7)
            if c.seq.num_output_tokens >= c.seq.params.max_tokens:
                s.finish(c.seq, "length")
    return [(c.seq.request_id, c.start, c.num_tokens) for c in out.chunks], [p.request_id for p in out.preempted]


def test_chunked_prefill_then_decodes_first():
    s = make(budget=8)
    add(s, "a", 10)
    add(s, "b", 3)
    assert step(s) == ([("a", 0, 8)], [])                       # a's prompt split at the budget
    assert step(s) == ([("a", 8, 2), ("b", 0, 3)], [])           # a's last chunk samples; b fits whole
    assert step(s) == ([("a", 10, 1), ("b", 3, 1)], [])          # two decodes
    add(s, "c", 20)                                              # arrives mid-decode
    assert step(s) == ([("a", 11, 1), ("b", 4, 1), ("c", 0, 6)], [])  # decodes first, c gets the rest
    assert step(s) == ([("a", 12, 1), ("b", 5, 1), ("c", 6, 6)], [])
    assert step(s) == ([("a", 13, 1), ("b", 6, 1), ("c", 12, 6)], [])
    assert step(s) == ([("a", 14, 1), ("b", 7, 1), ("c", 18, 2)], [])
    assert step(s) == ([("a", 15, 1), ("b", 8, 1), ("c", 20, 1)], [])


def test_max_num_seqs_queues_the_rest():
    s = make(max_num_seqs=2, budget=8)
    for rid in "abc":
        add(s, rid, 2, max_tokens=2)
    assert step(s) == ([("a", 0, 2), ("b", 0, 2)], [])
    assert [q.request_id for q in s.waiting] == ["c"]
    assert step(s) == ([("a", 2, 1), ("b", 2, 1)], [])  # both finish (2 tokens each)
    assert step(s) == ([("c", 0, 2)], [])
    assert step(s) == ([("c", 2, 1)], [])
    assert not s.has_unfinished() and s.blocks.usage == 0.0


def test_full_cache_queues_instead_of_failing():
    s = make(num_blocks=3, block_size=4, budget=16)
    add(s, "a", 8, max_tokens=3)   # 2 blocks
    add(s, "b", 8, max_tokens=1)   # 2 blocks: does not fit next to a
    assert step(s) == ([("a", 0, 8)], [])
    assert [q.request_id for q in s.waiting] == ["b"] and s.waiting[0].status is Status.WAITING
    assert step(s) == ([("a", 8, 1)], [])  # a's 10th token takes the 3rd block
    assert step(s) == ([("a", 9, 1)], [])  # a finishes, its blocks come back
    assert step(s) == ([("b", 0, 8)], [])
    assert not s.has_unfinished() and s.blocks.usage == 0.0


def test_preemption_when_decode_needs_a_block():
    s = make(num_blocks=3, block_size=4, budget=16)
    a, b = add(s, "a", 4, max_tokens=5), add(s, "b", 4, max_tokens=5)
    assert step(s) == ([("a", 0, 4), ("b", 0, 4)], [])  # one block each, one free
    # Both now need a 2nd block for their 5th token: a (older) gets it, b is preempted.
    assert step(s) == ([("a", 4, 1)], ["b"])
    assert b.status is Status.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert b.output_token_ids == [7]  # its output is kept and recomputed as part of the prompt
    assert step(s) == ([("a", 5, 1)], [])   # b (5 tokens, 2 blocks) does not fit yet
    assert step(s) == ([("a", 6, 1)], [])
    assert step(s) == ([("a", 7, 1)], [])   # a's 5th output: finished
    assert step(s) == ([("b", 0, 5)], [])   # recompute prompt + output, then sample
    assert b.num_output_tokens == 2 and b.num_preemptions == 1
    for _ in range(3):
        step(s)
    assert not s.has_unfinished() and s.blocks.usage == 0.0


def test_preempts_the_newest_other_sequence_first():
    s = make(num_blocks=4, block_size=4, budget=16)
    add(s, "a", 4)
    add(s, "b", 4)
    add(s, "c", 4)
    step(s)  # 3 blocks used, 1 free
    sched, preempted = step(s)
    assert sched == [("a", 4, 1), ("b", 4, 1)] and preempted == ["c"]
    assert [q.request_id for q in s.waiting] == ["c"]


def test_bounded_waiting_queue():
    """max_waiting bounds the requests beyond the free slots: 1 slot + 2 waiting here."""
    s = make(max_waiting=2, max_num_seqs=1, budget=4)
    add(s, "a", 3)
    add(s, "b", 3)
    add(s, "c", 3)
    with pytest.raises(QueueFull):
        add(s, "d", 3)
    step(s)  # a admitted: its slot is taken, b and c wait, the queue is still full
    with pytest.raises(QueueFull):
        add(s, "d", 3)
    s.finish(s.running[0], "abort")  # a slot frees: one more may queue
    add(s, "d", 3)


def test_abort_frees_blocks_from_either_queue():
    s = make(num_blocks=2, block_size=4, budget=8)
    a, b = add(s, "a", 8), add(s, "b", 4)
    step(s)
    assert s.blocks.usage == 1.0 and b.status is Status.WAITING
    s.finish(b, "abort")
    s.finish(a, "abort")
    assert a.finish_reason == "abort" and not s.has_unfinished() and s.blocks.usage == 0.0


def test_budget_must_cover_one_decode_per_sequence():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make(max_num_seqs=8, budget=4)
