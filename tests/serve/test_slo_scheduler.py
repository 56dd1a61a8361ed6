"""The latency-target scheduler on synthetic tables: exact schedules (decodes first, chunk sizes
as the table dictates, the starvation bound, preemption), denser compensators getting smaller
chunks, and without a target the static schedule exactly, against a copy of the static logic.

Synthetic tables are linear in each axis, so the largest chunk within a target has a closed
form, computed here with exact fractions: a step of d decodes and c prefill tokens (T = d + c
tokens, the table's second axis) takes base + d/a + c/b + L/1024 ms, and the table's margin m
gives c* = floor(b · (target / (1 + m) - base - d/a - L/1024)). Its mixed sizes start at 9 tokens,
above its 8 decodes; the steps here hold at most 8 decodes and at least 9 tokens, or none (the
closed form extrapolates the decodes' axis linearly, as the table does).
"""

import math
import random
from collections import deque
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spear.serve.core.block_manager import BlockManager
from spear.serve.latency.table import LatencyTable
from spear.serve.core.scheduler import QueueFull, ScheduledChunk, Scheduler, SchedulerOutput
from spear.serve.core.messages import SamplingParams
from spear.serve.core.sequence import Sequence, Status

TARGET, MARGIN = 20.0, 0.25   # the scheduler keeps predict <= 20 / 1.25 = 16 ms


def linear_table(base=4, per_decode=4, per_chunk_token=64, contexts=(1, 8192), margin=MARGIN):
    f = lambda d, t, L: base + d / per_decode + (t - d if t else 0) / per_chunk_token + L / 1024  # noqa: E731
    decodes, tokens = (1, 8), (0, 9, 512, 4096)
    return LatencyTable(decodes, tokens, contexts, [[[f(d, t, L) for L in contexts] for t in tokens]
                                                    for d in decodes], margin)


def closed_form(d, L, base=4, per_decode=4, per_chunk_token=64, target=TARGET, margin=MARGIN) -> int:
    bound = Fraction(target) / (1 + Fraction(margin))
    return math.floor(per_chunk_token * (bound - base - Fraction(d, per_decode) - Fraction(L) / 1024))


def make(table=None, slo=TARGET, num_blocks=1024, block_size=16, max_num_seqs=8, ceiling=4096, min_chunk=16,
         max_waiting=64):
    return Scheduler(BlockManager(num_blocks, block_size), max_num_seqs, ceiling, max_waiting, table,
                     slo if table is not None else None, min_chunk)


def add(s, rid, n_prompt, max_tokens=1000):
    seq = Sequence(rid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens))
    s.add(seq)
    return seq


def step(s):
    out = s.schedule()
    s.advance(out)
    for c in out.chunks:
        if c.samples:
            c.seq.append_token(7)
            if c.seq.num_output_tokens >= c.seq.params.max_tokens:
                s.finish(c.seq, "length")
    return [(c.seq.request_id, c.start, c.num_tokens) for c in out.chunks], [p.request_id for p in out.preempted], out


def test_decodes_first_then_the_chunk_the_table_allows():
    s = make(linear_table())
    add(s, "a", 100)
    add(s, "b", 100)
    chunks, _, out = step(s)
    assert chunks == [("a", 0, 100), ("b", 0, 100)]     # no decodes: nothing at stake, the ceiling
    assert out.chunk_budget == 4096 and out.predicted_ms is None and out.num_decodes == 0
    add(s, "c", 2000)
    starts = 0
    for ctx in (101, 102, 103):
        chunks, _, out = step(s)
        c = min(closed_form(2, ctx), 2000 - starts)
        assert c == (729 if ctx < 103 else 2000 - 2 * 729)  # 736 - 64 L / 1024, floored
        assert chunks == [("a", ctx - 1, 1), ("b", ctx - 1, 1), ("c", starts, c)]
        assert out.num_decodes == 2 and out.decode_context == ctx and out.chunk_budget == closed_form(2, ctx)
        assert out.predicted_ms == pytest.approx(4 + 2 / 4 + c / 64 + ctx / 1024)
        starts += c
    add(s, "d", 50)
    chunks, _, out = step(s)  # c decodes now: 3 decodes of mean context (104 + 104 + 2001) / 3
    L = (104 + 104 + 2001) / 3
    assert out.chunk_budget == closed_form(3, Fraction(104 + 104 + 2001, 3)) == 673
    assert chunks == [("a", 103, 1), ("b", 103, 1), ("c", 2000, 1), ("d", 0, 50)]
    assert out.decode_context == pytest.approx(L)


