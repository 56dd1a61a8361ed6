"""CUDA graphs of engine steps: capturing one, and the mixed steps' graphs.

A mixed step (prefill chunks, with or without decodes) launches ~400 kernels on an 8B model; from
Python that took longer than the GPU ran them (H200, Llama-3-8B W4, a 512-token step: 45 ms eager
against 17.8 ms of GPU work; replayed, 20.5 ms; BENCHMARKS.md "Serving: mixed steps").
``MixedGraphs`` captures the whole forward once per padded token count (16, 32, 64, 128, 192, then
every 128 up to the token budget) over static buffers of ``max_num_seqs`` sequences, and ``replay``
runs a step through the smallest one that holds it. Padding is made harmless, not skipped: padding
tokens (id 0, position 0) write the runner's scratch block; padding sequences have no query (their
``query_start_loc`` at the step's token count, non-decreasing as the paged prefill kernel's binary
search needs) and no keys; padded sampled rows read row 0. The paged prefill kernel's grid depends
on the token and sequence counts only, so one graph serves every composition of a token count.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from spear.serve.model.layers.attention import AttentionMetadata

log = logging.getLogger(__name__)


def mixed_graph_sizes(max_tokens: int) -> list[int]:
    """Padded token counts of the mixed-step graphs: 16, 32, 64, 128, 192, every 128 from 256, and the
    budget itself. A latency target picks among them; 192 lies between the 128 and 256 that tight
    targets choose between. No size between 64 and 128: 96 tokens cost more than 128 (H200,
    Llama-3-8B W4, ECs on every linear, 32 decodes at 1k context: 17.1 ms against 14.1;
    BENCHMARKS.md "Latency targets")."""
    sizes = [16, 32, 64, 128, 192] + list(range(256, max_tokens, 128))
    return [t for t in sizes if t < max_tokens] + [max_tokens]


def capture(run, pool, eager: bool):
    """A CUDA graph of ``run()`` in ``pool`` after two warm-up calls on a side stream (Triton
    compilation, the allocator); with ``eager``, an ``EagerGraph`` that calls ``run`` on replay."""
    if eager:
        return EagerGraph(run)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        run()
    return graph


class EagerGraph:
    """Stands in for a captured graph: ``replay`` runs the forward it would have recorded, so CPU
    tests cover the static buffers and the padding."""

    def __init__(self, fn):
        self.replay = fn


class MixedGraphs:
    """The mixed steps' graphs of one ``ModelRunner`` (its model, KV cache, limits and scratch
    block); ``graphs``: padded token count -> graph, ``inputs``: the static buffers."""

    def __init__(self, runner, eager: bool = False):
        self.runner = runner
        t_max, b_max, dev = runner.max_num_batched_tokens, runner.max_num_seqs, runner.device
        self.scratch_slot = runner.scratch_block * runner.block_size
        width = -(-runner.max_model_len // runner.block_size)
        long = dict(dtype=torch.long, device=dev)
        self.inputs = buf = dict(
            ids=torch.zeros(t_max, **long), positions=torch.zeros(t_max, **long),
            slots=torch.full((t_max,), self.scratch_slot, **long),
            block_tables=torch.full((b_max, width), runner.scratch_block, **long),
            seq_lens=torch.zeros(b_max, **long), query_start_loc=torch.zeros(b_max + 1, dtype=torch.int32, device=dev),
            rows=torch.zeros(b_max, **long))
        self.logits = torch.zeros(b_max, runner.model.config.vocab_size, dtype=torch.float32, device=dev)
        self.graphs: dict = {}
        pool = None if eager else torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for tokens in sorted(mixed_graph_sizes(t_max), reverse=True):  # largest first: its pool fits all
                def run(tokens=tokens):
                    meta = AttentionMetadata(buf["positions"][:tokens], buf["slots"][:tokens], runner.cos, runner.sin,
                                             block_tables=buf["block_tables"], seq_lens=buf["seq_lens"],
                                             query_start_loc=buf["query_start_loc"], max_query_len=tokens)
                    self.logits.copy_(runner.model(buf["ids"][:tokens], runner.kv_caches, meta, runner.eager_ctx,
                                                   rows=buf["rows"]))

                self.graphs[tokens] = capture(run, pool, eager)
        self.graphs = dict(sorted(self.graphs.items()))
        if not eager:
            torch.cuda.synchronize()
            log.info("captured mixed-step CUDA graphs for token counts %s", list(self.graphs))

    def holds(self, tokens: int) -> bool:
        return tokens <= max(self.graphs)

    def replay(self, step) -> torch.Tensor:
        """A mixed step (``StepInputs``) through the graph of the smallest padded token count that
        holds it; a view of the graph's logits of the sampled rows, valid until the next replay."""
        tokens = next(t for t in self.graphs if t >= len(step.ids))
        t, n, k, buf = len(step.ids), step.n, len(step.rows), self.inputs
        b_max = buf["seq_lens"].shape[0]
        host = lambda a, dtype=torch.long: torch.from_numpy(a).to(dtype)  # noqa: E731
        buf["ids"][:t].copy_(host(step.ids), non_blocking=True)
        buf["positions"][:t].copy_(host(step.positions), non_blocking=True)
        buf["slots"][:t].copy_(host(step.slots), non_blocking=True)
        if tokens > t:  # what a larger step left there would write into live blocks
            buf["slots"][t:tokens].fill_(self.scratch_slot)
            buf["ids"][t:tokens].zero_()
            buf["positions"][t:tokens].zero_()
        tables = np.full(buf["block_tables"].shape, self.runner.scratch_block, dtype=np.int64)
        tables[:n, :step.block_tables.shape[1]] = step.block_tables
        buf["block_tables"].copy_(torch.from_numpy(tables), non_blocking=True)
        lens = np.zeros(b_max, dtype=np.int64)
        lens[:n] = step.seq_lens
        buf["seq_lens"].copy_(torch.from_numpy(lens), non_blocking=True)
        qsl = np.full(b_max + 1, t, dtype=np.int32)
        qsl[:n + 1] = step.query_start_loc
        buf["query_start_loc"].copy_(torch.from_numpy(qsl), non_blocking=True)
        rows = np.zeros(b_max, dtype=np.int64)
        rows[:k] = step.rows
        buf["rows"].copy_(torch.from_numpy(rows), non_blocking=True)
        self.graphs[tokens].replay()
        return self.logits[:k]
