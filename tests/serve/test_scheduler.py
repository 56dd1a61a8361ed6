"""The scheduler on scripted arrivals: exact chunks, their order, queueing and preemption; the cap
on one prompt's chunk in a shared step (max_prefill_chunk), on exact schedules and on random
workloads against the rules it promises.

A fake model step: every chunk that reaches its sequence's end samples token 7.
"""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spear.serve.core.block_manager import BlockManager
from spear.serve.core.scheduler import QueueFull, Scheduler
from spear.serve.core.messages import SamplingParams
from spear.serve.core.sequence import Sequence, Status


def make(num_blocks=64, block_size=4, max_num_seqs=4, budget=8, max_waiting=16, cap=None, alone=None, context=None,
         newcomers_first=False, interleave=False):
    return Scheduler(BlockManager(num_blocks, block_size), max_num_seqs, budget, max_waiting,
                     max_prefill_chunk=cap, max_prefill_chunk_alone=alone, chunk_context=context,
                     newcomers_first=newcomers_first, interleave_decodes=interleave)


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


# ---------------------------------------------------------------------------- one prompt's cap
def test_a_short_prompt_is_served_beside_a_long_one_and_decodes_keep_their_pace():
    """A long prompt alone takes the whole budget; a short one arriving is admitted at the next
    step (the long one's chunk capped at 4) and samples its first token there; from then on every
    step holds its decode beside the long prompt's capped chunk.
    Catches: the long prompt's chunk taking the budget before anyone is admitted (the short one's
    first token after the long one's last chunk), a decode skipped for a prefill."""
    s = make(budget=16, cap=4)
    add(s, "long", 40)
    assert step(s) == ([("long", 0, 16)], [])                        # alone: the whole budget
    add(s, "short", 3)
    assert step(s) == ([("long", 16, 4), ("short", 0, 3)], [])       # admitted beside it: its first token
    for start in (20, 24, 28, 32, 36):                               # its decodes, the long prompt capped
        assert step(s) == ([("short", 3 + (start - 20) // 4, 1), ("long", start, 4)], [])
    assert step(s) == ([("long", 40, 1), ("short", 8, 1)], [])       # both decode (in admission order)


def test_a_lone_long_prompt_takes_the_whole_budget_unless_capped_alone_too():
    s = make(budget=16, cap=4)
    add(s, "long", 40)
    assert [step(s)[0] for _ in range(4)] == [[("long", 0, 16)], [("long", 16, 16)], [("long", 32, 8)],
                                              [("long", 40, 1)]]
    # the CPU's default: alone too (a request arriving during a step waits for all of it)
    s = make(budget=16, cap=4, alone=10)
    add(s, "long", 24)
    assert step(s) == ([("long", 0, 10)], [])
    add(s, "short", 3)
    assert step(s) == ([("long", 10, 4), ("short", 0, 3)], [])   # beside another: the shared cap
    s.finish(s.running[1], "abort")
    assert step(s) == ([("long", 14, 10)], [])


def test_a_request_that_cannot_be_admitted_does_not_cap_the_prompt():
    """The queue's head lacks KV blocks: nobody would use what the cap leaves, so the running
    prompt keeps the whole budget."""
    s = make(num_blocks=11, budget=16, cap=4)
    add(s, "long", 40)                       # 10 of the 11 blocks
    assert step(s) == ([("long", 0, 16)], [])
    add(s, "other", 8)                       # needs 2 blocks: waits
    assert step(s) == ([("long", 16, 16)], []) and [q.request_id for q in s.waiting] == ["other"]


def test_prompts_that_share_a_step_each_take_at_most_the_cap():
    """Two prompts arriving together are both capped, and what they leave stays unused: the cap
    bounds a shared step's time (on a CPU a step's time is its tokens')."""
    s = make(budget=16, cap=4)
    add(s, "a", 10)
    add(s, "b", 10)
    assert step(s) == ([("a", 0, 4), ("b", 0, 4)], [])
    assert step(s) == ([("a", 4, 4), ("b", 4, 4)], [])
    assert step(s) == ([("a", 8, 2), ("b", 8, 2)], [])


def test_the_caps_shrink_with_the_prompts_context():
    """With chunk_context C a cap at context L is cap · C // (C + L), at least 1: the chunk's
    attention over L keys is priced beside its linear layers. C = 16, alone 16, shared 8.
    Catches: the caps standing whatever the context (a step at 8,000 tokens of context costing
    several decode steps on a CPU), a cap of 0 stalling the prompt, the shared step priced at the
    newcomer's context instead of each prompt's own."""
    s = make(budget=32, cap=8, alone=16, context=16)
    add(s, "long", 40)
    assert step(s) == ([("long", 0, 16)], [])                     # 16 · 16 // 16
    add(s, "short", 3)
    assert step(s) == ([("long", 16, 4), ("short", 0, 3)], [])    # shared: 8 · 16 // 32; the short one at 0
    assert step(s) == ([("short", 3, 1), ("long", 20, 3)], [])    # 8 · 16 // 36
    s.finish(s.running[1], "abort")
    assert [step(s)[0] for _ in range(4)] == [[("long", 23, 6)],  # alone again: 16 · 16 // 39
                                              [("long", 29, 5)],  # 256 // 45
                                              [("long", 34, 5)],  # 256 // 50
                                              [("long", 39, 1)]]  # the rest
    s = make(budget=32, cap=1, alone=1, context=1)
    add(s, "long", 6)
    assert [step(s)[0] for _ in range(3)] == [[("long", 0, 1)], [("long", 1, 1)], [("long", 2, 1)]]  # never 0
    with pytest.raises(ValueError, match="chunk_context must"):
        make(context=0)


def test_a_newcomers_step_leaves_the_running_prompts_out_at_most_every_other_step():
    """newcomers_first: the step that admits a request runs the decodes and the newcomer only, so its
    first token does not wait for a long prompt's chunk; the long prompt goes on at the next step,
    and arrivals at every step leave it out at most every other step.
    Catches: the long prompt's chunk beside every newcomer, the long prompt starved by arrivals, a
    decode skipped."""
    s = make(budget=16, cap=4, newcomers_first=True, max_num_seqs=8)
    add(s, "long", 40)
    assert step(s) == ([("long", 0, 16)], [])                          # nobody waiting: the whole budget
    add(s, "a", 3)
    assert step(s) == ([("a", 0, 3)], [])                              # the newcomer alone: its first token
    assert step(s) == ([("a", 3, 1), ("long", 16, 4)], [])             # the long prompt goes on
    add(s, "b", 2)
    assert step(s) == ([("a", 4, 1), ("b", 0, 2)], [])
    add(s, "c", 2)                                                     # arrives right after: not left out twice
    assert step(s) == ([("a", 5, 1), ("b", 2, 1), ("long", 20, 4), ("c", 0, 2)], [])
    s = make(budget=16, cap=4)                                         # off (an accelerator's default)
    add(s, "long", 40)
    step(s)
    add(s, "a", 3)
    assert step(s) == ([("long", 16, 4), ("a", 0, 3)], [])
    with pytest.raises(ValueError, match="newcomers_first must"):
        make(newcomers_first=1)


def test_interleaved_decodes_run_every_other_step_without_the_running_prompts():
    """interleave_decodes: beside decodes a running prompt's chunk goes in every other step, the steps
    between run the decodes (and admit newcomers); a prompt with nobody decoding runs every step.
    Catches: a decode skipped, the prompt starved (left out twice in a row), a lone prompt slowed,
    a newcomer kept waiting by the decodes' step."""
    s = make(budget=16, cap=4, interleave=True, max_num_seqs=8)
    add(s, "long", 60)
    assert step(s) == ([("long", 0, 16)], [])                          # nobody decoding: every step
    assert step(s) == ([("long", 16, 16)], [])
    add(s, "a", 3)
    assert step(s) == ([("long", 32, 4), ("a", 0, 3)], [])             # "a"'s prompt, no decode yet
    assert step(s) == ([("a", 3, 1)], [])                              # the decodes' step
    assert step(s) == ([("a", 4, 1), ("long", 36, 4)], [])
    add(s, "b", 2)
    assert step(s) == ([("a", 5, 1), ("b", 0, 2)], [])                 # a newcomer still comes at once
    assert step(s) == ([("a", 6, 1), ("b", 2, 1), ("long", 40, 4)], [])
    assert step(s) == ([("a", 7, 1), ("b", 3, 1)], [])
    for seq in list(s.running)[1:]:                                    # the streams end: every step again
        s.finish(seq, "stop")
    assert [step(s) for _ in range(2)] == [([("long", 44, 16)], []), ([("long", 60, 1)], [])]
    s = make(budget=16, cap=4)                                         # off (an accelerator's default)
    add(s, "a", 2)
    step(s)
    add(s, "long", 40)
    assert [step(s) for _ in range(2)] == [([("a", 2, 1), ("long", 0, 4)], []), ([("a", 3, 1), ("long", 4, 4)], [])]
    with pytest.raises(ValueError, match="interleave_decodes must"):
        make(interleave=1)


def test_the_caps_must_be_whole_numbers():
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="max_prefill_chunk must"):
            make(cap=bad)
        with pytest.raises(ValueError, match="max_prefill_chunk_alone must"):
            make(alone=bad)


def test_the_engine_config_cap_by_device():
    from spear.errors import SpearError
    from spear.serve import EngineConfig

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 1)
    assert EngineConfig().prefill_chunks(cpu) == (32, 32)
    assert EngineConfig(max_num_batched_tokens=2048).prefill_chunks(gpu) == (1024, None)
    assert EngineConfig(max_prefill_chunk=100).prefill_chunks(cpu) == (100, 100)
    assert EngineConfig(max_prefill_chunk_alone=512).prefill_chunks(cpu) == (32, 512)
    assert EngineConfig(max_prefill_chunk=8, max_prefill_chunk_alone=64).prefill_chunks(gpu) == (8, 64)
    for name in ("max_prefill_chunk", "max_prefill_chunk_alone"):
        for bad in (0, 1.5, False, "32"):
            with pytest.raises(SpearError, match=f"{name} must"):
                EngineConfig(**{name: bad})


def test_the_chunk_context_by_device_and_model():
    """The context at which a token's attention costs what its linear layers do, from the model's
    shapes, on a CPU; off on an accelerator unless given; 0 turns it off."""
    from transformers import LlamaConfig

    from spear.errors import SpearError
    from spear.serve import EngineConfig
    from spear.serve.config import attention_context

    llama3 = LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
                         num_hidden_layers=32)
    # per layer: q, o 4096 x 4096 each, k, v 4096 x 1024 each, gate/up/down 3 x 4096 x 14336 = 218,103,808
    # weights; twice that over 4 x 4096 FLOPs per key
    assert attention_context(llama3) == 26624
    smol = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
                       num_hidden_layers=30)
    assert attention_context(smol) == 3072  # 2 x 3,538,944 // (4 x 576)
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert EngineConfig().chunk_context(cpu, smol) == 3072
    assert EngineConfig().chunk_context(gpu, smol) is None
    assert EngineConfig(prefill_chunk_context=0).chunk_context(cpu, smol) is None
    assert EngineConfig(prefill_chunk_context=500).chunk_context(gpu, smol) == 500
    assert EngineConfig().first_steps_for_newcomers(cpu) and not EngineConfig().first_steps_for_newcomers(gpu)
    assert EngineConfig(newcomers_first=True).first_steps_for_newcomers(gpu)
    assert not EngineConfig(newcomers_first=False).first_steps_for_newcomers(cpu)
    with pytest.raises(SpearError, match="newcomers_first must"):
        EngineConfig(newcomers_first=1)
    assert EngineConfig().decodes_interleaved(cpu) and not EngineConfig().decodes_interleaved(gpu)
    assert EngineConfig(interleave_decodes=True).decodes_interleaved(gpu)
    assert not EngineConfig(interleave_decodes=False).decodes_interleaved(cpu)
    with pytest.raises(SpearError, match="interleave_decodes must"):
        EngineConfig(interleave_decodes="on")
    for bad in (-1, 1.5, True, "32"):
        with pytest.raises(SpearError, match="prefill_chunk_context must"):
            EngineConfig(prefill_chunk_context=bad)


