"""Runs one scheduled step of the engine's model against the paged KV cache.

All scheduled tokens, decodes and prefill chunks of different sequences, form one flat batch;
only attention looks at which sequence a token belongs to (spear/serve/model/layers/attention.py).
The runner owns the KV cache (one extra block at index ``num_blocks`` that padding rows of
captured graphs write into), the rotary tables, and on CUDA two sets of CUDA graphs over static
input buffers: one per padded decode batch size (1, 2, 4, 8, 16, 24, ...), each captured with the
PDL level the kernel policy gives its batch size, and the mixed steps' graphs, one per padded
token count (spear/serve/model/graphs.py).

A step is ``prepare`` (the scheduled chunks -> ``StepInputs``: host arrays, no tensors of the
device) then ``run`` (the arrays -> the device, the forward or a graph replay). Under tensor
parallelism rank 0 prepares and sends the same ``StepInputs`` to the other ranks' runners
(``workers``, spear/serve/model/workers.py), and every rank runs it: their layers meet in the same
collectives in the same order.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from spear.errors import SpearError
from spear.kernels.precompile import default_workers
from spear.serve.model.block_tables import BlockTables
from spear.serve.model.graphs import MixedGraphs, capture, mixed_graph_sizes
from spear.serve.model.layers.attention import AttentionMetadata
from spear.serve.model.layers.linear import Context
from spear.serve.model.layers.rotary import rotary_tables
from spear.serve.model.llama import LlamaForCausalLM, head_dim
from spear.serve.core.scheduler import SchedulerOutput

log = logging.getLogger(__name__)


def kv_bytes_per_block(config, block_size: int, dtype: torch.dtype, tp_size: int = 1) -> int:
    """Bytes of one KV block of one rank (its ``num_key_value_heads / tp_size`` heads)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads // tp_size * head_dim(config) * elem


GPU_KV_FRACTION = 0.85
CPU_KV_BYTES = 1 << 30


def local_blocks(config, block_size: int, dtype, device, kv_memory: int | None, num_blocks: int | None,
                 tp_size: int = 1) -> int:
    """KV blocks this rank can hold: ``num_blocks`` when given, else ``kv_memory`` bytes (default:
    85% of the free GPU memory, 1 GiB on the CPU) over one rank's block."""
    if num_blocks is not None:
        return num_blocks
    per_block = kv_bytes_per_block(config, block_size, dtype, tp_size)
    budget = kv_memory
    if budget is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * GPU_KV_FRACTION)
        else:
            budget = CPU_KV_BYTES
    blocks = budget // per_block
    if blocks < 1:
        raise SpearError(f"KV memory of {budget} bytes holds no block ({per_block} bytes per block of "
                         f"{block_size} tokens)")
    return blocks


@dataclass
class StepInputs:
    """One step's inputs on the host: what ``run`` needs, picklable (numpy), sent as is to the
    other tensor-parallel ranks. ``kind``: "graph" (a decode step replaying the graph of ``batch``
    rows, ``n`` of them real), "decode" (an eager decode step) or "mixed" (any other step)."""

    kind: str
    n: int
    batch: int
    ids: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    block_tables: np.ndarray
    seq_lens: np.ndarray
    query_start_loc: np.ndarray | None = None   # mixed: (chunks + 1,) cumulative token counts
    max_query_len: int = 1
    rows: np.ndarray | None = None               # mixed: the rows whose logits are returned


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4] + list(range(8, 257, 8))
    return [b for b in sizes if b < max_num_seqs] + [max_num_seqs]


def pdl_available(device: torch.device) -> bool:
    """Programmatic dependent launch works here: Triton has griddepcontrol and the GPU is Hopper or newer."""
    if device.type != "cuda":
        return False
    from spear.kernels import _common

    return _common.PDL_AVAILABLE and torch.cuda.get_device_capability(device)[0] >= 9


