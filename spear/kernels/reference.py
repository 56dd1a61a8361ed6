"""Plain-torch references for the kernels: the contract every kernel is tested against.

The W4 layer's math is done in fp32 from the stored (fp16/bf16) parameters; callers cast the result.

  W_hat = (codes - zeros) * scales            per group of ``group_size`` input columns
  y     = x W_hatᵀ (+ bias)
  u     = x Aᵀ                                 A: (r, K)
  gamma = 1 + bound * tanh(silu(u W1ᵀ + b1) W2ᵀ + b2)   (gamma = 1 without a gate)
  y    += alpha * (gamma ⊙ u) Bᵀ              B: (N, r)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from spear.kernels.layout import PackedEC, PackedW4, unpack


def dequantize(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """fp32 W_hat (N, K) from codes (N, K), scales and zeros (N, G)."""
    n, k = codes.shape
    g = scales.shape[1]
    w = codes.float().reshape(n, g, k // g) - zeros.float().unsqueeze(-1)
    return (w * scales.float().unsqueeze(-1)).reshape(n, k)


def ec_gate(u: torch.Tensor, w1: torch.Tensor | None, b1: torch.Tensor | None, w2: torch.Tensor | None,
            b2: torch.Tensor | None, bound: float) -> torch.Tensor:
    """gamma(u) ⊙ u in fp32; u is (M, r). No gate (w1 None) means gamma = 1."""
    if w1 is None:
        return u
    h = torch.nn.functional.silu(u @ w1.float().t() + b1.float())
    gamma = 1.0 + bound * torch.tanh(h @ w2.float().t() + b2.float())
    return gamma * u


def w4a16_ec(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
             bias: torch.Tensor | None = None, a: torch.Tensor | None = None, b: torch.Tensor | None = None,
             w1: torch.Tensor | None = None, b1: torch.Tensor | None = None, w2: torch.Tensor | None = None,
             b2: torch.Tensor | None = None, alpha: float = 1.0, bound: float = 1.0) -> torch.Tensor:
    """fp32 reference of the whole layer for x (M, K); the EC is skipped when ``a`` is None."""
    xf = x.float()
    y = xf @ dequantize(codes, scales, zeros, group_size).t()
    if bias is not None:
        y = y + bias.float()
    if a is not None:
        v = ec_gate(xf @ a.float().t(), w1, b1, w2, b2, bound)
        y = y + alpha * (v @ b.float().t())
    return y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as transformers' Llama computes it: fp32 statistics, x·rstd rounded to x's dtype,
    then the product with ``weight`` in their promoted dtype (the fused kernel's contract)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary on x (T, heads, head_dim) with cos, sin (T, head_dim) of each token's position, in
    the activation dtype as transformers' Llama does."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return x * cos + rotate_half(x) * sin


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slots: torch.Tensor) -> None:
    """Store each token's k, v (T, kv_heads, head_dim) at its cache slot (block · block_size + offset)."""
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slots, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slots, v)