workloads = st.lists(st.lists(st.tuples(st.integers(1, 60), st.integers(1, 12)), max_size=3), min_size=1,
                     max_size=40)


@settings(max_examples=80, deadline=None)
@given(workloads, st.integers(4, 40), st.sampled_from([2, 4, 8]), st.integers(1, 6), st.integers(0, 40),
       st.integers(1, 16), st.one_of(st.none(), st.integers(1, 24)))
def test_every_step_serves_everyone_under_the_cap(script, num_blocks, block_size, max_num_seqs, extra, cap, alone):
    """Random arrivals against the cap's rules, each checked on the step as it ran: every
    sequence that was decoding decodes (or was preempted), a step holding decodes or several
    prompts gives no prompt more than the cap, a prompt alone in its step with nobody left
    waiting gets the whole budget (or its rest, or the cap alone), no step is empty while requests
    are unfinished, and every request is served in the end."""
    budget = max_num_seqs + extra
    s = make(num_blocks, block_size, max_num_seqs, budget, max_waiting=64, cap=cap, alone=alone)
    rng = random.Random(0)
    seqs = []
    for t in range(len(script) + 400):
        for i, (n_prompt, max_tokens) in enumerate(script[t] if t < len(script) else []):
            if n_prompt + max_tokens > num_blocks * block_size:
                continue  # longer than the cache: the input processor refuses it (max_model_len)
            seq = Sequence(f"r{t}.{i}", [rng.randrange(1, 50) for _ in range(n_prompt)],
                           SamplingParams(max_tokens=max_tokens))
            s.add(seq)
            seqs.append(seq)
        if not s.has_unfinished():
            if t >= len(script):
                break
            continue
        decoding = {q.seq_id for q in s.running if q.is_decode}
        need = {q.seq_id: q.num_uncomputed_tokens for q in list(s.running) + list(s.waiting)}
        out = s.schedule()
        preempted = {q.seq_id for q in out.preempted}
        decodes = [c for c in out.chunks[:out.num_decodes]]
        prompts = out.chunks[out.num_decodes:]
        assert {c.seq.seq_id for c in decodes} == decoding - preempted and all(c.num_tokens == 1 for c in decodes)
        assert out.num_tokens <= budget and out.num_tokens > 0
        if decodes or len(prompts) > 1:
            assert all(c.num_tokens <= cap for c in prompts)
        elif len(prompts) == 1 and not s.waiting:
            assert prompts[0].num_tokens == min(need[prompts[0].seq.seq_id], budget, alone or budget)
        s.advance(out)
        for c in out.chunks:
            if c.samples:
                c.seq.append_token(7)
                if c.seq.num_output_tokens >= c.seq.params.max_tokens:
                    s.finish(c.seq, "length")
    assert all(q.is_finished for q in seqs) and s.blocks.usage == 0.0
