"""The Llama-family math the model runner needs, as functions on flat token batches.

Tokens of all scheduled sequences are flattened into one dimension T. Shapes:
q (T, n_heads, head_dim); k, v (T, n_kv_heads, head_dim); a layer's KV cache
(num_blocks, block_size, n_kv_heads, head_dim), addressed by *slot*
``block * block_size + offset``. Numerics follow transformers' Llama modules
(RMSNorm in fp32, rotary in the activation dtype) so greedy decoding matches
HF ``generate`` token for token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, heads, head_dim); cos, sin (T, head_dim) for each token's position."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return x * cos + rotate_half(x) * sin


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slots: torch.Tensor) -> None:
    """Store each token's k, v at its slot."""
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slots, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slots, v)


@dataclass
class ChunkMeta:
    """Where one sequence's chunk sits in the flat batch and in the cache."""

    q_start: int             # first row of the chunk in the flat token dimension
    num_tokens: int          # query tokens (the chunk)
    context_len: int         # keys: every token of the sequence up to the chunk's end
    slots: torch.Tensor      # (context_len,) cache slots of positions 0 .. context_len - 1


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


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                     rope: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """One query per sequence over its paged keys; fixed shapes, so CUDA graphs can capture it.

    q (B, n_heads, head_dim); block_tables (B, max_blocks) int64, entries past a sequence's
    last block may point anywhere valid (they are masked); context_lens (B,).
    Returns (B, n_heads * head_dim). On CUDA the Triton kernel of ``spear.kernels.attention``
    reads only the blocks each sequence uses; elsewhere (and for shapes it does not take)
    ``decode_attention_reference`` runs. ``rope`` = (k_new, v_new, cos, sin): q is not yet
    rotated and the new token (position context_len - 1) not yet cached; the kernel does both
    (``paged_decode_attention``), the fallback runs ``fused.rope_write_kv`` first.
    """
    if q.is_cuda:
        from spear.kernels.attention import paged_decode_attention, supports

        if supports(q, k_cache):
            return paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, rope=rope)
    if rope is not None:
        from spear.kernels.fused import rope_write_kv

        k_new, v_new, cos, sin = rope
        bs = k_cache.shape[1]
        pos = context_lens.long() - 1
        slots = block_tables.long().gather(1, (pos // bs)[:, None])[:, 0] * bs + pos % bs
        q = rope_write_kv(q, k_new, v_new, cos, sin, k_cache, v_cache, slots, positions=pos)
    return decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, scale)


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """``decode_attention`` in torch: gathers the whole block table (O(max_blocks) per sequence),
    then masked SDPA. The contract the kernel is tested against."""
    b, n_blocks = block_tables.shape
    block_size, kv_heads, head_dim = k_cache.shape[1:]
    length = n_blocks * block_size
    k = k_cache[block_tables].view(b, length, kv_heads, head_dim).transpose(1, 2)  # (B, Hkv, L, D)
    v = v_cache[block_tables].view(b, length, kv_heads, head_dim).transpose(1, 2)
    mask = torch.arange(length, device=q.device)[None, :] < context_lens[:, None]
    o = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=mask[:, None, None, :], scale=scale,
                                       enable_gqa=kv_heads != q.shape[1])
    return o.flatten(1)