class ModelRunner:
    """One rank's runner over ``model`` under the engine's ``config`` (its batch limits, block
    size, CUDA graphs and kernel policy), with ``num_blocks`` KV blocks for contexts of up to
    ``max_model_len`` tokens (what the ranks agreed on, spear/serve/model/rank.py)."""

    def __init__(self, model: LlamaForCausalLM, config, num_blocks: int, max_model_len: int):
        cfg = model.config
        policy = config.kernels
        self.model, self.policy = model, policy
        self.device = model.embed_tokens.weight.device
        self.dtype = model.embed_tokens.weight.dtype
        block_size = config.block_size
        self.block_size, self.num_blocks, self.max_model_len = block_size, num_blocks, max_model_len
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        cuda_graphs = config.cuda_graphs
        self.pdl_ok = pdl_available(self.device)
        if policy.pdl == "wait" and not self.pdl_ok:
            raise SpearError(f"programmatic dependent launch (pdl='wait') needs a Hopper-or-newer CUDA GPU and a "
                             f"Triton with griddepcontrol; the model is on {self.device}")
        self.eager_ctx = Context(policy, policy.pdl_level(None, self.pdl_ok))
        self.cuda_graphs = bool(cuda_graphs and self.device.type == "cuda")
        self.compile_report = None
        if self.device.type == "cuda" and config.tensor_parallel_size == 1:
            # before the KV cache takes the GPU's memory: the workers need a little of it each
            workers = config.compile_workers
            self.precompile(default_workers() if workers is None else workers)
        shape = (num_blocks + 1, block_size, model.layers[0].attn.n_kv_heads, head_dim(cfg))
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device)) for _ in model.layers]
        self.scratch_block = num_blocks
        self._block_tables = BlockTables(-(-max_model_len // block_size), num_blocks)
        self.cos, self.sin = rotary_tables(cfg, max_model_len, self.dtype, self.device)
        self.graphs: dict = {}  # padded batch size -> torch.cuda.CUDAGraph
        self.graph_pdl: dict[int, int] = {}  # padded batch size -> the PDL level its graph was captured with
        self.mixed: MixedGraphs | None = None  # the mixed steps' graphs (spear/serve/model/graphs.py)
        self.workers = None  # rank 0 under tensor parallelism: the other ranks (spear.serve.model.workers.WorkerPool)
        self.broken: str | None = None  # why the ranks are out of step (a step failed after it was sent)
        if self.cuda_graphs:
            self._capture_graphs()
            try:
                self.mixed = MixedGraphs(self)
            except Exception as exc:  # serve on, slower: eager mixed steps are correct
                self.mixed = None
                torch.cuda.synchronize()
                log.warning("mixed steps run eagerly: capturing their CUDA graphs failed (%r)", exc)

    # ------------------------------------------------------------------ caches
    @property
    def k_cache(self) -> list[torch.Tensor]:
        return [k for k, _ in self.kv_caches]

    @property
    def v_cache(self) -> list[torch.Tensor]:
        return [v for _, v in self.kv_caches]

    # ------------------------------------------------------------------ one step
    def execute(self, out: SchedulerOutput) -> torch.Tensor:
        """Run the scheduled chunks; logits (n, vocab) fp32 for each chunk that samples, in order.
        On the CUDA-graph decode path they are a view of the graph's output, overwritten by the
        next call: read them before calling again."""
        step = self.prepare(out)
        if self.workers is None:
            return self.run(step)
        if self.broken is not None:
            raise SpearError(f"the tensor-parallel ranks are out of step since a failed step ({self.broken}); "
                             "restart the engine")
        try:
            self.workers.run(step)
            return self.run(step)
        except Exception as exc:
            # sent, the step's collectives may be open on the other ranks: a retry would pair with them
            self.broken = self.workers.broken = repr(exc)
            raise

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        """The step's inputs on the host (``StepInputs``)."""
        if out.is_decode_only:
            n = len(out.chunks)
            if self.graphs:
                batch = next(b for b in self.graphs if b >= n)
                kind, width = "graph", self._graph_blocks
            else:
                batch, kind, width = n, "decode", max(len(c.seq.block_table) for c in out.chunks)
            ids, pos, slots, tables, lens = (t.numpy() for t in self._decode_inputs(out, batch, width))
            return StepInputs(kind, n, batch, ids, pos, slots, tables, lens)
        return self._mixed_host(out)

    @torch.inference_mode()
    def run(self, step: StepInputs) -> torch.Tensor:
        """Run a prepared step on this rank's device; logits as ``execute`` returns them."""
        if step.kind == "graph":
            for buf, x in zip(self._graph_inputs, (step.ids, step.positions, step.slots, step.block_tables,
                                                    step.seq_lens)):
                buf[:step.batch].copy_(torch.from_numpy(x), non_blocking=True)
            self.graphs[step.batch].replay()
            # a view of the graph's output buffer, valid until the next replay (the engine samples
            # from it at once): no copy of (n, vocab) fp32 logits per step (33 MB at 64 x 128k)
            return self._graph_logits[:step.n]
        dev = self.device
        t = lambda a: torch.from_numpy(a).to(dev)  # noqa: E731
        if step.kind == "decode":
            ctx = Context(self.policy, self.policy.pdl_level(step.n, self.pdl_ok))
            return self.forward_decode(t(step.ids), t(step.positions), t(step.slots), t(step.block_tables),
                                       t(step.seq_lens), ctx)
        if self.mixed is not None and self.mixed.holds(len(step.ids)):
            return self.mixed.replay(step)
        ids, meta, rows = self._mixed_device(step)
        return self.model(ids, self.kv_caches, meta, self.eager_ctx, rows=rows)

    def mixed_inputs(self, out: SchedulerOutput) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
        """(token ids, attention metadata, rows that sample) of a step of any composition, on the
        device."""
        return self._mixed_device(self._mixed_host(out))

    def _mixed_device(self, step: StepInputs) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
        dev = self.device
        t = lambda a, dtype=torch.long: torch.from_numpy(a).to(dev, dtype)  # noqa: E731
        meta = AttentionMetadata(t(step.positions), t(step.slots), self.cos, self.sin,
                                 block_tables=t(step.block_tables), seq_lens=t(step.seq_lens),
                                 query_start_loc=t(step.query_start_loc, torch.int32),
                                 max_query_len=step.max_query_len)
        return t(step.ids), meta, t(step.rows)

    def _mixed_host(self, out: SchedulerOutput) -> StepInputs:
        """A step of any composition on the host. Host work is O(sequences) in Python: the tokens'
        positions and slots come from numpy over the block tables that BlockTables keeps between
        steps (torch's CPU indexing ops cost milliseconds a step here; numpy's, microseconds)."""
        chunks = out.chunks
        n = np.fromiter((c.num_tokens for c in chunks), dtype=np.int64, count=len(chunks))
        start = np.fromiter((c.start for c in chunks), dtype=np.int64, count=len(chunks))
        qsl = np.zeros(len(chunks) + 1, dtype=np.int64)
        np.cumsum(n, out=qsl[1:])
        ids: list[int] = []
        for c in chunks:  # list slices: C loops, not per-token Python
            ids += c.seq.token_ids[c.start:c.start + c.num_tokens]
        tables, used = self._block_tables.gather([c.seq for c in chunks], len(chunks))
        table_np = tables[:, :max(used)]
        seq = np.repeat(np.arange(len(chunks)), n)
        pos = np.arange(int(qsl[-1])) - qsl[:-1][seq] + start[seq]
        bs = self.block_size
        slots = table_np[seq, pos // bs] * bs + pos % bs
        rows = (qsl[1:] - 1)[np.fromiter((c.samples for c in chunks), dtype=bool, count=len(chunks))]
        return StepInputs("mixed", len(chunks), len(chunks), np.asarray(ids, dtype=np.int64), pos, slots,
                          np.ascontiguousarray(table_np), start + n, qsl, int(n.max()), rows)

    def _decode_inputs(self, out: SchedulerOutput, batch: int, n_blocks: int) -> tuple[torch.Tensor, ...]:
        """(ids, positions, slots, block tables, context lengths) padded to ``batch`` rows; padding
        rows write to and read from the scratch block."""
        bs, scratch = self.block_size, self.scratch_block
        ids, pos, slots, lens = [], [], [], []
        for c in out.chunks:
            seq, p = c.seq, c.start
            ids.append(seq.token_ids[p])
            pos.append(p)
            slots.append(seq.block_table[p // bs] * bs + p % bs)
            lens.append(p + 1)
        pad = batch - len(ids)
        ids, pos, lens = ids + [0] * pad, pos + [0] * pad, lens + [1] * pad
        slots = slots + [scratch * bs] * pad
        # The tables are (batch, n_blocks) with n_blocks = max_model_len / block_size on the graph
        # path (512 at 8k tokens). Built from Python lists at every step they cost 1.2-2.7 ms at
        # 64 sequences (2-core CPU); BlockTables keeps them between steps.
        tables = self._block_tables.gather([c.seq for c in out.chunks], batch)[0][:, :n_blocks]
        return tuple(torch.tensor(x, dtype=torch.long) for x in (ids, pos, slots)) + (
            torch.from_numpy(np.ascontiguousarray(tables)), torch.tensor(lens, dtype=torch.long))

    def forward_decode(self, ids, positions, slots, block_tables, context_lens, ctx: Context) -> torch.Tensor:
        meta = AttentionMetadata(positions, slots, self.cos, self.sin, block_tables=block_tables,
                                 seq_lens=context_lens, decode=True)
        return self.model(ids, self.kv_caches, meta, ctx)

    # ------------------------------------------------------------------ warm-up
    def kernel_signature(self, tokens: int) -> frozenset:
        """Everything that decides which kernel variants a step of ``tokens`` tokens compiles: what
        each distinct linear's method runs at that count (a W4 layer's plan, which the op at run time
        asks the same planner for on the same device; the W8 head's launch). Token counts with the
        same signature run the same compiled kernels."""
        return frozenset(k for lin in self.linears() for k in lin.method.kernels(tokens, self.device, self.policy))

    def linears(self) -> list:
        """The model's linear layers, each once."""
        return list({id(lin): lin for lin, _ in self.model.linears().values()}.values())

    def kernel_report(self, tokens=None) -> list[str]:
        """One line per distinct W4 layer class: the kernel each run of token counts takes (the
        planner's ``describe`` over ``tokens``, by default its own token counts), for the engine's log."""
        lines = (lin.method.describe(self.device, self.policy, tokens) for lin in self.linears())
        return list(dict.fromkeys(line for line in lines if line is not None))

    def warmup_token_counts(self, max_tokens: int) -> list[int]:
        """The smallest token count of each kernel signature up to ``max_tokens`` (and ``max_tokens``)."""
        seen, counts = set(), []
        for t in range(1, max_tokens + 1):
            sig = self.kernel_signature(t)
            if sig not in seen:
                seen.add(sig)
                counts.append(t)
        return counts if counts and counts[-1] == max_tokens else counts + [max_tokens]

    def step_token_counts(self) -> list[tuple[int, int]]:
        """(tokens, PDL level) of every step shape construction and warm-up run: the decode graphs'
        batch sizes (each at its own level), the mixed graphs' sizes and the warm-up's counts."""
        eager = self.eager_ctx.pdl
        counts = [(t, eager) for t in self.warmup_token_counts(self.max_num_batched_tokens)]
        if self.cuda_graphs:
            counts += [(b, self.policy.pdl_level(b, self.pdl_ok)) for b in graph_batch_sizes(self.max_num_seqs)]
            counts += [(t, eager) for t in mixed_graph_sizes(self.max_num_batched_tokens)]
        return sorted(set(counts))

    def kernel_launches(self) -> list:
        """The W4 launches those steps make, one per form and plan (spear/kernels/precompile.py)."""
        from spear.kernels.precompile import unique
        from spear.serve.model.layers.quant_method import W4Method

        pairs, counts = [], self.step_token_counts()
        for lin in self.linears():
            if isinstance(lin.method, W4Method):
                act = 1 if lin.interleaved else 0
                for t, pdl in counts:
                    launch = lin.method.launch(t, lin.bias is not None, act, self.dtype, pdl)
                    pairs.append((launch, lin.method.plan(t, self.device, self.policy)))
        return unique(pairs)

    def precompile(self, workers: int):
        """Compile the W4 launches the construction's graphs and the warm-up will run, in ``workers``
        processes (0: none; spear/kernels/precompile.py). The report, also kept as ``compile_report``."""
        from spear.kernels.precompile import compile_launches

        if workers < 1:
            return None
        launches = self.kernel_launches()
        report = compile_launches(launches, self.device, self.policy, workers)
        for line in report.failed[:5]:
            log.warning("parallel compile: %s (compiled on first use instead)", line)
        log.info("parallel compile: %d W4 launches in %d processes, %.1f s%s", report.launches, report.workers,
                 report.seconds, f", {len(report.failed)} failed" if report.failed else "")
        self.compile_report = report
        return report

    @torch.inference_mode()
    def warmup(self, token_counts: list[int]) -> None:
        """Run one prefill step of each token count on scratch state, so that every kernel those
        steps launch is compiled before a request meets it. The cache blocks it writes belong to no
        sequence (a sequence writes each position before it reads it)."""
        from types import SimpleNamespace

        from spear.serve.core.scheduler import ScheduledChunk

        bs = self.block_size
        for t in token_counts:
            blocks = -(-t // bs)
            if blocks > self.num_blocks or t > self.max_model_len:
                continue
            seq = SimpleNamespace(request_id=f"warmup-{t}", token_ids=[0] * t, block_table=list(range(blocks)),
                                  num_tokens=t, num_output_tokens=0)
            self.execute(SchedulerOutput([ScheduledChunk(seq, 0, t)]))
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    # ------------------------------------------------------------------ CUDA graphs
    def _capture_graphs(self, eager: bool = False) -> None:
        """One graph per padded batch size over static input buffers. ``eager`` records the same
        replays without CUDA (each replay runs the forward), so CPU tests cover the padding logic."""
        self._graph_blocks = -(-self.max_model_len // self.block_size)
        b_max, dev = self.max_num_seqs, self.device
        self._graph_inputs = (
            torch.zeros(b_max, dtype=torch.long, device=dev), torch.zeros(b_max, dtype=torch.long, device=dev),
            torch.full((b_max,), self.scratch_block * self.block_size, dtype=torch.long, device=dev),
            torch.full((b_max, self._graph_blocks), self.scratch_block, dtype=torch.long, device=dev),
            torch.ones(b_max, dtype=torch.long, device=dev))
        self._graph_logits = torch.zeros(b_max, self.model.config.vocab_size, dtype=torch.float32, device=dev)
        pool = None if eager else torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for batch in sorted(graph_batch_sizes(b_max), reverse=True):  # largest first: its pool fits all
                args = [x[:batch] for x in self._graph_inputs]
                self.graph_pdl[batch] = self.policy.pdl_level(batch, self.pdl_ok)
                ctx = Context(self.policy, self.graph_pdl[batch])  # read at launch, so captured with the graph

                def run(batch=batch, args=args, ctx=ctx):
                    self._graph_logits[:batch].copy_(self.forward_decode(*args, ctx))

                self.graphs[batch] = capture(run, pool, eager)
        self.graphs = dict(sorted(self.graphs.items()))
        if not eager:
            torch.cuda.synchronize()
            log.info("captured decode CUDA graphs for batch sizes %s (PDL levels %s)", list(self.graphs),
                     self.graph_pdl)
