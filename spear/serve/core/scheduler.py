"""Continuous batching with chunked prefill. Pure Python: it decides, the model runner computes.

Each step has a budget of ``max_num_batched_tokens`` tokens, filled in this order:

1. decodes of running sequences, oldest first (one token each) -- they hold the
   inter-token latency, so they never wait behind a prefill;
2. the next chunk of running sequences whose prompt is still being prefilled;
3. new sequences from the waiting queue, first come first served, as long as a
   sequence slot (``max_num_seqs``) is free and the KV cache has blocks for the
   whole prompt. A sequence that does not fit stays at the head of the queue
   (admission control: a full cache queues requests, it does not fail them).

A prompt longer than what is left of the budget is split: its first chunk runs
now, the rest in later steps. One prompt's chunk is capped at ``max_prefill_chunk`` tokens in a
step it shares: with decodes, or with another prompt (prefilling, or waiting and admissible
now). So a request that arrives beside a long prompt is admitted at the next step instead of
after the long prompt's last chunk, and the decodes' gap is one step of at most the decodes
and the capped chunks, not one of the whole budget (Sarathi-Serve's point: decodes and new
prefills share every step). The cap is a hard bound on a shared step (nothing left over goes
back to a capped prompt), since on a CPU a step of the whole budget takes seconds and every
stream and every newcomer waits for it whole. A prompt with the step to itself takes the whole
budget, so a lone long prompt is not slowed, unless ``max_prefill_chunk_alone`` caps it too: a
request arriving during a step waits for all of it, which on a CPU is seconds. With
``chunk_context`` C both caps shrink with the prompt's context L, to ``cap · C / (C + L)``: a
chunk's attention over its context costs its tokens times L, which at long contexts outweighs
its linear layers (on a CPU, where a step's time is its work). With ``newcomers_first`` a step that
admits a request leaves out the chunks of the prompts already running, at most every other step:
the newcomer's first token then waits for the step in flight and its own, not for a long prompt's
chunk beside it (on a CPU a step's time is its work; a long prompt loses at most half its steps
to a stream of arrivals). With ``interleave_decodes`` the same holds while decodes run: a step after
one that ran a running prompt's chunk beside decodes runs the decodes (and admissions) without it, so
a stream gets every other token at the pace of a decode step instead of every token at the pace of a
chunk's step (on a CPU a decode step reads the weights once, about a third of a step that also
computes a chunk at long context: the stream's mean gap falls by a third, the long prompt takes a
decode step longer per chunk).

When a decode needs a new block and none is free, the most recently admitted running sequence
is preempted: its blocks are freed and it goes back to the front of the queue to be recomputed
(prompt plus the output so far) once there is room again. The waiting queue is bounded: beyond the
requests the free sequence slots will take at the next step, at most ``max_waiting``
more wait; :meth:`Scheduler.add` raises :class:`QueueFull` past that. (Counting the
free slots matters for a burst that arrives between two steps: all of it is queued
before the step that admits it.)

With an inter-token latency target (``itl_slo_ms``) and a latency table
(:mod:`spear.serve.latency.table`, the deployment's measured step times), the token budget
after the decodes is no longer fixed: every running decode is scheduled, then the
prefill chunks (running prompts, then admissions) share the largest chunk ``c`` whose
predicted step time, with the table's margin, keeps the step within the target:
``predict(d, d + c, L) · (1 + margin) <= itl_slo_ms`` for ``d`` decodes of mean context
``L`` (the table's second axis is the step's tokens). It is at least ``min_chunk_tokens``
(when decodes alone break the target, prompts still advance), and
``max_num_batched_tokens`` stays the ceiling of a step. A step without decodes has no
inter-token latency at stake and gets the ceiling. Under a target the cap on one prompt's
chunk comes from the table: half the chunk the target allows beside the step's decodes (priced
as one decode when none run), at least ``min_chunk_tokens``; it binds only against other
prompts (the target already bounds the decodes' step), and what the capped prompts leave of
the step's prefill budget goes back to them first come first served, so prompts that fit
together are not split. Without a target and without ``max_prefill_chunk`` the schedule is
exactly the static one; a table alone only adds predictions.

Where the runner replays mixed steps as CUDA graphs of padded token counts (``token_sizes``,
spear/serve/model/graphs.py), a step of ``n`` tokens costs what the smallest size ``>= n`` costs: the
chunk under a target is then the largest that makes ``d + c`` one of the sizes (a chunk between
two sizes would pay for the larger one while the table priced the smaller), and a step's
prediction is the table's at its padded size. Decode-only steps are priced at their own decode
count, not their decode graph's padded batch: a padded row attends to one key, so the step costs
what its real sequences cost (on an H200 the padded batch predicted 48-53% of decode-only steps
within 10%, the real count 68-75%: benchmarks/replay_steps.py).

While it serves, the scheduler corrects the table by what the steps measure
(``latency.Correction``, per padded size; off with ``correct=False``): each prediction, and so
each chunk under a target, is the table's times the running ratio of measured to predicted for
that kind of step.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from spear.serve.core.block_manager import BlockManager
from spear.serve.latency.table import Correction, LatencyTable
from spear.serve.core.sequence import Sequence, Status


class QueueFull(Exception):
    """The waiting queue is at ``max_waiting``; the caller should retry later (HTTP 429)."""


@dataclass(slots=True)
class ScheduledChunk:
    """``num_tokens`` tokens of ``seq`` computed this step, starting at position ``start``."""

    seq: Sequence
    start: int
    num_tokens: int

    @property
    def samples(self) -> bool:
        """The chunk reaches the sequence's last token, so its last logits give the next token."""
        return self.start + self.num_tokens == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)  # decodes first, then prefill chunks
    preempted: list[Sequence] = field(default_factory=list)
    num_decodes: int = 0                # the first num_decodes chunks are decodes
    decode_context: float = 0.0         # their mean context (tokens attended, the new one included)
    chunk_budget: int | None = None     # prefill tokens the latency target allowed (None: no target)
    predicted_ms: float | None = None   # the predicted step time (the table's, corrected; no margin)
    table_ms: float | None = None       # the table's alone
    step_kind: int = 0                  # the Correction's kind of this step

    @property
    def prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decodes

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_decode_only(self) -> bool:
        return all(c.num_tokens == 1 and c.seq.num_output_tokens > 0 for c in self.chunks)

    def __bool__(self) -> bool:
        return bool(self.chunks)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_waiting: int, latency: LatencyTable | None = None, itl_slo_ms: float | None = None,
                 min_chunk_tokens: int = 16, token_sizes: tuple[int, ...] | None = None,
                 correct: bool = True, max_prefill_chunk: int | None = None,
                 max_prefill_chunk_alone: int | None = None, chunk_context: int | None = None,
                 newcomers_first: bool = False, interleave_decodes: bool = False):
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({max_num_seqs}) so that every running sequence can decode each step")
        for name, v in (("max_prefill_chunk", max_prefill_chunk), ("max_prefill_chunk_alone", max_prefill_chunk_alone)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a whole number >= 1 or None, got {v!r}")
        # None: no cap (without a target), the whole budget for a prompt alone
        self.max_prefill_chunk, self.max_prefill_chunk_alone = max_prefill_chunk, max_prefill_chunk_alone
        if chunk_context is not None and (isinstance(chunk_context, bool) or not isinstance(chunk_context, int)
                                          or chunk_context < 1):
            raise ValueError(f"chunk_context must be a whole number >= 1 or None, got {chunk_context!r}")
        self.chunk_context = chunk_context  # None: the caps do not shrink with a prompt's context
        for name, v in (("newcomers_first", newcomers_first), ("interleave_decodes", interleave_decodes)):
            if not isinstance(v, bool):
                raise ValueError(f"{name} must be True or False, got {v!r}")
        self.newcomers_first, self.interleave_decodes, self._left_out = newcomers_first, interleave_decodes, False
        self.blocks = block_manager
        self.max_num_seqs, self.max_num_batched_tokens, self.max_waiting = (
            max_num_seqs, max_num_batched_tokens, max_waiting)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []   # in admission order
        self.token_sizes = tuple(sorted(token_sizes)) if token_sizes else None  # padded step sizes (graphs)
        self.set_latency(latency, itl_slo_ms, min_chunk_tokens, correct)

    def set_latency(self, table: LatencyTable | None, itl_slo_ms: float | None = None,
                    min_chunk_tokens: int = 16, correct: bool = True) -> None:
        """Schedule against ``itl_slo_ms`` with ``table`` (module docstring); a table alone only predicts.
        ``correct``: learn the table's error per kind of step from ``observe`` (a fresh correction)."""
        if itl_slo_ms is not None and table is None:
            raise ValueError("an inter-token latency target needs a latency table")
        if itl_slo_ms is not None and not (math.isfinite(itl_slo_ms) and itl_slo_ms > 0):
            raise ValueError(f"itl_slo_ms must be a finite number > 0, got {itl_slo_ms}")
        if isinstance(min_chunk_tokens, bool) or not isinstance(min_chunk_tokens, int) or min_chunk_tokens < 1:
            raise ValueError(f"min_chunk_tokens must be a whole number >= 1, got {min_chunk_tokens!r}")
        self.latency, self.itl_slo_ms, self.min_chunk_tokens = table, itl_slo_ms, min_chunk_tokens
        self.correction = Correction() if table is not None and correct else None

    # ------------------------------------------------------------------ queue
    def add(self, seq: Sequence) -> None:
        free_slots = max(0, self.max_num_seqs - len(self.running))
        if len(self.waiting) >= self.max_waiting + free_slots:
            raise QueueFull(f"the waiting queue is full ({self.max_waiting} requests beyond the "
                            f"{free_slots} free sequence slots)")
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take ``seq`` out (finished, stopped or aborted) and free its blocks."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason

    # ------------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: set[int] = set()

        for seq in [s for s in self.running if s.is_decode]:
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:  # preempted earlier in this loop
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

        d = out.num_decodes = len(out.chunks)
        if d:
            out.decode_context = sum(c.start + 1 for c in out.chunks) / d
        cap = self.max_prefill_chunk
        if self.itl_slo_ms is not None:
            # the chunk the target allows beside the decodes (one decode when none run): the step's
            # prefill budget with decodes, and twice the cap of one prompt among others
            fit = max(self.min_chunk_tokens, self._fit(max(d, 1), out.decode_context, budget))
            if d:
                budget = min(budget, fit)
            out.chunk_budget = budget
            cap = max(self.min_chunk_tokens, fit // 2)
        # Under a target the decodes' step is bounded by it: the cap binds against other prompts only,
        # and what it leaves goes back (below). Without one, the cap is the decodes' only bound too.
        shared = cap is not None and d > 0 and self.itl_slo_ms is None
        alone = self.max_prefill_chunk_alone if self.itl_slo_ms is None else None
        prompts = [s for s in self.running if s.seq_id not in scheduled]
        # a newcomer's step, or a decodes' step with interleave_decodes, leaves the running prompts out, at
        # most every other step
        leave_out = (self.itl_slo_ms is None and bool(prompts) and not self._left_out
                     and ((self.newcomers_first and self._admissible(out)) or (self.interleave_decodes and d > 0)))
        self._left_out = leave_out
        if leave_out:
            prompts = []

        for i, seq in enumerate(prompts):
            if budget == 0:
                break
            # blocks for the whole prompt were allocated at admission
            n = self._capped(seq, min(seq.num_uncomputed_tokens, budget), cap, alone,
                             shared or out.prefill_tokens or i + 1 < len(prompts) or self._admissible(out))
            out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
            scheduled.add(seq.seq_id)
            budget -= n

        # No admissions in a step that had to preempt: the cache is under pressure.
        while budget > 0 and self._admissible(out):
            seq = self.waiting.popleft()
            self.blocks.allocate(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            n = self._capped(seq, min(seq.num_uncomputed_tokens, budget), cap, alone,
                             shared or out.prefill_tokens or self._admissible(out))
            out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
            budget -= n
        if self.itl_slo_ms is not None:
            for c in out.chunks[d:]:  # what the cap left, first come first served
                if budget == 0:
                    break
                more = min(c.seq.num_uncomputed_tokens - c.num_tokens, budget)
                c.num_tokens += more
                budget -= more
        if self.latency is not None and d:
            if out.prefill_tokens:
                tokens = self.padded(out.num_tokens)
                out.table_ms = self.latency.predict(d, tokens, out.decode_context)
                out.step_kind = tokens if self.token_sizes else 1
            else:
                out.table_ms = self.latency.predict(d, 0, out.decode_context)
                out.step_kind = 0
            out.predicted_ms = out.table_ms * self._factor(out.step_kind)
        return out

    def _capped(self, seq: Sequence, n: int, cap: int | None, alone: int | None, shared: bool) -> int:
        """``n`` tokens of ``seq``'s prompt under the cap of a step it shares with others (``shared``)
        or has alone, shrunk at its context ``L`` (the tokens it has computed) to ``cap · C / (C + L)``
        (at least one token) with ``chunk_context`` C: a token's attention over L keys costs L / C of
        its linear layers, so the step's work stays about what ``cap`` tokens cost at no context.
        Under a target the latency table prices the step and the cap stands."""
        limit = cap if cap is not None and shared else alone
        if limit is None:
            return n
        if self.chunk_context is not None and self.itl_slo_ms is None:
            limit = max(1, limit * self.chunk_context // (self.chunk_context + seq.num_computed_tokens))
        return min(n, limit)

    def _admissible(self, out: SchedulerOutput) -> bool:
        """The head of the queue can be admitted in this step (a slot, blocks for its prompt, no
        preemption in this step)."""
        return (not out.preempted and bool(self.waiting) and len(self.running) < self.max_num_seqs
                and self.blocks.can_allocate(self.waiting[0]))

    def _factor(self, kind: int) -> float:
        return 1.0 if self.correction is None else self.correction.factor(kind)

    def _fit(self, d: int, context: float, limit: int) -> int:
        """The largest prefill chunk within the target beside ``d`` decodes (0 or -1: none). With graph
        sizes, the largest that fills one exactly, each size priced at its own (corrected) time."""
        if not self.token_sizes:
            return self.latency.max_chunk(d, context, self.itl_slo_ms / self._factor(1), limit)
        scale = 1 + self.latency.margin
        for n in reversed(self.token_sizes):
            if n <= d:
                break
            if n - d <= limit and self.latency.predict(d, n, context) * self._factor(n) * scale <= self.itl_slo_ms:
                return n - d
        return 0

    def observe(self, out: SchedulerOutput, measured_ms: float) -> None:
        """The step ``out`` took ``measured_ms``: teach the correction (module docstring)."""
        if self.correction is not None and out.table_ms is not None:
            self.correction.observe(out.step_kind, out.table_ms, measured_ms)

    def padded(self, tokens: int) -> int:
        """The token count a step of ``tokens`` runs at: the smallest padded size that holds it."""
        if self.token_sizes is None or tokens > self.token_sizes[-1]:
            return tokens
        return next(n for n in self.token_sizes if n >= tokens)

    def advance(self, out: SchedulerOutput) -> None:
        """After the model ran ``out``: its tokens now have K/V in the cache."""
        for c in out.chunks:
            c.seq.num_computed_tokens = c.start + c.num_tokens

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
