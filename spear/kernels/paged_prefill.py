"""Paged attention for mixed steps: every sequence's chunk of queries (a decode is a chunk of one)
over its cached keys, causal within the chunk, in one launch.

    out[t, h] = softmax(scale · q[t, h] · K_bᵀ, keys 0 .. pos(t)) V_b    for the rows t of sequence b

Layout (spear/serve/model/layers/attention.py): q (T, n_heads, head_dim), the flat batch of every
scheduled token, any strides with unit stride along head_dim (a column slice of the fused qkv
output). Sequence ``b``'s queries are rows ``query_start_loc[b] : query_start_loc[b + 1]``
(cumulative counts, B + 1 entries from 0); rows from ``query_start_loc[B]`` to T are padding and
come out as zeros. A layer's caches (num_blocks, block_size, n_kv_heads, head_dim); token ``t`` of
sequence ``b`` sits in block ``block_tables[b, t // block_size]`` at offset ``t % block_size``, and
the chunk's own keys and values are already there. Sequence ``b`` has ``seq_lens[b]`` keys; its
chunk of ``n_b`` queries holds its last ``n_b`` tokens, so query ``i`` sits at position
``seq_lens[b] - n_b + i`` and sees keys 0 .. that position. The three index tensors may be int32 or
int64, with any strides. Query head ``h`` reads kv head ``h // (n_heads // n_kv_heads)``
(grouped-query attention). Output (T, n_heads · head_dim) in q's dtype, contiguous, as the o_proj
input.

Algorithm (the "unified attention" scheme of vLLM's Triton backend): a program computes a tile of
BLOCK_Q consecutive queries of one sequence for the GROUP query heads of one kv head, packed into
the BLOCK_M = BLOCK_Q · GROUP rows of the tile's M dimension (query-major, head fastest), so each
K/V tile is read once for the group. The grid is (T // BLOCK_Q + B + 1, n_kv_heads): sequence ``b``'s query tiles are
numbered from ``query_start_loc[b] // BLOCK_Q + b``, which leaves room for its cdiv(n_b, BLOCK_Q)
tiles whatever the chunk lengths, and the padding rows are numbered as a sequence B. Each program
finds its sequence by a binary search over query_start_loc on the device; tile numbers a sequence
does not need exit at once. The grid depends on T, B and BLOCK_Q only, never on the lengths, and
nothing is read back to the host, so CUDA graphs of a padded token count capture the launch.

A program walks its sequence's keys in tiles of BLOCK_N tokens up to its last query's position;
key tiles above the causal diagonal of the query tile are never visited. Tiles below the tile's
first query position need no mask at all (every row sees every key: plain loads); the tiles from
there to the last query position mask per row. Each key's block id is gathered from the block
table, so a tile may span several cache blocks (block_size 8 or 16 with 64-key tiles) or part of
one; keys past a sequence's length or the table's width are neither loaded nor counted. Per tile:
S = Q Kᵀ on the tensor cores, online softmax in fp32 (running max and sum, base-2 exponentials
with log2(e) folded into the scale), acc += P V.

Numerics: fp16/bf16 score products are exact in the fp32 accumulators; P is rounded to the cache
dtype for the P V product, as flash attention does. fp32 takes IEEE dots (no TF32). Under the
interpreter (DOT_F32) the dots run on fp32 copies of the same rounded operands. A row that sees no
key (only a chunk longer than its sequence, outside the contract) comes out as zeros.

Inputs outside the contract (a decreasing query_start_loc, a chunk longer than its sequence, a
sequence longer than its table row) give unspecified rows, but no access outside q, the output and
the table rows; the block ids themselves must be valid.

Shapes: head_dim a power of two from 16 to 256, block_size a power of two; anything else raises
ValueError (``supports`` tells the caller beforehand). ``max_query_len``, an upper bound on the
chunk lengths that the scheduler knows, is checked but changes nothing today: one tile shape
serves decodes and prefill chunks (``launch_config``).

Why hand-written: the paged prefill kernels published as Python packages (flash-attn's varlen
kernels with a block table, FlashInfer, vLLM's) are CUDA binaries with their own page-size and
layout rules and cannot run on Triton's CPU interpreter, which is how these kernels are tested
without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spear.kernels._common import INTERPRET, _to
from spear.kernels.attention import check_q_and_caches

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
LOG2E = 1.4426950408889634


@triton.jit
def _attend(acc, m_i, l_i, q, qpos, start, hi, bt_row, k_base, v_base, qk_scale,
            stride_bc, stride_kb, stride_kt, stride_vb, stride_vt,
            HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
            IS_FP32: tl.constexpr, DOT_F32: tl.constexpr, CAUSAL: tl.constexpr):
    """One key tile [start, start + BLOCK_N) into the running (acc, m, l). CAUSAL False: every key
    of the tile exists and every row sees it (no masks, so the loads vectorize)."""
    offs_n = start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    if CAUSAL:
        valid = offs_n < hi
        blk = tl.load(bt_row + (offs_n // BLOCK_SIZE) * stride_bc, mask=valid, other=0).to(tl.int64)
    else:
        blk = tl.load(bt_row + (offs_n // BLOCK_SIZE) * stride_bc).to(tl.int64)
    tok = offs_n % BLOCK_SIZE
    k_ptrs = k_base + (blk * stride_kb + tok * stride_kt)[None, :] + offs_d[:, None]   # [HEAD_DIM, BLOCK_N]
    v_ptrs = v_base + (blk * stride_vb + tok * stride_vt)[:, None] + offs_d[None, :]   # [BLOCK_N, HEAD_DIM]
    if CAUSAL:
        kT = tl.load(k_ptrs, mask=valid[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=valid[:, None], other=0.0)
    else:
        kT = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    if DOT_F32:
        kT = kT.to(tl.float32)
    if IS_FP32:
        s = tl.dot(q, kT, input_precision="ieee")
    else:
        s = tl.dot(q, kT)
    s = s * qk_scale  # log2 units
    if CAUSAL:
        seen = valid[None, :] & (offs_n[None, :] <= qpos[:, None])
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # a row that has seen no key yet keeps m = -inf; subtracting 0 there gives weights
        # exp2(-inf) = 0 rather than exp2(-inf - -inf) = NaN
        m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)
    else:
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_ref = m_new
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IS_FP32:
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision="ieee")
    elif DOT_F32:
        # the GPU path's rounding of P to the cache dtype, on fp32 operands
        acc = tl.dot(_to(p, v.dtype).to(tl.float32), v.to(tl.float32), acc * alpha[:, None])
    else:
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["num_tokens", "num_seqs", "max_blocks", "stride_qsl", "stride_len", "stride_bt",
                               "stride_bc"])
def _paged_prefill_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, qsl_ptr, lens_ptr, out_ptr,
    qk_scale, num_tokens, num_seqs, max_blocks,
    stride_qt, stride_qh, stride_ot,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bt, stride_bc, stride_qsl, stride_len,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, IS_FP32: tl.constexpr, DOT_F32: tl.constexpr,
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    # the sequence of this tile number: the largest b in [0, B] with qsl[b] // BLOCK_Q + b <= pid
    # (b = B: the padding rows after the last sequence)
    lo: tl.int32 = 0
    hi = num_seqs + 1
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(qsl_ptr + mid * stride_qsl).to(tl.int32) // BLOCK_Q + mid
        lo = tl.where(first <= pid, mid + 1, lo)
        hi = tl.where(first <= pid, hi, mid)
    b = tl.maximum(lo - 1, 0)  # lo >= 1 whenever query_start_loc[0] = 0
    q_start = tl.load(qsl_ptr + b * stride_qsl).to(tl.int32)
    tile = pid - (q_start // BLOCK_Q + b)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_local = tile * BLOCK_Q + offs_m // GROUP   # the row's query within its chunk
    heads = kvh * GROUP + offs_m % GROUP
    rows = q_start + q_local                     # the row's token in the flat batch
    # rows past BLOCK_Q · GROUP (a group that does not divide BLOCK_M) belong to the next tile
    in_tile = (offs_m < BLOCK_Q * GROUP) & (rows >= 0) & (rows < num_tokens)
    o_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_ot + heads[:, None] * HEAD_DIM + offs_d[None, :]

    if b == num_seqs:
        tl.store(o_ptrs, tl.zeros((BLOCK_M, HEAD_DIM), out_ptr.dtype.element_ty), mask=in_tile[:, None])
    else:
        n = tl.load(qsl_ptr + (b + 1) * stride_qsl).to(tl.int32) - q_start
        if (tile >= 0) & (tile * BLOCK_Q < n):
            row_ok = in_tile & (q_local < n)
            seq_len = tl.load(lens_ptr + b * stride_len).to(tl.int32)
            first_pos = seq_len - n + tile * BLOCK_Q      # position of the tile's first query
            qpos = first_pos + offs_m // GROUP
            # keys past the block table do not exist; a tile's keys end at its last query's position
            hi_key = tl.minimum(seq_len - n + tl.minimum(tile * BLOCK_Q + BLOCK_Q, n), max_blocks * BLOCK_SIZE)
            # keys [0, diag) are seen by every row of the tile
            diag = tl.maximum(tl.minimum(first_pos + 1, hi_key), 0) // BLOCK_N * BLOCK_N

            q = tl.load(q_ptr + rows.to(tl.int64)[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                        mask=row_ok[:, None], other=0.0)
            if DOT_F32:
                q = q.to(tl.float32)
            bt_row = bt_ptr + b.to(tl.int64) * stride_bt
            k_base = k_ptr + kvh * stride_kh
            v_base = v_ptr + kvh * stride_vh
            m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
            l_i = tl.zeros((BLOCK_M,), tl.float32)
            acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
            for start in range(0, diag, BLOCK_N):
                acc, m_i, l_i = _attend(acc, m_i, l_i, q, qpos, start, hi_key, bt_row, k_base, v_base, qk_scale,
                                        stride_bc, stride_kb, stride_kt, stride_vb, stride_vt,
                                        HEAD_DIM, BLOCK_SIZE, BLOCK_N, IS_FP32, DOT_F32, False)
            for start in range(diag, hi_key, BLOCK_N):
                acc, m_i, l_i = _attend(acc, m_i, l_i, q, qpos, start, hi_key, bt_row, k_base, v_base, qk_scale,
                                        stride_bc, stride_kb, stride_kt, stride_vb, stride_vt,
                                        HEAD_DIM, BLOCK_SIZE, BLOCK_N, IS_FP32, DOT_F32, True)
            o = tl.where(l_i[:, None] > 0, acc / tl.maximum(l_i, 1e-30)[:, None], 0.0)
            tl.store(o_ptrs, _to(o, out_ptr.dtype.element_ty), mask=row_ok[:, None])


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel takes these dtypes and shapes (head_dim, block_size, GQA ratio)."""
    if q.dim() != 3 or k_cache.dim() != 4 or q.dtype not in DTYPES or k_cache.dtype != q.dtype:
        return False
    block_size, kv_heads, head_dim = k_cache.shape[1:]
    return (_pow2(head_dim) and 16 <= head_dim <= 256 and _pow2(block_size)
            and kv_heads > 0 and q.shape[1] % kv_heads == 0 and q.shape[2] == head_dim)


