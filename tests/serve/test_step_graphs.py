"""A step's inputs and its CUDA graphs, on the CPU: the decode and mixed-step graph paths replayed
eagerly (static buffers, padded sizes, the scratch block) against HF ``generate``, the static
buffers a padded mixed step fills, and the block tables kept between steps."""

from __future__ import annotations

import pytest
import torch

from spear.serve.model.graphs import MixedGraphs
from tests.serve.conftest import hf_greedy
from tests.serve.test_engine import GREEDY, MAX_NEW, PROMPTS, engine


@pytest.fixture(scope="module")
def reference(default_model):
    model, tok = default_model
    return [hf_greedy(model, tok, p, MAX_NEW) for p in PROMPTS[:5]]


def test_decode_graph_path_with_padding_equals_hf(default_model, reference):
    # The CUDA-graph decode path (static buffers, padded batch sizes, scratch block) replayed
    # eagerly on the CPU: 3 running sequences replay the batch-4 "graph" with one padding row.
    eng = engine(default_model, max_num_seqs=6, max_model_len=128, cuda_graphs=False)
    eng.core.runner._capture_graphs(eager=True)
    assert list(eng.core.runner.graphs) == [1, 2, 4, 6]
    outs = eng.generate(PROMPTS[:3], GREEDY)
    assert [o.output_token_ids for o in outs] == reference[:3]


def test_mixed_graph_path_with_padding_equals_hf(default_model, reference):
    """The CUDA-graph path of mixed steps (static buffers of max_num_seqs sequences, padded token
    counts 16 / 32 / 40, padding tokens into the scratch block, padding sequences with no query)
    replayed eagerly on the CPU, with the decode graphs too: 5 prompts of 6-24 tokens under a
    40-token budget make steps of decodes beside chunks at several padded sizes.

    Catches: padding tokens writing a live block (slots left from a larger step) and every step
    routed to the largest graph."""
    eng = engine(default_model, max_num_seqs=6, max_model_len=128, max_num_batched_tokens=40, cuda_graphs=False)
    eng.core.runner._capture_graphs(eager=True)
    eng.core.runner.mixed = MixedGraphs(eng.core.runner, eager=True)
    assert list(eng.core.runner.mixed.graphs) == [16, 32, 40]
    used = []
    for size, graph in eng.core.runner.mixed.graphs.items():
        graph.replay = (lambda f, size: lambda: (used.append(size), f())[1])(graph.replay, size)
    outs = eng.generate(PROMPTS[:5], GREEDY)
    assert [o.output_token_ids for o in outs] == reference[:5]
    assert {16, 40} <= set(used)  # steps of under 16 tokens and full-budget ones


def test_mixed_graph_buffers_of_a_padded_step(default_model):
    """The static buffers a mixed step of 2 sequences (3 + 2 tokens, 1 sampled row) fills for the
    16-token graph after a larger step: the paged prefill kernel's contract (sequence b's queries at
    query_start_loc[b]..[b+1], non-decreasing; padding sequences empty at the step's token count;
    padding tokens in the scratch block).
    Catches: query_start_loc padded with 0 (the kernel's binary search assumes it non-decreasing),
    leftover slots or ids of the larger step, tables or lengths of a previous step's sequences."""
    import numpy as np

    from spear.serve.model.model_runner import StepInputs

    eng = engine(default_model, max_num_seqs=4, max_model_len=64, max_num_batched_tokens=20, cuda_graphs=False)
    runner = eng.core.runner
    runner.mixed = MixedGraphs(runner, eager=True)
    seen = []
    for g in runner.mixed.graphs.values():
        g.replay = lambda: seen.append({k: v.clone() for k, v in runner.mixed.inputs.items()})
    i64 = lambda *v: np.array(v, dtype=np.int64)  # noqa: E731
    big = StepInputs("mixed", 3, 3, np.arange(20), np.arange(20), np.arange(20), i64([1, 2], [3, 4], [5, 6]),
                     i64(8, 8, 4), i64(0, 8, 16, 20), 8, i64(19))
    small = StepInputs("mixed", 2, 2, i64(7, 8, 9, 10, 11), i64(4, 5, 6, 0, 1), i64(20, 21, 22, 40, 41),
                       i64([5, 1], [10, 0]), i64(7, 2), i64(0, 3, 5), 3, i64(4))
    runner.run(big)
    runner.run(small)
    b = seen[-1]
    sb = runner.scratch_block * runner.block_size
    assert b["ids"][:16].tolist() == [7, 8, 9, 10, 11] + [0] * 11
    assert b["positions"][:16].tolist() == [4, 5, 6, 0, 1] + [0] * 11
    assert b["slots"][:16].tolist() == [20, 21, 22, 40, 41] + [sb] * 11
    assert b["query_start_loc"].tolist() == [0, 3, 5, 5, 5]
    assert b["seq_lens"].tolist() == [7, 2, 0, 0]
    assert b["block_tables"][:, :3].tolist() == [[5, 1, runner.scratch_block], [10, 0, runner.scratch_block]] + \
        [[runner.scratch_block] * 3] * 2
    assert b["rows"].tolist() == [4, 0, 0, 0]
    assert list(runner.mixed.graphs) == [16, 20] and len(seen) == 2


