"""Paged attention for the decode step: one query token per sequence over its cached keys.

    out[b, h] = softmax(scale · q[b, h] · K_bᵀ) V_b,   K_b, V_b = the first context_lens[b]
                                                      tokens of sequence b in the paged cache

Layout (spear/serve/model/layers/attention.py): q (B, n_heads, head_dim); a layer's caches
(num_blocks, block_size, n_kv_heads, head_dim); token ``t`` of sequence ``b`` sits in block
``block_tables[b, t // block_size]`` at offset ``t % block_size``. Query head ``h`` reads kv
head ``h // (n_heads // n_kv_heads)`` (grouped-query attention). Output (B, n_heads · head_dim)
in q's dtype, as the o_proj input.

Algorithm: one program per (sequence, kv head) computes all the query heads of that group,
so each K/V tile is read from memory once for the group. The program reads its context
length from the device tensor and walks the keys in tiles of BLOCK_N tokens up to
cdiv(context_len, BLOCK_N); each token's block id is gathered from the block table, so a
tile may span several cache blocks (block_size 8 with a 16-token tile) or part of one. Keys
at positions >= context_len are neither loaded nor counted. Per tile: S = Q Kᵀ on the tensor
cores, online softmax in fp32 (running max and sum, base-2 exponentials with log2(e) folded
into the scale), acc += P V. The grid is (B, n_kv_heads) whatever the context lengths, and
nothing is read back to the host, so CUDA graphs capture it; memory traffic is the blocks
the sequences use, not the padded block table.

The query group is padded to 16 rows for ``tl.dot`` (its smallest M). Decode attention is
bound by the K/V reads, so the padded rows cost tensor-core cycles the kernel has to spare;
the elementwise alternative (a [group, BLOCK_N, head_dim] product reduced over head_dim)
would need that whole product in registers and force a smaller key tile, i.e. fewer bytes
in flight per program.

Numerics: fp16/bf16 score products are exact in the fp32 accumulators; P is rounded to the
cache dtype for the P V product, as flash attention does. fp32 takes IEEE dots (no TF32).
Under the interpreter (DOT_F32) the dots run on fp32 copies of the same rounded operands.

Split context (flash-decoding, one launch). B × n_kv_heads programs leave most of the GPU
idle at small batch (Llama-2-7B at batch 1: 32 programs, each walking its context tile by
tile, two dependent memory round trips per tile). So the grid is (B, n_kv_heads, splits):
split s walks keys [s·chunk, (s+1)·chunk) of the context. The number of splits is fixed per
launch from the block table's width and the batch (about 256 programs), so a CUDA graph
captures it; each program computes its sequence's chunk from the context length it reads on
the device (the sequence's key tiles spread over the splits, at least MIN_SPLIT_TILES each),
so a short context is split as finely as a long one; splits past a sequence's context exit
at once. A sequence whose
context fits one chunk is finished by its one active split as before. Otherwise every
active split writes its fp32 partial (running max m, sum l, unnormalised output) to a
workspace and bumps a counter of its (sequence, kv head); the split that arrives last
merges the partials (running max, rescaled sums: exact up to summation order) and resets
the counter, so no second launch is needed and the counters stay zero between calls.

Shapes: head_dim a power of two from 16 to 256, block_size a power of two (tiles of 16+
keys cover blocks of 8 by gathering); anything else raises ValueError (``supports`` tells
the caller beforehand).

Why hand-written: the paged decode kernels published as Python packages (flash-attn's
``flash_attn_with_kvcache``, FlashInfer, vLLM's) are CUDA binaries with their own page-size
and layout rules and cannot run on Triton's CPU interpreter, which is how these kernels are
tested without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spear.kernels import _common
from spear.kernels._common import INTERPRET, _pdl_wait
from spear.kernels._rotary import _rope_q_write_kv

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["max_blocks", "stride_bt"])
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, out_ptr,
    part_ptr,      # fp32 (B, n_kv_heads, SPLITS, GROUP_PAD, HEAD_DIM + 2): o, then m and l per row
    count_ptr,     # int32 (B * n_kv_heads,) arrival counters, zero on entry and on exit
    kn_ptr, vn_ptr, cos_ptr, sin_ptr,  # ROPE: the new token's k and v (B, n_kv_heads, D), rotary tables
    qk_scale, max_blocks,
    stride_qb, stride_qh, stride_ob,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bt, stride_len, stride_knb, stride_vnb,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, IS_FP32: tl.constexpr, DOT_F32: tl.constexpr,
    SPLITS: tl.constexpr, MIN_TILES: tl.constexpr = 1, PDL: tl.constexpr = False, ROPE: tl.constexpr = False,
):
    _pdl_wait(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    o_ptrs = out_ptr + b * stride_ob + heads[:, None] * HEAD_DIM + offs_d[None, :]

    # keys past the block table do not exist (the reference's mask is over the table's length)
    ctx = tl.minimum(tl.load(lens_ptr + b * stride_len).to(tl.int32), max_blocks * BLOCK_SIZE)
    # this sequence's chunk: its key tiles spread over the splits, at least MIN_TILES each
    chunk = tl.maximum(tl.cdiv(tl.cdiv(ctx, BLOCK_N), SPLITS), MIN_TILES) * BLOCK_N
    active = tl.cdiv(ctx, chunk)  # splits holding at least one key (<= SPLITS)
    if split == 0 or split < active:
        bt_row = bt_ptr + b.to(tl.int64) * stride_bt
        k_base = k_ptr + kvh * stride_kh
        v_base = v_ptr + kvh * stride_vh
        if ROPE:
            q = _rope_q_write_kv(q_ptr + b * stride_qb + heads[:, None] * stride_qh, g_mask,
                                 kn_ptr + b * stride_knb + kvh * HEAD_DIM, vn_ptr + b * stride_vnb + kvh * HEAD_DIM,
                                 cos_ptr, sin_ptr, lens_ptr + b * stride_len, bt_row, k_base, v_base,
                                 stride_kb, stride_kt, stride_vb, stride_vt, (split == (ctx - 1) // chunk) & (ctx > 0),
                                 GROUP_PAD, HEAD_DIM, BLOCK_SIZE, out_ptr.dtype.element_ty)
        else:
            q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=g_mask[:, None],
                        other=0.0)
        if DOT_F32:
            q = q.to(tl.float32)

        m_i = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
        l_i = tl.zeros((GROUP_PAD,), tl.float32)
        acc = tl.zeros((GROUP_PAD, HEAD_DIM), tl.float32)
        lo = split * chunk
        hi = tl.minimum(lo + chunk, ctx)
        for start in range(lo, hi, BLOCK_N):
            pos = start + offs_n
            valid = pos < hi
            blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
            tok = pos % BLOCK_SIZE
            kT = tl.load(k_base + (blk * stride_kb + tok * stride_kt)[None, :] + offs_d[:, None],
                         mask=valid[None, :], other=0.0)                                    # [HEAD_DIM, BLOCK_N]
            v = tl.load(v_base + (blk * stride_vb + tok * stride_vt)[:, None] + offs_d[None, :],
                        mask=valid[:, None], other=0.0)                                     # [BLOCK_N, HEAD_DIM]
            if DOT_F32:
                kT = kT.to(tl.float32)
            if IS_FP32:
                s = tl.dot(q, kT, input_precision="ieee")
            else:
                s = tl.dot(q, kT)
            s = tl.where(valid[None, :], s * qk_scale, float("-inf"))                      # log2 units
            # every tile holds at least one valid key (start < hi), so m_new is finite
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if IS_FP32:
                acc = tl.dot(p, v, acc * alpha[:, None], input_precision="ieee")
            elif DOT_F32:
                # the GPU path's rounding of P to the cache dtype, on fp32 operands
                acc = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), acc * alpha[:, None])
            else:
                acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            m_i = m_new
        if SPLITS == 1 or active <= 1:
            # context_len 0 (never scheduled) gives zeros rather than 0/0
            o = tl.where(l_i[:, None] > 0, acc / tl.maximum(l_i, 1e-30)[:, None], 0.0)
            tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
        else:
            ROW: tl.constexpr = HEAD_DIM + 2
            head_part = part_ptr + (b * tl.num_programs(1) + kvh).to(tl.int64) * (SPLITS * GROUP_PAD * ROW)
            rows = head_part + split * (GROUP_PAD * ROW) + offs_g * ROW
            tl.store(rows[:, None] + offs_d[None, :], acc, mask=g_mask[:, None])
            tl.store(rows + HEAD_DIM, m_i, mask=g_mask)
            tl.store(rows + HEAD_DIM + 1, l_i, mask=g_mask)
            # every thread's stores must precede the (single-thread) release
            tl.debug_barrier()
            counter = count_ptr + b * tl.num_programs(1) + kvh
            arrived = tl.atomic_add(counter, 1, sem="acq_rel")
            if arrived == active - 1:
                _merge_partials(head_part, active, o_ptrs, g_mask, offs_g, offs_d, out_ptr, GROUP_PAD, HEAD_DIM,
                                SPLITS)
                tl.atomic_xchg(counter, 0)


@triton.jit
def _merge_partials(head_part, active, o_ptrs, g_mask, offs_g, offs_d, out_ptr, GROUP_PAD: tl.constexpr,
                    HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr):
    """Output rows from the ``active`` partials at ``head_part``: o = sum_s 2^(m_s - M) o_s / sum_s 2^(m_s - M) l_s,
    merged online (a running max, rescaled as flash attention's tiles are): each chunk's m, l and o are
    loaded together, so a merge of up to CHUNK partials is one round trip (with the maxima read first,
    it was two)."""
    ROW: tl.constexpr = HEAD_DIM + 2
    m_run = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
    o = tl.zeros((GROUP_PAD, HEAD_DIM), tl.float32)
    l = tl.zeros((GROUP_PAD,), tl.float32)
    CHUNK: tl.constexpr = 4  # partials in flight per round trip
    for s0 in range(0, active, CHUNK):
        for j in tl.static_range(CHUNK):
            live = g_mask & ((offs_g * 0 + s0 + j) < active)
            rows = head_part + (s0 + j) * (GROUP_PAD * ROW) + offs_g * ROW
            # .cg: read at L2, where the other programs' writes are
            m_j = tl.load(rows + HEAD_DIM, mask=live, other=float("-inf"), cache_modifier=".cg")
            l_j = tl.load(rows + HEAD_DIM + 1, mask=live, other=0.0, cache_modifier=".cg")
            o_j = tl.load(rows[:, None] + offs_d[None, :], mask=live[:, None], other=0.0, cache_modifier=".cg")
            m_new = tl.maximum(m_run, m_j)
            # rows with no partial yet (padded rows, dead splits) keep m = -inf; subtracting 0 there
            # instead gives weights exp2(-inf) = 0 rather than exp2(-inf - -inf) = NaN
            m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)
            scale = tl.exp2(m_run - m_ref)
            w = tl.exp2(m_j - m_ref)
            l = l * scale + w * l_j
            o = o * scale[:, None] + w[:, None] * o_j
            m_run = m_new
    o = o / tl.maximum(l, 1e-30)[:, None]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel takes these dtypes and shapes (head_dim, block_size, GQA ratio)."""
    if q.dim() != 3 or k_cache.dim() != 4 or q.dtype not in DTYPES:
        return False
    block_size, kv_heads, head_dim = k_cache.shape[1:]
    return (_pow2(head_dim) and 16 <= head_dim <= 256 and _pow2(block_size) and block_size <= 256
            and kv_heads > 0 and q.shape[1] % kv_heads == 0 and q.shape[2] == head_dim)


def launch_config(dtype: torch.dtype, head_dim: int) -> tuple[int, int]:
    """(keys per tile, warps). 64 keys keep 16 KiB each of K and V (fp16, head_dim 128) in
    flight per program, double-buffered by cp.async; head_dim 256 halves the tile to bound
    shared memory and registers. fp32 takes the FMA path of ``tl.dot`` (exact products), whose
    operands spill at 4 warps and fit at 8 (ptxas for sm_90)."""
    return (64 if head_dim <= 128 else 32), (8 if dtype == torch.float32 else 4)


def _check_rope_args(q, k_cache, rope) -> None:
    if not isinstance(rope, tuple) or len(rope) != 4:
        raise ValueError("rope must be the tuple (k_new, v_new, cos, sin)")
    k_new, v_new, cos, sin = rope
    b, _, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        if not torch.is_tensor(t) or t.shape != (b, kv_heads, head_dim) or t.dtype != q.dtype:
            raise ValueError(f"{name} must be ({b}, {kv_heads}, {head_dim}) {q.dtype}; got "
                             f"{tuple(getattr(t, 'shape', ()))} {getattr(t, 'dtype', type(t))}")
        if t.stride()[1:] != (head_dim, 1):
            raise ValueError(f"{name} must be contiguous within each token; got strides {t.stride()}")
    for name, t in (("cos", cos), ("sin", sin)):
        if not torch.is_tensor(t) or t.dim() != 2 or t.shape[1] != head_dim or t.dtype != q.dtype \
                or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous (max_len, {head_dim}) {q.dtype} table; got "
                             f"{tuple(getattr(t, 'shape', ()))} {getattr(t, 'dtype', type(t))}")
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        raise ValueError(f"with rope, q must be contiguous within each token; got strides {q.stride()}")