def launch_config(dtype: torch.dtype, head_dim: int, group: int) -> tuple[int, int, int, int]:
    """(rows per tile BLOCK_M, keys per tile BLOCK_N, warps, pipeline stages). 64 rows (or the group,
    if larger): Hopper's warp-group MMA takes M = 64, and 16-row tiles (mma.sync) timed slower on the
    H200 even where every sequence is a decode. 64 keys fp16 at head_dim 128: Q, K and V tiles of
    16 KiB each, the S tile and the fp32 accumulator fit 4 warps; wider or narrower tiles and a third
    stage timed slower on mixed steps. head_dim 256 halves the key tile to bound shared memory and
    registers; fp32 takes the FMA path of ``tl.dot``, which needs 8 warps."""
    block_m = max(64, triton.next_power_of_2(group))
    return block_m, (64 if head_dim <= 128 else 32), (8 if dtype == torch.float32 or head_dim > 128 else 4), 2


def _check(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, max_query_len) -> None:
    check_q_and_caches(q, k_cache, v_cache)
    if seq_lens.dim() != 1 or seq_lens.dtype not in INDEX_DTYPES:
        raise ValueError(f"seq_lens must be (num_seqs,) int32/int64; got {tuple(seq_lens.shape)} {seq_lens.dtype}")
    b = seq_lens.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != b or block_tables.dtype not in INDEX_DTYPES:
        raise ValueError(f"block_tables must be ({b}, max_blocks) int32/int64; got {tuple(block_tables.shape)} "
                         f"{block_tables.dtype}")
    if block_tables.shape[1] == 0:
        raise ValueError("block_tables must have at least one column")
    if query_start_loc.shape != (b + 1,) or query_start_loc.dtype not in INDEX_DTYPES:
        raise ValueError(f"query_start_loc must be ({b + 1},) int32/int64 (num_seqs + 1 cumulative query counts); "
                         f"got {tuple(query_start_loc.shape)} {query_start_loc.dtype}")
    devices = {t.device for t in (q, k_cache, v_cache, block_tables, query_start_loc, seq_lens)}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device; got {sorted(map(str, devices))}")
    if max_query_len is not None and (isinstance(max_query_len, bool) or not isinstance(max_query_len, int)
                                      or max_query_len < 1):
        raise ValueError(f"max_query_len must be None or a positive int; got {max_query_len!r}")


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                            scale: float, *, max_query_len: int | None = None,
                            block_m: int | None = None, block_n: int | None = None) -> torch.Tensor:
    """Causal attention of every sequence's chunk over its paged keys, one launch; (T, n_heads · head_dim)
    in q's dtype, padding rows (from ``query_start_loc[B]``) zero. Layouts: the module docstring.

    Fixed grid for given T and B, no host synchronization: safe inside a CUDA graph. ``block_m``
    (rows per tile, a power of two >= 16 and >= the GQA group) and ``block_n`` (keys per tile, a
    power of two >= 16) override the defaults, for tests."""
    _check(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, max_query_len)
    num_tokens, n_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = n_heads // kv_heads
    tile_m, tile_n, num_warps, num_stages = launch_config(q.dtype, head_dim, group)
    if block_m is not None and not (_pow2(block_m) and block_m >= max(16, group)):
        raise ValueError(f"block_m must be a power of two >= max(16, n_heads // n_kv_heads = {group}); got {block_m}")
    if block_n is not None and not (_pow2(block_n) and block_n >= 16):
        raise ValueError(f"block_n must be a power of two >= 16; got {block_n}")
    block_m, block_n = block_m or tile_m, block_n or tile_n
    block_q = block_m // group
    out = torch.empty((num_tokens, n_heads * head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    num_seqs = seq_lens.shape[0]
    _paged_prefill_kernel[(num_tokens // block_q + num_seqs + 1, kv_heads)](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
        float(scale) * LOG2E, num_tokens, num_seqs, block_tables.shape[1],
        q.stride(0), q.stride(1), out.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), block_tables.stride(1), query_start_loc.stride(0), seq_lens.stride(0),
        GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_N=block_n, IS_FP32=q.dtype == torch.float32, DOT_F32=INTERPRET, num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
