"""Attention over the paged KV cache, with rotary and the cache write.

Tokens of all scheduled sequences form one flat batch T. q (T, n_heads, head_dim); k, v
(T, n_kv_heads, head_dim); a layer's caches (num_blocks, block_size, n_kv_heads, head_dim),
token ``t`` of a sequence at slot ``block_table[t // block_size] * block_size + t % block_size``.
``PagedAttention.forward`` rotates q and k (the model's rotary tables), writes k and v at their
slots, and attends:

  decode (one token per sequence, ``AttentionMetadata.decode``): the paged decode kernel of
  spear.kernels.attention on CUDA (fixed shapes, CUDA graphs capture it; with
  ``KernelPolicy.rope_in_attention`` it also rotates q and writes the new k, v itself), the
  torch reference elsewhere;
  any other step (prefill chunks, or chunks and decodes mixed): causal attention of each chunk's
  queries over its sequence's cached keys, in one launch of the paged prefill kernel
  (spear.kernels.paged_prefill) on CUDA, one SDPA per sequence elsewhere.

Numerics follow transformers' Llama attention (rotary in the activation dtype, SDPA) so greedy
decoding matches ``generate`` token for token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from spear.kernels import reference


@dataclass
class AttentionMetadata:
    """One step's attention inputs, shared by every layer. Rows of the flat batch belong to the
    step's sequences in order: sequence ``b`` holds rows ``query_start_loc[b]:query_start_loc[b+1]``
    (its chunk: its last ``n_b`` tokens up to ``seq_lens[b]``); a decode step has one row each."""

    positions: torch.Tensor            # (T,) int64
    slots: torch.Tensor                # (T,) int64 cache slot of each token
    cos: torch.Tensor                  # (max_len, head_dim) rotary tables
    sin: torch.Tensor
    block_tables: torch.Tensor         # (B, max_blocks) int64 (decode: int64 graph buffers)
    seq_lens: torch.Tensor             # (B,) keys per sequence (decode: the context lengths)
    decode: bool = False               # one query per sequence, rows = sequences
    query_start_loc: torch.Tensor | None = None  # other steps: (B + 1,) int32 cumulative query counts
    max_query_len: int = 1

    @property
    def context_lens(self) -> torch.Tensor:
        return self.seq_lens


def _context(cache: torch.Tensor, blocks: torch.Tensor, ctx: int) -> torch.Tensor:
    """A sequence's first ``ctx`` cached keys (or values) as (1, Hkv, ctx, D): a view where its blocks
    follow each other in the cache (a prompt's blocks are allocated at once at its admission, so a
    long prompt's usually do), else whole blocks copied with index_select (one index a block). A
    step beside a long prompt at 4,200 / 7,700 tokens of context, one thread of the 2-core CPU: about
    168 / 288 ms with the view, 207 / 301 ms copying (2026-12-07; BENCHMARKS.md, "A long prompt
    beside the others")."""
    first = int(blocks[0])
    if bool((blocks == torch.arange(first, first + blocks.numel(), device=blocks.device)).all()):
        rows = cache[first:first + blocks.numel()]
    else:
        rows = cache.index_select(0, blocks)
    return rows.flatten(0, 1)[:ctx].transpose(0, 1)[None]


def prefill_attention_sdpa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of each sequence's chunk over its cached keys, one SDPA per sequence in the
    activation dtype (transformers' numerics): the CPU's path. Returns (T, n_heads * head_dim)."""
    bs, kv_heads, head_dim = k_cache.shape[1:]
    heads = q.shape[1]
    group = heads // kv_heads
    out = torch.zeros(q.shape[0], heads, head_dim, dtype=q.dtype, device=q.device)
    starts, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    for b, ctx in enumerate(lens):
        lo, hi = starts[b], starts[b + 1]
        n = hi - lo
        if n <= 0:
            continue
        kc, vc = (_context(c, meta.block_tables[b, :-(-ctx // bs)], ctx) for c in (k_cache, v_cache))
        qc = q[lo:hi].transpose(0, 1)[None]                     # (1, H, n, D)
        if n == ctx:  # a whole prompt: the causal kernel skips the masked blocks
            o = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, scale=scale, enable_gqa=group > 1)
        else:
            # a chunk (or a decode) over cached keys: a group's query heads (head h reads kv head h // group,
            # as transformers' repeat_kv) become one kv head's rows, so each cached key is read once for
            # all of them, where enable_gqa repeats the keys per head. One thread of the 2-core CPU, SmolLM2
            # (9 / 3 heads), a layer: 6 queries over 4,100 keys 1.05 against 1.45 ms, 3 over 7,700 1.74
            # against 3.59 ms (2026-12-07); a whole prompt stays causal (512 tokens folded: 8.96 against 7.54).
            mask = None
            if n > 1:
                qpos = torch.arange(n, device=q.device)[:, None] + (ctx - n)
                mask = (torch.arange(ctx, device=q.device)[None, :] <= qpos).repeat(group, 1)
            o = F.scaled_dot_product_attention(qc.reshape(1, kv_heads, group * n, head_dim), kc, vc, attn_mask=mask,
                                               scale=scale).reshape(1, heads, n, head_dim)
        out[lo:hi] = o[0].transpose(0, 1)
    return out.flatten(1)


class PagedAttention(nn.Module):
    def __init__(self, n_heads: int, n_kv_heads: int, head_dim: int):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.scale = head_dim ** -0.5

    def kernel_fallbacks(self, block_size: int, dtype: torch.dtype) -> list[tuple[str, str]]:
        """(step kind, why) for each attention kernel that does not take this layer's shapes on CUDA,
        so that the engine says it once at load (the load report and its log) instead of falling
        back silently every step."""
        from spear.kernels import attention, paged_prefill

        q = torch.empty(1, self.n_heads, self.head_dim, dtype=dtype, device="meta")
        cache = torch.empty(1, block_size, self.n_kv_heads, self.head_dim, dtype=dtype, device="meta")
        shape = (f"head_dim {self.head_dim}, block_size {block_size}, {self.n_heads} query / {self.n_kv_heads} "
                 f"kv heads, {dtype}")
        out = []
        if not attention.supports(q, cache):
            out.append(("attention (decode steps)", f"the paged decode kernel does not take {shape}: the torch "
                                                    "reference runs (slower)"))
        if not paged_prefill.supports(q, cache):
            out.append(("attention (prefill and mixed steps)", f"the paged prefill kernel does not take {shape}: "
                                                               "one SDPA per sequence runs (slower)"))
        return out

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, ctx) -> torch.Tensor:
        """q (T, n_heads·head_dim) and k, v (T, n_kv_heads·head_dim) as the projections give them
        (possibly column views of one fused output) -> (T, n_heads·head_dim)."""
        t = q.shape[0]
        q = q.view(t, self.n_heads, self.head_dim)
        k = k.view(t, self.n_kv_heads, self.head_dim)
        v = v.view(t, self.n_kv_heads, self.head_dim)
        if q.is_cuda:
            return self._cuda(q, k, v, k_cache, v_cache, meta, ctx)
        cos, sin = meta.cos[meta.positions], meta.sin[meta.positions]
        q, k = reference.apply_rope(q, cos, sin), reference.apply_rope(k, cos, sin)
        reference.write_kv(k_cache, v_cache, k, v, meta.slots)
        if meta.decode:
            return reference.decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, self.scale)
        return prefill_attention_sdpa(q, k_cache, v_cache, meta, self.scale)

    def _cuda(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, ctx) -> torch.Tensor:
        from spear.kernels import attention, fused

        p = ctx.policy
        if meta.decode and attention.supports(q, k_cache):
            split = dict(max_splits=p.attention_max_splits, min_split_tiles=p.attention_min_split_tiles,
                         target_programs=p.attention_target_programs, pdl=ctx.pdl)
            if p.rope_in_attention:  # the kernel rotates q and caches the new k, v
                return attention.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                                        self.scale, rope=(k, v, meta.cos, meta.sin), **split)
            q = fused.rope_write_kv(q, k, v, meta.cos, meta.sin, k_cache, v_cache, meta.slots,
                                    positions=meta.positions, pdl=ctx.pdl)
            return attention.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                                    self.scale, **split)
        # the whole tables and the positions: no gather launch
        q = fused.rope_write_kv(q, k, v, meta.cos, meta.sin, k_cache, v_cache, meta.slots, positions=meta.positions,
                                pdl=ctx.pdl)
        if meta.decode:
            return reference.decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, self.scale)
        from spear.kernels import paged_prefill

        if paged_prefill.supports(q, k_cache):
            return paged_prefill.paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                                                         meta.seq_lens, self.scale, max_query_len=meta.max_query_len)
        return prefill_attention_sdpa(q, k_cache, v_cache, meta, self.scale)