def silu_mul_pairs(y: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in fp32 for outputs whose features are interleaved (gate, up) pairs."""
    y = y.float()
    return torch.nn.functional.silu(y[..., 0::2]) * y[..., 1::2]


def w8a16(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
          bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 ``x (qweight * scale[:, None])ᵀ (+ bias)`` for x (..., K): the W8A16 kernel's contract."""
    y = x.float() @ (qweight.float() * scale.float()[:, None]).t()
    return y + bias.float() if bias is not None else y


def w4a16_ec_packed(x: torch.Tensor, packed: PackedW4, bias: torch.Tensor | None = None,
                    ec: PackedEC | None = None) -> torch.Tensor:
    """The same reference from the packed layouts (zero padding of the EC contributes exactly 0)."""
    codes, scales, zeros = unpack(packed)
    if ec is None:
        return w4a16_ec(x, codes, scales, zeros, packed.group_size, bias)
    return w4a16_ec(x, codes, scales, zeros, packed.group_size, bias, ec.a, ec.b, ec.w1, ec.b1, ec.w2, ec.b2,
                    ec.alpha, ec.bound)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per sequence over its paged keys (the decode attention kernel's contract): gathers
    the whole block table (O(max_blocks) per sequence), then masked SDPA. q (B, n_heads, head_dim),
    caches (num_blocks, block_size, n_kv_heads, head_dim), block_tables (B, max_blocks) int64 whose
    entries past a sequence's last block may point anywhere valid (they are masked), context_lens
    (B,). Returns (B, n_heads * head_dim)."""
    b, n_blocks = block_tables.shape
    block_size, kv_heads, head_dim = k_cache.shape[1:]
    length = n_blocks * block_size
    flat = block_tables.reshape(-1)  # whole blocks by index_select: one index a block
    k = k_cache.index_select(0, flat).view(b, length, kv_heads, head_dim).transpose(1, 2)  # (B, Hkv, L, D)
    v = v_cache.index_select(0, flat).view(b, length, kv_heads, head_dim).transpose(1, 2)
    mask = torch.arange(length, device=q.device)[None, :] < context_lens[:, None]
    o = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=mask[:, None, None, :], scale=scale,
                                       enable_gqa=kv_heads != q.shape[1])
    return o.flatten(1)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                      block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                                      seq_lens: torch.Tensor, scale: float, *,
                                      max_query_len: int | None = None) -> torch.Tensor:
    """``paged_prefill.paged_prefill_attention`` in torch, the contract the kernel is tested against: a loop over
    the sequences, each gathering its keys 0 .. seq_lens[b] - 1 from the block table and attending
    causally in fp32; padding rows and rows that see no key are zero. Output in q's dtype.
    ``max_query_len`` is accepted for the same signature and changes nothing."""
    num_tokens, n_heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1:3]
    group = n_heads // kv_heads
    out = torch.zeros(num_tokens, n_heads, head_dim, dtype=torch.float32, device=q.device)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for b, ctx in enumerate(lens):
        lo, hi = starts[b], starts[b + 1]
        n = hi - lo
        if n <= 0:
            continue
        ctx = min(ctx, block_tables.shape[1] * block_size)  # keys past the table's width do not exist
        pos = torch.arange(ctx, device=q.device)
        blocks = block_tables[b].long()[pos // block_size]
        k = k_cache[blocks, pos % block_size].float().repeat_interleave(group, dim=1)   # (ctx, n_heads, D)
        v = v_cache[blocks, pos % block_size].float().repeat_interleave(group, dim=1)
        qpos = lens[b] - n + torch.arange(n, device=q.device)
        seen = pos[None, :] <= qpos[:, None]                                             # (n, ctx)
        s = torch.einsum("qhd,khd->hqk", q[lo:hi].float(), k) * scale
        p = torch.softmax(s.masked_fill(~seen, float("-inf")), dim=-1)
        o = torch.einsum("hqk,khd->qhd", p, v)
        out[lo:hi] = torch.where(seen.any(dim=1)[:, None, None], o, 0.0)               # no key seen: zeros
    return out.flatten(1).to(q.dtype)


def tp_reduce_ec(staging: list[torch.Tensor], n: int, bias: torch.Tensor | None = None,
                 b: torch.Tensor | None = None, alpha: float = 1.0, w1: torch.Tensor | None = None,
                 b1: torch.Tensor | None = None, w2: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                 bound: float = 1.0) -> torch.Tensor:
    """``tp_reduce.tp_reduce_ec``'s contract, in fp32 (fp64 for fp64 buffers), (M, n): each staging
    buffer (M, n [+ r]) holds a rank's partial output and, with ``b`` (n, r) given, its partial u
    after it; the buffers are summed in order, then y = sum[:, :n] + bias + alpha · (gamma(u) ⊙ u) Bᵀ,
    u = sum[:, n:n + r]."""
    acc = torch.promote_types(staging[0].dtype, torch.float32)
    s = staging[0].to(acc)
    for t in staging[1:]:
        s = s + t.to(acc)
    y = s[:, :n]
    if b is not None:
        u = s[:, n:n + b.shape[1]]
        if w1 is not None:
            h = F.silu(u @ w1.to(acc).t() + b1.to(acc))
            u = (1.0 + bound * torch.tanh(h @ w2.to(acc).t() + b2.to(acc))) * u
        y = y + alpha * (u @ b.to(acc).t())
    if bias is not None:
        y = y + bias.to(acc)
    return y
