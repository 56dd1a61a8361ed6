"""Runs one scheduled step of a Llama-family model against the paged KV cache.

The forward is our own, over the HF model's modules: the embedding, every
``nn.Linear`` called as a module (so spear's ``QuantLinear`` with or without a
compensator runs unchanged, and on CUDA the W4 kernel adapter), RMSNorm and the
rotary table from the HF config (the model's own rotary module computes it, so
llama3 / linear / yarn scaling come for free). All scheduled tokens, decodes and
prefill chunks of different sequences, form one flat batch; only attention looks
at which sequence a token belongs to.

On CUDA, decode-only steps replay a CUDA graph captured per padded batch size
(1, 2, 4, 8, 16, 32, ...): fixed-shape inputs, the batched paged attention of
layers.py, and a scratch cache block that padding rows write into.

On CUDA the small per-layer ops run as the fused Triton kernels of
``spear.kernels.fused`` (one launch each for RMSNorm with the residual add before it,
rotary on q and k with the KV-cache write, and SiLU·mul), with the numerics of the
torch code in layers.py, which stays the path on every other device; q/k/v and
gate/up run as one projection each (spear.serve.fusion).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from spear.errors import SpearError
from spear.serve.block_tables import BlockTables
from spear.serve.config import PDL_AUTO_MAX_BATCH
from spear.serve.layers import ChunkMeta, apply_rope, decode_attention, rms_norm, varlen_attention, write_kv
from spear.serve.scheduler import SchedulerOutput

log = logging.getLogger(__name__)

SUPPORTED_TYPES = ("llama", "mistral", "qwen2")
# Decode on the fused kernels: the paged attention kernel also rotates q and writes the new k, v
# into the cache (spear.kernels.attention, ``rope=``), one launch per layer fewer than
# fused.rope_write_kv + attention. Against that pair: caches bit for bit (CPU interpreter and
# H200), output bit for bit on the interpreter and within one unit in the last place on the H200
# (another compiled kernel, another summation order). H200, 2026-12-01 (bench_decode.py
# --rope-in-attention, BENCHMARKS.md "Thirteenth run"): Llama-3-8B W4 2.323 -> 2.268 ms per token
# at batch 1, W4+EC 2.502 -> 2.410; 11,375 -> 11,595 tok/s (W4) at 64 sequences.
ROPE_IN_ATTENTION = True


def check_supported(model: nn.Module) -> None:
    cfg = model.config
    if getattr(cfg, "model_type", None) not in SUPPORTED_TYPES:
        raise SpearError(f"the serving engine runs Llama-family models ({', '.join(SUPPORTED_TYPES)}); "
                         f"this model's type is {getattr(cfg, 'model_type', None)!r}")
    layer = model.model.layers[0]
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        if not hasattr(layer.self_attn, name):
            raise SpearError(f"layer 0 attention has no {name}; not a Llama-family layout")
    for name in ("gate_proj", "up_proj", "down_proj"):
        if not hasattr(layer.mlp, name):
            raise SpearError(f"layer 0 MLP has no {name}; not a Llama-family layout")


def _pdl_available(device: torch.device) -> bool:
    """Programmatic dependent launch works here: Triton has griddepcontrol and the GPU is Hopper or newer."""
    from spear.kernels import _common

    return _common.PDL_AVAILABLE and not _common.INTERPRET and torch.cuda.get_device_capability(device)[0] >= 9


def kv_bytes_per_block(model: nn.Module, block_size: int, dtype: torch.dtype) -> int:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * head_dim * elem


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4] + list(range(8, 257, 8))
    return [b for b in sizes if b < max_num_seqs] + [max_num_seqs]


class ModelRunner:
    def __init__(self, model: nn.Module, num_blocks: int, block_size: int, max_model_len: int,
                 max_num_seqs: int, cuda_graphs: bool = True, weight_layout: str = "kmajor",
                 fuse_projections: bool = True, pdl: str = "off", launch_table: dict | None = None):
        check_supported(model)
        cfg = model.config
        self.model = model
        self.device = model.get_input_embeddings().weight.device
        self.dtype = model.get_input_embeddings().weight.dtype
        self.layers = list(model.model.layers)
        self.n_heads, self.n_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scale = self.head_dim ** -0.5
        self.block_size, self.num_blocks, self.max_model_len = block_size, num_blocks, max_model_len
        self.max_num_seqs = max_num_seqs
        if pdl not in ("off", "auto") and self.device.type != "cuda":
            raise SpearError(f"programmatic dependent launch (pdl={pdl!r}) needs a CUDA GPU; the model is on "
                             f"{self.device}")
        # "auto": "wait" on the decode graphs of up to PDL_AUTO_MAX_BATCH sequences where the GPU and
        # Triton have it (_capture_graphs), "off" for everything else
        self.pdl_auto = pdl == "auto" and self.device.type == "cuda" and _pdl_available(self.device)
        self.graph_pdl: dict[int, str] = {}  # padded batch size -> the PDL mode its graph was captured with
        if self.device.type == "cuda":
            from spear.kernels import _common
            from spear.serve.w4_kernels import use_quant_kernels

            try:
                # before any launch or graph capture: the kernels take it as a constexpr
                _common.set_pdl("off" if pdl == "auto" else pdl)
            except ValueError as e:
                raise SpearError(f"pdl={pdl!r}: {e}") from None
            if launch_table is not None:  # before the first launch too (the capture fixes the launches)
                from spear.kernels import launch

                launch.use_table(launch_table)
                log.info("W4 kernel launches from the given table (%s)", ", ".join(launch_table))

            n = use_quant_kernels(model, kmajor=weight_layout == "kmajor")
            if n:
                log.info("W4 / W8 kernels on %d quantized linears", n)
            if fuse_projections:
                from spear.serve.fusion import fuse_projections as fuse

                log.info("fused %d q/k/v and gate/up groups", fuse(self.layers))

        # One extra block at index num_blocks: padding rows of captured graphs write there.
        shape = (num_blocks + 1, block_size, self.n_kv_heads, self.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        self.v_cache = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        self.scratch_block = num_blocks
        self._block_tables = BlockTables(-(-max_model_len // block_size), num_blocks)

        positions = torch.arange(max_model_len, device=self.device)[None]
        probe = torch.zeros((), dtype=torch.float32, device=self.device)
        with torch.no_grad():
            cos, sin = model.model.rotary_emb(probe, positions)  # fp32, as HF computes them
        self.cos, self.sin = cos[0].to(self.dtype), sin[0].to(self.dtype)

        # The fused kernels' module on CUDA, else None (imported here: spear.kernels decorates
        # Triton kernels at import, which CPU runs need not pay for).
        self.fused = None
        if self.device.type == "cuda":
            from spear.kernels import fused

            self.fused = fused
        self.fused_silu = getattr(cfg, "hidden_act", None) in ("silu", "swish")

        self.graphs: dict = {}  # padded batch size -> torch.cuda.CUDAGraph
        if cuda_graphs and self.device.type == "cuda":
            self._capture_graphs()

    # ------------------------------------------------------------------ forward
    def _layer(self, i: int, h: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, attend) -> torch.Tensor:
        layer = self.layers[i]
        attn, mlp = layer.self_attn, layer.mlp
        t = h.shape[0]
        x = rms_norm(h, layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon)
        q = attn.q_proj(x).view(t, self.n_heads, self.head_dim)
        k = attn.k_proj(x).view(t, self.n_kv_heads, self.head_dim)
        v = attn.v_proj(x).view(t, self.n_kv_heads, self.head_dim)
        cos, sin = self.cos[positions], self.sin[positions]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        write_kv(self.k_cache[i], self.v_cache[i], k, v, slots)
        h = h + attn.o_proj(attend(q, self.k_cache[i], self.v_cache[i]))
        x = rms_norm(h, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon)
        return h + mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))

    def _layer_fused(self, i: int, h: torch.Tensor, delta: torch.Tensor | None, positions: torch.Tensor,
                     slots: torch.Tensor, attend, rope_in_attention: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``_layer`` on the fused kernels (CUDA). The residual stream is carried as ``h + delta``
        with the add pending (``delta`` None before the first layer), so every residual add runs
        inside the RMSNorm after it; returns the next (h, delta). ``rope_in_attention``: ``attend``
        takes the unrotated q and ``rope=`` (decode, ``ROPE_IN_ATTENTION``)."""
        layer = self.layers[i]
        attn, mlp = layer.self_attn, layer.mlp
        t = h.shape[0]
        norm = layer.input_layernorm
        if delta is None:
            x = self.fused.rms_norm(h, norm.weight, norm.variance_epsilon)
        else:
            h, x = self.fused.add_rms_norm(delta, h, norm.weight, norm.variance_epsilon)
        qkv = getattr(attn, "qkv_proj", None)  # spear.serve.fusion: one GEMM, column slices
        q, k, v = qkv(x).split(qkv.splits, dim=-1) if qkv is not None else (attn.q_proj(x), attn.k_proj(x),
                                                                           attn.v_proj(x))
        q = q.view(t, self.n_heads, self.head_dim)
        k = k.view(t, self.n_kv_heads, self.head_dim)
        v = v.view(t, self.n_kv_heads, self.head_dim)
        if rope_in_attention:  # decode: the attention kernel rotates q and caches the new k, v
            o = attn.o_proj(attend(q, self.k_cache[i], self.v_cache[i], rope=(k, v, self.cos, self.sin)))
        else:
            q = self.fused.rope_write_kv(q, k, v, self.cos, self.sin, self.k_cache[i], self.v_cache[i], slots,
                                         positions=positions)  # the whole tables: no gather launch
            o = attn.o_proj(attend(q, self.k_cache[i], self.v_cache[i]))
        norm = layer.post_attention_layernorm
        h, x = self.fused.add_rms_norm(o, h, norm.weight, norm.variance_epsilon)
        gate_up = getattr(mlp, "gate_up_proj", None)
        if gate_up is not None and gate_up.interleaved and self.fused_silu:
            return h, mlp.down_proj(gate_up.silu_mul(x))  # SiLU·mul in the W4 GEMM's epilogue
        gate, up = gate_up(x).split(gate_up.splits, dim=-1) if gate_up is not None else (mlp.gate_proj(x),
                                                                                        mlp.up_proj(x))
        act = self.fused.silu_mul(gate, up) if self.fused_silu else mlp.act_fn(gate) * up
        return h, mlp.down_proj(act)

    def _run_layers(self, h: torch.Tensor, positions, slots, attend,
                    rope_in_attention: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """All decoder layers: (h, delta) whose sum is the last hidden state (delta None off CUDA)."""
        if self.fused is None:
            for i in range(len(self.layers)):
                h = self._layer(i, h, positions, slots, attend)
            return h, None
        delta = None
        for i in range(len(self.layers)):
            h, delta = self._layer_fused(i, h, delta, positions, slots, attend, rope_in_attention)
        return h, delta

    def _logits(self, h: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        norm = self.model.model.norm
        if delta is None:
            x = rms_norm(h, norm.weight, norm.variance_epsilon)
        else:
            x = self.fused.add_rms_norm(delta, h, norm.weight, norm.variance_epsilon)[1]
        return self.model.lm_head(x).float()

    def _forward_varlen(self, input_ids, positions, slots, chunks: list[ChunkMeta], sample_rows) -> torch.Tensor:
        h = self.model.model.embed_tokens(input_ids)

        def attend(q, kc, vc):
            return varlen_attention(q, kc, vc, chunks, self.scale)

        h, delta = self._run_layers(h, positions, slots, attend)
        return self._logits(h[sample_rows], None if delta is None else delta[sample_rows])

    def _forward_decode(self, input_ids, positions, slots, block_tables, context_lens) -> torch.Tensor:
        h = self.model.model.embed_tokens(input_ids)

        def attend(q, kc, vc, rope=None):
            return decode_attention(q, kc, vc, block_tables, context_lens, self.scale, rope=rope)

        return self._logits(*self._run_layers(h, positions, slots, attend, ROPE_IN_ATTENTION))

    # ------------------------------------------------------------------ one step
    def _context_slots(self, block_table: list[int], end: int) -> torch.Tensor:
        """Cache slots of positions 0 .. end - 1 of a sequence (CPU, int64)."""
        bs = self.block_size
        blocks = torch.tensor(block_table[:-(-end // bs)], dtype=torch.long)
        return (blocks[:, None] * bs + torch.arange(bs)).flatten()[:end]

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> torch.Tensor:
        """Run the scheduled chunks; logits (n, vocab) fp32 for each chunk that samples, in order.
        On the CUDA-graph decode path they are a view of the graph's output, overwritten by the
        next call: read them before calling again."""
        if out.is_decode_only:
            return self._execute_decode(out)
        ids, pos, slots, chunks, rows = [], [], [], [], []
        for c in out.chunks:
            end = c.start + c.num_tokens
            seq_slots = self._context_slots(c.seq.block_table, end)
            chunks.append(ChunkMeta(len(ids), c.num_tokens, end, seq_slots.to(self.device)))
            ids += c.seq.token_ids[c.start:end]
            pos += range(c.start, end)
            slots.append(seq_slots[c.start:end])
            if c.samples:
                rows.append(len(ids) - 1)
        t = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)  # noqa: E731
        return self._forward_varlen(t(ids), t(pos), torch.cat(slots).to(self.device), chunks, t(rows))

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
            tables, torch.tensor(lens, dtype=torch.long))

    def _execute_decode(self, out: SchedulerOutput) -> torch.Tensor:
        n = len(out.chunks)
        if self.graphs:
            batch = next(b for b in self.graphs if b >= n)
            inputs = self._decode_inputs(out, batch, self._graph_blocks)
            for buf, x in zip(self._graph_inputs, inputs):
                buf[:batch].copy_(x, non_blocking=True)
            self.graphs[batch].replay()
            # a view of the graph's output buffer, valid until the next replay (the engine samples
            # from it at once): no copy of (n, vocab) fp32 logits per step (33 MB at 64 x 128k)
            return self._graph_logits[:n]
        n_blocks = max(len(c.seq.block_table) for c in out.chunks)
        inputs = [x.to(self.device) for x in self._decode_inputs(out, n, n_blocks)]
        return self._forward_decode(*inputs)

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
        set_pdl = None
        if self.pdl_auto:
            from spear.kernels._common import set_pdl
        with torch.inference_mode():
            for batch in sorted(graph_batch_sizes(b_max), reverse=True):  # largest first: its pool fits all
                args = [x[:batch] for x in self._graph_inputs]
                if set_pdl is not None:
                    self.graph_pdl[batch] = "wait" if batch <= PDL_AUTO_MAX_BATCH else "off"
                    set_pdl(self.graph_pdl[batch])  # read at launch, so captured with the graph

                def run(batch=batch, args=args):
                    self._graph_logits[:batch].copy_(self._forward_decode(*args))

                if eager:
                    self.graphs[batch] = _EagerGraph(run)
                    continue
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(2):  # warm-up: Triton autotuning, weight caches, allocator
                        run()
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    run()
                self.graphs[batch] = graph
        self.graphs = dict(sorted(self.graphs.items()))
        if set_pdl is not None:
            set_pdl("off")  # eager steps (prefill, mixed) launch without it
        if not eager:
            torch.cuda.synchronize()
            log.info("captured decode CUDA graphs for batch sizes %s%s", list(self.graphs),
                     f" (PDL: {self.graph_pdl})" if self.graph_pdl else "")


class _EagerGraph:
    """Stands in for a captured graph: ``replay`` runs the forward it would have recorded."""

    def __init__(self, fn):
        self.replay = fn