def check_q_and_caches(q, k_cache, v_cache, max_block_size: int | None = None) -> None:
    """The rules both paged attention kernels share for q (rows, n_heads, head_dim) and the caches."""
    if q.dim() != 3:
        raise ValueError(f"q must be (rows, n_heads, head_dim); got shape {tuple(q.shape)}")
    if q.dtype not in DTYPES:
        raise ValueError(f"q must be float16, bfloat16 or float32; got {q.dtype}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be (num_blocks, block_size, n_kv_heads, head_dim); got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"the caches must be in q's dtype {q.dtype}; got {k_cache.dtype} and {v_cache.dtype}")
    _, n_heads, head_dim = q.shape
    _, block_size, kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim:
        raise ValueError(f"q has head_dim {head_dim}, the caches {cache_dim}")
    if not (_pow2(head_dim) and 16 <= head_dim <= 256):
        raise ValueError(f"head_dim must be a power of two from 16 to 256; got {head_dim}")
    if not _pow2(block_size) or (max_block_size is not None and block_size > max_block_size):
        raise ValueError(f"block_size must be a power of two{'' if max_block_size is None else f' up to {max_block_size}'}"
                         f"; got {block_size}")
    if kv_heads == 0 or n_heads % kv_heads:
        raise ValueError(f"n_heads={n_heads} must be a multiple of n_kv_heads={kv_heads}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride along head_dim; got strides {t.stride()}")


def _check(q, k_cache, v_cache, block_tables, context_lens) -> None:
    check_q_and_caches(q, k_cache, v_cache, max_block_size=256)
    b = q.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != b or block_tables.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_tables must be ({b}, max_blocks) int32/int64; got {tuple(block_tables.shape)} "
                         f"{block_tables.dtype}")
    if block_tables.shape[1] == 0:
        raise ValueError("block_tables must have at least one column")
    if context_lens.shape != (b,) or context_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"context_lens must be ({b},) int32/int64; got {tuple(context_lens.shape)} "
                         f"{context_lens.dtype}")
    devices = {t.device for t in (q, k_cache, v_cache, block_tables, context_lens)}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device; got {sorted(map(str, devices))}")