def test_the_ceiling_still_caps_the_step():
    s = make(linear_table(), ceiling=300)
    add(s, "a", 10)
    step(s)
    add(s, "b", 1000)
    chunks, _, out = step(s)
    assert chunks == [("a", 10, 1), ("b", 0, 299)] and out.chunk_budget == 299  # the table allows 751
    # and the minimum chunk never lifts a step over it
    s = make(linear_table(base=30), max_num_seqs=4, ceiling=8, min_chunk=16)
    add(s, "a", 3)
    add(s, "b", 3)
    step(s)
    add(s, "c", 40)
    chunks, _, out = step(s)
    assert chunks == [("a", 3, 1), ("b", 3, 1), ("c", 0, 6)] and out.chunk_budget == 6


@pytest.mark.parametrize("min_chunk", [16, 24])
def test_starvation_bound_the_minimum_chunk_when_decodes_alone_break_the_target(min_chunk):
    s = make(linear_table(base=30), min_chunk=min_chunk)  # 30 ms before any chunk: nothing fits 16
    add(s, "a", 8)
    add(s, "b", 8)
    step(s)
    add(s, "c", 100)
    add(s, "e", 40)
    got, ctx, done = [], 9, 0
    while done < 100:
        chunks, _, out = step(s)
        assert out.chunk_budget == min_chunk and chunks[:2] == [("a", ctx - 1, 1), ("b", ctx - 1, 1)]
        got.append(chunks[2])
        done += chunks[2][2]
        ctx += 1
    n_full, rest = divmod(100, min_chunk)
    assert got == [("c", i * min_chunk, min_chunk) for i in range(n_full)] + ([("c", n_full * min_chunk, rest)]
                                                                               if rest else [])
    if rest:  # the rest of the step's minimum chunk goes to the next prompt in line
        assert chunks[3] == ("e", 0, min_chunk - rest)


def test_preemption_the_prefill_is_the_victim_and_the_step_admits_nothing():
    s = make(linear_table(), num_blocks=104)
    add(s, "a", 30, max_tokens=4)   # 2 blocks each
    add(s, "b", 30, max_tokens=4)
    assert step(s)[0] == [("a", 0, 30), ("b", 0, 30)]
    add(s, "c", 1600)               # 100 blocks: the cache is then full
    assert closed_form(2, 31) == 734
    assert step(s)[:2] == ([("a", 30, 1), ("b", 30, 1), ("c", 0, 734)], [])
    assert step(s)[:2] == ([("a", 31, 1), ("b", 31, 1), ("c", 734, 734)], [])
    add(s, "x", 4)
    # a's 33rd token needs a 3rd block: the newest sequence not yet scheduled, c, gives its blocks back
    chunks, preempted, out = step(s)
    assert (chunks, preempted) == ([("a", 32, 1), ("b", 32, 1)], ["c"])
    assert out.chunk_budget == closed_form(2, 33) == 733 and out.prefill_tokens == 0  # x is not admitted
    assert [q.request_id for q in s.waiting] == ["c", "x"]
    # a and b finished: no decodes, c's recompute gets the ceiling and x follows
    chunks, preempted, out = step(s)
    assert chunks == [("c", 0, 1600), ("x", 0, 4)] and out.chunk_budget == 4096 and not preempted


def test_preemption_of_a_decode_shrinks_the_decodes_the_budget_is_priced_on():
    s = make(linear_table(), num_blocks=5)
    add(s, "a", 32)
    add(s, "b", 32)
    step(s)
    add(s, "w", 8)
    chunks, preempted, out = step(s)
    assert (chunks, preempted) == ([("a", 32, 1)], ["b"])
    assert out.num_decodes == 1 and out.chunk_budget == closed_form(1, 33) == 749
    assert out.predicted_ms == pytest.approx(4 + 1 / 4 + 33 / 1024)
    assert [q.request_id for q in s.waiting] == ["b", "w"]


def test_denser_compensators_get_smaller_chunks_under_the_same_target():
    # as measured on the deployed model: ECs on more linears add a fixed cost to every step and
    # to every prefill token (the semi-fused EC path at prefill sizes)
    densities = {"none": dict(base=4, per_chunk_token=64), "1%": dict(base=4.25, per_chunk_token=56),
                 "every linear": dict(base=5, per_chunk_token=32)}
    budgets = {}
    for name, kw in densities.items():
        s = make(linear_table(**kw))
        for rid in "abcdefg":
            add(s, rid, 500)   # prefilled together (no decodes yet): 7 decodes at context 501 next
        step(s)
        add(s, "long", 3000)
        chunks, _, out = step(s)
        assert out.num_decodes == 7 and out.decode_context == 501
        budgets[name] = out.chunk_budget
        assert budgets[name] == closed_form(7, 501, **kw) == out.prefill_tokens
        assert chunks[7] == ("long", 0, budgets[name])
    assert budgets == {"none": 624, "1%": 532, "every linear": 280}
    assert budgets["none"] > budgets["1%"] > budgets["every linear"] > 0