def test_decode_inputs_pad_the_block_tables_with_the_scratch_block(default_model):
    """The decode step's inputs at a padded batch: each row's block table, then the scratch block to
    the graph's width; padding rows read and write only the scratch block."""
    from types import SimpleNamespace

    eng = engine(default_model, max_num_seqs=4, max_model_len=256)
    runner = eng.core.runner
    seqs = [SimpleNamespace(request_id=f"r{i}", token_ids=list(range(40, 40 + n)), block_table=tbl)
            for i, (n, tbl) in enumerate(((20, [7, 3]), (1, [5]), (33, [9, 0, 2])))]
    out = SimpleNamespace(chunks=[SimpleNamespace(seq=s, start=len(s.token_ids) - 1) for s in seqs])
    ids, pos, slots, tables, lens = runner._decode_inputs(out, 4, 16)
    sb, bs = runner.scratch_block, runner.block_size
    expect = [tbl + [sb] * (16 - len(tbl)) for tbl in ([7, 3], [5], [9, 0, 2])] + [[sb] * 16]
    assert tables.tolist() == expect
    assert ids.tolist() == [59, 40, 72, 0] and pos.tolist() == [19, 0, 32, 0] and lens.tolist() == [20, 1, 33, 1]
    assert slots.tolist() == [3 * bs + 3, 5 * bs, 2 * bs + 0, sb * bs]


def test_block_tables_kept_between_steps_equal_fresh_ones():
    """BlockTables over random steps (sequences growing block by block, preempted and re-admitted
    with other blocks, finishing, arriving; more sequences than rows at first) against tables
    built from scratch at every step."""
    import random
    from types import SimpleNamespace

    from spear.serve.model.block_tables import BlockTables

    rng = random.Random(0)
    width, scratch = 12, 999
    bt = BlockTables(width, scratch)
    seqs, next_id = {}, 0
    for step in range(400):
        if len(seqs) < 6 and rng.random() < 0.3:
            seqs[f"r{next_id}"] = SimpleNamespace(request_id=f"r{next_id}", block_table=[rng.randrange(500)])
            next_id += 1
        for rid in list(seqs):
            s = seqs[rid]
            u = rng.random()
            if u < 0.05:
                del seqs[rid]  # finished
            elif u < 0.10:
                s.block_table = [rng.randrange(500) for _ in range(rng.randint(1, width))]  # preempted, back
            elif u < 0.40 and len(s.block_table) < width:
                s.block_table.append(rng.randrange(500))  # one more block, in place
        step_seqs = [s for s in seqs.values() if rng.random() < 0.8]
        batch = len(step_seqs) + rng.randint(0, 2)
        tables, used = bt.gather(step_seqs, batch)
        expect = [s.block_table + [scratch] * (width - len(s.block_table)) for s in step_seqs]
        expect += [[scratch] * width] * (batch - len(step_seqs))
        assert tables.tolist() == expect, f"step {step}"
        assert used == [len(s.block_table) for s in step_seqs]
    assert bt._table.shape[0] <= 8  # rows of finished sequences were reused
    with pytest.raises(ValueError, match="tables hold 12"):
        bt.gather([SimpleNamespace(request_id="big", block_table=list(range(13)))], 1)


def test_block_tables_grown_under_inference_mode_update_outside_it():
    """CUDA-graph capture runs under torch.inference_mode and grows the tables to the largest graph
    batch; the steps after it run outside. The rows must stay writable there.
    Catches: the rows kept as a torch tensor (an inference tensor once grown under inference mode:
    'Inplace update to inference tensor outside InferenceMode')."""
    from types import SimpleNamespace

    from spear.serve.model.block_tables import BlockTables

    bt = BlockTables(4, 99)
    seqs = [SimpleNamespace(request_id=f"r{i}", block_table=[i]) for i in range(5)]
    with torch.inference_mode():
        bt.gather(seqs, 5)  # grows 1 -> 2 -> 4 -> 8 rows
    seqs[0].block_table = [7, 8]  # preempted and back with other blocks: the row is rewritten
    seqs[1].block_table.append(6)
    tables, used = bt.gather(seqs[:2] + [SimpleNamespace(request_id="new", block_table=[3])], 4)
    assert tables.tolist() == [[7, 8, 99, 99], [1, 6, 99, 99], [3, 99, 99, 99], [99] * 4]
    assert used == [2, 2, 1]