# The defaults of KernelPolicy.attention_*: split the context until the grid has about
# TARGET_PROGRAMS programs, at most MAX_SPLITS splits of at least MIN_SPLIT_TILES key tiles each
# (a split costs a partial write and the merge).
TARGET_PROGRAMS = 256
MAX_SPLITS = 32
MIN_SPLIT_TILES = 1
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 arrival counters for the split merge, kept per device: the kernel leaves them
    zero, so one buffer serves every call (and every captured graph) on that device's stream."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


def split_config(batch: int, kv_heads: int, max_ctx: int, block_n: int, max_splits: int = MAX_SPLITS,
                 target_programs: int = TARGET_PROGRAMS) -> int:
    """Context splits of a launch: a power of two, at most ``max_splits`` and at most the key tiles
    of the block table's width, until the grid has about ``target_programs`` programs."""
    tiles = triton.cdiv(max_ctx, block_n)
    splits = 1
    while splits * 2 <= min(tiles, max_splits) and batch * kv_heads * splits * 2 <= target_programs:
        splits *= 2
    return splits


def split_chunk(ctx: int, splits: int, block_n: int, min_tiles: int = MIN_SPLIT_TILES) -> int:
    """Keys per split for a sequence of ``ctx`` keys (the kernel's rule, for tests and planning)."""
    return max(triton.cdiv(triton.cdiv(ctx, block_n), splits), min_tiles) * block_n


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           *, block_n: int | None = None, splits: int | None = None,
                           rope: tuple[torch.Tensor, ...] | None = None, pdl: int = 0,
                           max_splits: int = MAX_SPLITS, min_split_tiles: int = MIN_SPLIT_TILES,
                           target_programs: int = TARGET_PROGRAMS) -> torch.Tensor:
    """Attention of one query per sequence over its paged keys; (B, n_heads · head_dim) in q's dtype.

    Same contract as ``reference.decode_attention``: block table entries past a
    sequence's last block are never read, context lengths past the table's width are clamped
    to it. Fixed grid and no host synchronization: safe inside a CUDA graph. ``block_n`` (keys per
    tile, a power of two >= 16) and ``splits`` (context splits, a power of two) override the
    defaults, for tests; ``max_splits``, ``min_split_tiles`` and ``target_programs`` come from the
    engine's KernelPolicy. ``pdl`` 1: launched with programmatic dependent launch.

    ``rope`` = (k_new, v_new, cos, sin): q is not yet rotated, and the new token (position
    context_len - 1) is not yet in the cache. The kernel rotates q and writes the rotated k_new
    and v_new (B, n_kv_heads, head_dim) at that position's slot before reading it, so the separate
    rotary + cache-write launch (``fused.rope_write_kv``) is not needed; cos and sin are the
    whole (max_len, head_dim) rotary tables. Same results as that launch followed by this one.
    """
    _check(q, k_cache, v_cache, block_tables, context_lens)
    if rope is not None:
        _check_rope_args(q, k_cache, rope)
    if block_n is not None and not (_pow2(block_n) and block_n >= 16):
        raise ValueError(f"block_n must be a power of two >= 16; got {block_n}")
    if splits is not None and not _pow2(splits):
        raise ValueError(f"splits must be a power of two; got {splits}")
    b, n_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = n_heads // kv_heads
    group_pad = max(16, triton.next_power_of_2(group))
    out = torch.empty((b, n_heads * head_dim), dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    tile, num_warps = launch_config(q.dtype, head_dim)
    block_n = block_n or tile
    max_ctx = block_tables.shape[1] * block_size
    n_split = splits or split_config(b, kv_heads, max_ctx, block_n, max_splits, target_programs)
    if min_split_tiles < 1:
        raise ValueError(f"min_split_tiles must be >= 1; got {min_split_tiles}")
    if n_split > 1:
        part = torch.empty((b, kv_heads, n_split, group_pad, head_dim + 2), dtype=torch.float32, device=q.device)
        counters = _counters(q.device, b * kv_heads)
    else:
        part = counters = out  # never touched
    k_new, v_new, cos, sin = rope if rope is not None else (q, q, q, q)  # never read without ROPE
    _paged_decode_kernel[(b, kv_heads, n_split)](
        q, k_cache, v_cache, block_tables, context_lens, out, part, counters,
        k_new, v_new, cos, sin,
        float(scale) * LOG2E, block_tables.shape[1],
        q.stride(0), q.stride(1), out.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), context_lens.stride(0), k_new.stride(0), v_new.stride(0),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, IS_FP32=q.dtype == torch.float32, DOT_F32=INTERPRET,
        SPLITS=n_split, MIN_TILES=min_split_tiles, ROPE=rope is not None, num_warps=num_warps, num_stages=2,
        **_common.pdl_args(pdl),
    )
    return out
