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
  queries over its sequence's cached keys.

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
class ChunkMeta:
    """Where one sequence's chunk sits in the flat batch and in the cache."""

    q_start: int             # first row of the chunk in the flat token dimension
    num_tokens: int          # query tokens (the chunk)
    context_len: int         # keys: every token of the sequence up to the chunk's end
    slots: torch.Tensor      # (context_len,) cache slots of positions 0 .. context_len - 1


@dataclass
class AttentionMetadata:
    """One step's attention inputs, shared by every layer."""

    positions: torch.Tensor            # (T,) int64
    slots: torch.Tensor                # (T,) int64 cache slot of each token
    cos: torch.Tensor                  # (max_len, head_dim) rotary tables
    sin: torch.Tensor
    decode: bool = False
    block_tables: torch.Tensor | None = None   # decode: (B, max_blocks) int64
    context_lens: torch.Tensor | None = None   # decode: (B,) int64
    chunks: list[ChunkMeta] | None = None      # other steps


def varlen_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     chunks: list[ChunkMeta], scale: float) -> torch.Tensor:
    """Causal attention of each chunk's queries over its sequence's cached keys (chunk included).

    Query ``i`` of a chunk sits at position ``context_len - num_tokens + i`` and sees keys
    ``0 ..`` that position. Returns (T, n_heads * head_dim).
    """
    kv_heads, head_dim = k_cache.shape[-2:]
    k_flat, v_flat = k_cache.view(-1, kv_heads, head_dim), v_cache.view(-1, kv_heads, head_dim)
    out = torch.empty(q.shape[0], q.shape[1], head_dim, dtype=q.dtype, device=q.device)
    for c in chunks:
        qc = q[c.q_start:c.q_start + c.num_tokens].transpose(0, 1)[None]  # (1, H, n, D)
        kc = k_flat[c.slots].transpose(0, 1)[None]                        # (1, Hkv, ctx, D)
        vc = v_flat[c.slots].transpose(0, 1)[None]
        mask, causal = None, False
        if c.num_tokens == c.context_len:
            causal = True
        elif c.num_tokens > 1:
            offset = c.context_len - c.num_tokens
            qpos = torch.arange(c.num_tokens, device=q.device)[:, None] + offset
            mask = torch.arange(c.context_len, device=q.device)[None, :] <= qpos
        o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, is_causal=causal, scale=scale,
                                           enable_gqa=kv_heads != q.shape[1])
        out[c.q_start:c.q_start + c.num_tokens] = o[0].transpose(0, 1)
    return out.flatten(1)


class PagedAttention(nn.Module):
    def __init__(self, n_heads: int, n_kv_heads: int, head_dim: int):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.scale = head_dim ** -0.5

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
        return varlen_attention(q, k_cache, v_cache, meta.chunks, self.scale)

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
        return varlen_attention(q, k_cache, v_cache, meta.chunks, self.scale)