# ---------------------------------------------------------------------------- without a target
class StaticScheduler:
    """The static-budget scheduler as it was before latency targets (its schedule(), verbatim)."""

    def __init__(self, block_manager, max_num_seqs, max_num_batched_tokens, max_waiting):
        self.blocks = block_manager
        self.max_num_seqs, self.max_num_batched_tokens, self.max_waiting = (
            max_num_seqs, max_num_batched_tokens, max_waiting)
        self.waiting, self.running = deque(), []

    add, finish, advance, _preempt, has_unfinished = (Scheduler.add, Scheduler.finish, Scheduler.advance,
                                                      Scheduler._preempt, Scheduler.has_unfinished)

    def schedule(self):
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled = set()
        for seq in [s for s in self.running if s.is_decode]:
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:
                continue
            while not self.blocks.can_allocate(seq):
                victim = next(s for s in reversed(self.running) if s.seq_id not in scheduled)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                self.blocks.allocate(seq)
                out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, 1))
                scheduled.add(seq.seq_id)
                budget -= 1
        for seq in self.running:
            if budget == 0:
                break
            if seq.seq_id in scheduled:
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
            scheduled.add(seq.seq_id)
            budget -= n
        while (not out.preempted and budget > 0 and self.waiting
               and len(self.running) < self.max_num_seqs and self.blocks.can_allocate(self.waiting[0])):
            seq = self.waiting.popleft()
            self.blocks.allocate(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
            budget -= n
        return out


def _drive(s, script, seed):
    """Run a scripted workload; the trace of every step (chunks, preemptions, queues)."""
    rng = random.Random(seed)
    seqs, trace = {}, []
    for t, (arrivals, abort) in enumerate(script):
        for i, (n_prompt, max_tokens) in enumerate(arrivals):
            rid = f"r{t}.{i}"
            seq = Sequence(rid, [rng.randrange(1, 50) for _ in range(n_prompt)], SamplingParams(max_tokens=max_tokens))
            try:
                s.add(seq)
                seqs[rid] = seq
                trace.append(("added", rid))
            except QueueFull:
                trace.append(("full", rid))
        live = sorted(r for r, q in seqs.items() if not q.is_finished)
        if abort is not None and live:
            s.finish(seqs[live[abort % len(live)]], "abort")
        chunks, preempted, _ = step(s)
        trace.append((chunks, preempted, [q.request_id for q in s.waiting], [q.request_id for q in s.running],
                      s.blocks.num_free_blocks))
    return trace


workloads = st.lists(st.tuples(st.lists(st.tuples(st.integers(1, 60), st.integers(1, 12)), max_size=3),
                               st.one_of(st.none(), st.integers(0, 100))), min_size=1, max_size=40)


@settings(max_examples=80, deadline=None)
@given(workloads, st.integers(4, 40), st.sampled_from([2, 4, 8]), st.integers(1, 6), st.integers(0, 40),
       st.integers(1, 8), st.sampled_from(["none", "table only"]))
def test_without_a_target_the_schedule_is_the_static_one(script, num_blocks, block_size, max_num_seqs, extra,
                                                          max_waiting, variant):
    """(A target that never binds is no longer the static schedule: it shares steps among prompts,
    tested below.)"""
    budget = max_num_seqs + extra
    ref = StaticScheduler(BlockManager(num_blocks, block_size), max_num_seqs, budget, max_waiting)
    table = None if variant == "none" else linear_table()
    new = Scheduler(BlockManager(num_blocks, block_size), max_num_seqs, budget, max_waiting, table, None)
    assert _drive(new, script, 0) == _drive(ref, script, 0)


# ---------------------------------------------------------------------------- one prompt's cap under a target
def test_beside_decodes_a_newcomer_gets_half_of_what_the_target_allows():
    """The target allows 729 prefill tokens beside two decodes: a long prompt alone takes them all;
    once a 600-token prompt waits, the long one takes half (364), the newcomer the rest (capped
    at 364 too, the token left goes back to the long one); the next step the newcomer's rest
    (236) fits and what the cap left goes back to the long prompt.
    Catches: the long prompt taking the whole chunk while others wait (the newcomer's first chunk
    after the long prompt's last), budget left unused under a target."""
    s = make(linear_table())
    add(s, "a", 100)
    add(s, "b", 100)
    step(s)
    add(s, "long", 2000)
    chunks, _, out = step(s)
    assert chunks[2:] == [("long", 0, 729)] and out.chunk_budget == closed_form(2, 101) == 729
    add(s, "new", 600)
    chunks, _, out = step(s)
    assert closed_form(2, 102) == 729 and out.chunk_budget == 729
    assert chunks == [("a", 101, 1), ("b", 101, 1), ("long", 729, 365), ("new", 0, 364)]
    chunks, _, out = step(s)
    assert closed_form(2, 103) == 729 and out.chunk_budget == 729
    assert chunks == [("a", 102, 1), ("b", 102, 1), ("long", 1094, 729 - 236), ("new", 364, 236)]


def test_without_decodes_the_cap_is_half_the_tables_chunk_beside_one_decode():
    """No decodes: the step's ceiling (1000) is the prefill budget, and a prompt among others takes
    at most half of what the target allows beside one decode (at the table's first context, where it
    holds below it): closed_form(1, 1) = 751, so 375; the newcomer's 300 fit, and the rest of the
    ceiling goes back to the first prompt. Alone, a prompt takes the ceiling."""
    s = make(linear_table(), ceiling=1000)
    add(s, "c", 1600)
    add(s, "x", 300)
    chunks, _, out = step(s)
    assert closed_form(1, 1) == 751
    assert chunks == [("c", 0, 700), ("x", 0, 300)] and out.chunk_budget == 1000
    s = make(linear_table(), ceiling=1000)
    add(s, "c", 1600)
    add(s, "x", 900)
    assert step(s)[0] == [("c", 0, 625), ("x", 0, 375)]   # both capped at 375, the 250 left back to c
    s = make(linear_table(), ceiling=1000)
    s.max_prefill_chunk_alone = 32  # the CPU's default alone: a target prices steps itself, the ceiling stays
    add(s, "c", 1600)
    assert step(s)[0] == [("c", 0, 1000)]


@settings(max_examples=60, deadline=None)
@given(workloads, st.integers(8, 60), st.sampled_from([4, 8]), st.integers(1, 8), st.integers(0, 60),
       st.sampled_from([8.0, 12.0, 20.0, 1e9]))
def test_under_a_target_every_step_serves_everyone(script, num_blocks, block_size, max_num_seqs, extra, target):
    """Random arrivals under targets from binding to never binding, each step checked as it ran:
    every decoding sequence decodes (or was preempted), the prefill stays within the step's chunk
    budget and uses all of it unless every scheduled prompt is complete, a step with several
    prompts gives each but the last at least min(its need, the cap), and a prompt takes more than
    the cap only when every prompt of the step has its share and nobody admissible waits."""
    budget = max_num_seqs + extra
    s = make(linear_table(), target, num_blocks, block_size, max_num_seqs, budget, min_chunk=4, max_waiting=64)
    rng = random.Random(0)
    for t, (arrivals, abort) in enumerate(script):
        for n_prompt, max_tokens in arrivals:
            if n_prompt + max_tokens <= num_blocks * block_size:
                try:
                    s.add(Sequence(f"r{t}.{n_prompt}.{rng.random()}", [rng.randrange(1, 50) for _ in range(n_prompt)],
                                   SamplingParams(max_tokens=max_tokens)))
                except QueueFull:
                    pass
        decoding = {q.seq_id for q in s.running if q.is_decode}
        need = {q.seq_id: q.num_uncomputed_tokens for q in list(s.running) + list(s.waiting)}
        out = s.schedule()
        d = out.num_decodes
        prompts = out.chunks[d:]
        assert {c.seq.seq_id for c in out.chunks[:d]} == decoding - {q.seq_id for q in out.preempted}
        assert out.prefill_tokens <= out.chunk_budget <= budget - d or not prompts and out.chunk_budget >= 0
        full = [c.num_tokens == need[c.seq.seq_id] for c in prompts]
        assert out.prefill_tokens == out.chunk_budget or all(full)
        fit = s._fit(max(d, 1), out.decode_context, budget - d)
        cap = max(4, max(4, fit) // 2)
        if any(c.num_tokens > cap for c in prompts):  # only what nobody else in line could take
            assert all(c.num_tokens >= min(need[c.seq.seq_id], cap) for c in prompts)
            assert (out.preempted or not s.waiting or len(s.running) >= max_num_seqs
                    or not s.blocks.can_allocate(s.waiting[0]))
        elif len(prompts) > 1:
            assert all(c.num_tokens >= min(need[c.seq.seq_id], cap) for c in prompts[:-1])
        s.advance(out)
        for c in out.chunks:
            if c.samples:
                c.seq.append_token(7)
                if c.seq.num_output_tokens >= c.seq.params.max_tokens:
                    s.finish(c.seq, "length")


def test_a_target_needs_a_table_and_sane_settings():
    with pytest.raises(ValueError, match="needs a latency table"):
        make(None).set_latency(None, 20.0)
    with pytest.raises(ValueError, match="itl_slo_ms"):
        make(linear_table(), slo=-1.0)
    with pytest.raises(ValueError, match="min_chunk_tokens"):
        make(linear_table(), min_chunk=0)


def two_decodes_on_graph_sizes():
    """A scheduler on mixed-step graph sizes whose next step has two decodes at context 101."""
    s = make(linear_table())
    s.token_sizes = (16, 32, 64, 128, 256, 384, 512, 640, 768, 896, 1024)
    add(s, "a", 100)
    add(s, "b", 100)
    step(s)
    return s


def test_chunks_fill_a_padded_step_size_and_predictions_price_it():
    """With the runner's mixed-step graph sizes, the chunk under the target is the largest that
    makes decodes + chunk one of the sizes (the closed form's chunk rounded down to it), and the
    prediction is the table's at the padded size; a step the prompts leave short is priced at the
    size it is padded to; decode-only steps keep their own price.
    Catches: the unrounded chunk (a step padded past what the table priced), a prediction at the
    unpadded size."""
    s = two_decodes_on_graph_sizes()
    add(s, "c", 2000)
    chunks, _, out = step(s)
    assert closed_form(2, 101) == 729           # 2 + 729 = 731 would pad to 768, past the target
    assert out.chunk_budget == 638 and chunks[-1] == ("c", 0, 638)   # 2 + 638 = 640
    assert out.predicted_ms == pytest.approx(4 + 2 / 4 + 638 / 64 + 101 / 1024)
    add(s, "d", 10)  # a short prompt next: 3 decodes + 10 tokens pad to 16
    s.running[2].num_computed_tokens = 2000  # "c" done with its prompt (its first token is next)
    s.running[2].append_token(7)
    chunks, _, out = step(s)
    assert [c[2] for c in chunks] == [1, 1, 1, 10] and out.num_tokens == 13
    assert out.predicted_ms == pytest.approx(4 + 3 / 4 + (16 - 3) / 64 + out.decode_context / 1024)
    chunks, _, out = step(s)  # decodes only
    assert out.prefill_tokens == 0 and out.predicted_ms == pytest.approx(4 + 4 / 4 + out.decode_context / 1024)


def test_the_correction_moves_a_chunk_to_the_next_size_once_that_size_runs_faster():
    """Steps of 768 tokens measured at 0.85 x the table: after three of them the running residual
    (-0.15 (1 - 0.9^k)) is below -0.0342, where 768 fits 16 ms with the margin (the table prices 2
    decodes + 766 tokens at 16.566 ms), and the chunk grows from 638 to 766; decode-only steps are
    priced at their real decode count (kind 0).
    Catches: a correction that ignores the kind, one that jumps to the newest residual."""
    s = two_decodes_on_graph_sizes()
    add(s, "c", 4000)
    table_768 = 4 + 2 / 4 + 766 / 64 + 101 / 1024
    expect = {640: 0.0, 768: 0.0}
    for k in range(4):
        chunks, _, out = step(s)
        assert chunks[-1][2] == (638 if k < 3 else 766), k
        kind = 2 + chunks[-1][2]
        assert out.step_kind == kind
        assert out.table_ms == pytest.approx(4 + 2 / 4 + (kind - 2) / 64 + (101 + k) / 1024)
        assert out.predicted_ms == pytest.approx(out.table_ms * (1 + expect[kind]))
        s.observe(out, 0.5 * out.table_ms)  # this step's kind measured at half: 640 never moves 768
        expect[kind] += 0.1 * (-0.5 - expect[kind])
        s.observe(SchedulerOutput(table_ms=table_768, step_kind=768), 0.85 * table_768)
        expect[768] += 0.1 * (-0.15 - expect[768])
        assert s.correction.residual == pytest.approx(expect)
    # a decode-only step of 3 sequences (a 4-sequence graph on CUDA) is priced at its 3 decodes
    s2 = make(linear_table())
    for rid in "xyz":
        add(s2, rid, 10)
    step(s2)
    _, _, out = step(s2)
    assert out.prefill_tokens == 0 and out.num_decodes == 3 and out.step_kind == 0
    assert out.table_ms == pytest.approx(4 + 3 / 4 + out.decode_context / 1024)
