"""Paged decode attention (spear.kernels.attention) against its torch reference (reference.decode_attention).

Every batch holds sequences of context lengths 1, 7, 16, 17 and 40 over shuffled cache blocks,
block tables padded with a scratch block id, and a padding row (all-scratch table, context
length 1), as the engine's CUDA-graph path builds them. Cache slots outside every context are
NaN, so a masked key that is loaded (rather than skipped) shows up; the output starts as NaN.

On the CPU these run through TRITON_INTERPRET=1 at small shapes (conftest.py); the tests
marked ``gpu`` repeat them at real Llama shapes, and inside a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from spear.kernels.attention import paged_decode_attention
from spear.kernels.reference import decode_attention as decode_attention_reference
from tests.kernels._helpers import DEVICE, SQNR_FLOOR, TOL, allocations, sqnr_db

CONTEXT_LENS = (1, 7, 16, 17, 40)
# fp32 reference vs a kernel in fp32 (exp2 with the scale folded, another summation order)
TOLS = {**TOL, torch.float32: 1e-5}
FLOORS = {**SQNR_FLOOR, torch.float32: 100.0}


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert torch.isfinite(out).all(), f"{what}: non-finite values (unwritten output or a masked key read)"
    assert out.shape == ref.shape and out.dtype == dtype, f"{what}: {tuple(out.shape)} {out.dtype}"
    err = float((out.float() - ref.float()).abs().max() / ref.float().abs().max())
    s = sqnr_db(ref, out.float())
    assert err <= TOLS[dtype] and s >= FLOORS[dtype], (
        f"{what}: max error {err:.2e} (tol {TOLS[dtype]:.0e}), SQNR {s:.1f} dB (floor {FLOORS[dtype]} dB)")


def make_batch(context_lens, n_heads, kv_heads, head_dim, block_size, dtype, seed, extra_blocks=3,
               device=DEVICE):
    """(q, k_cache, v_cache, clean k, clean v, block_tables, context_lens) with one padding row added.

    Blocks are handed out in a random order; the last block is the scratch block. In the
    caches the kernel gets, every slot that is not a position < context_len of some row is NaN;
    the clean copies (for the reference, whose masked SDPA would turn NaN into NaN) hold the
    random values there instead.
    """
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in context_lens]
    max_blocks = max(need) + 1  # one more column than any row needs: every table is padded
    num_blocks = sum(need) + extra_blocks + 1
    scratch = num_blocks - 1
    perm = torch.randperm(num_blocks - 1, generator=g).tolist()
    tables, live = [], torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for n, nb in zip(context_lens, need):
        row = [perm.pop() for _ in range(nb)]
        for t in range(n):
            live[row[t // block_size], t % block_size] = True
        tables.append(row + [scratch] * (max_blocks - nb))
    tables.append([scratch] * max_blocks)  # padding row: reads scratch slot 0
    live[scratch, 0] = True
    lens = list(context_lens) + [1]
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k = torch.randn(shape, generator=g)
    v = torch.randn(shape, generator=g)
    q = torch.randn(len(lens), n_heads, head_dim, generator=g)
    dead = ~live[:, :, None, None]
    kp, vp = k.masked_fill(dead, float("nan")), v.masked_fill(dead, float("nan"))
    to = lambda x: x.to(dtype).to(device)  # noqa: E731
    i64 = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
    return to(q), to(kp), to(vp), to(k), to(v), i64(tables), i64(lens)


def _reference(q, k, v, tables, lens, scale):
    """The torch reference in fp32 on the (rounded) inputs the kernel reads."""
    return decode_attention_reference(q.float().cpu(), k.float().cpu(), v.float().cpu(), tables.cpu(), lens.cpu(),
                                      scale)


# (block_size, GQA ratio, head_dim, dtype, keys per tile): tiles spanning two blocks (8 / 16),
# one block, half a block (32 / 16), and the default tile (one tile holds every context)
CASES = [
    (8, 1, 16, torch.float32, 16),
    (16, 4, 32, torch.float32, 16),
    (8, 4, 32, torch.float16, 16),
    (16, 1, 32, torch.float16, None),
    (16, 4, 16, torch.bfloat16, 16),
    (32, 4, 16, torch.float16, 16),
]


@pytest.mark.parametrize("block_size,ratio,head_dim,dtype,block_n", CASES)
def test_paged_decode_attention(poisoned, block_size, ratio, head_dim, dtype, block_n):
    kv_heads = 2
    q, kp, vp, k, v, tables, lens = make_batch(CONTEXT_LENS, kv_heads * ratio, kv_heads, head_dim, block_size,
                                               dtype, seed=block_size + ratio + head_dim)
    scale = head_dim ** -0.5
    out = paged_decode_attention(q, kp, vp, tables, lens, scale, block_n=block_n)
    what = f"bs={block_size} gqa={ratio} d={head_dim} {dtype} tile={block_n}"
    _check(out.cpu(), _reference(q, k, v, tables, lens, scale), dtype, what)


@pytest.mark.parametrize("splits,min_tiles", [(1, 1), (2, 1), (8, 1), (8, 2)])
@pytest.mark.parametrize("ratio,dtype", [(1, torch.float16), (4, torch.float32)])
def test_split_context_merges_exactly(poisoned, grid_order, splits, min_tiles, ratio, dtype):
    """One split (no merge), two (chunks of several tiles), eight (more splits than some contexts
    have tiles: empty splits exit), eight with two tiles per split at the least; the counters are
    left at zero for the next call."""
    from spear.kernels import attention

    q, kp, vp, k, v, tables, lens = make_batch(CONTEXT_LENS, 2 * ratio, 2, 32, 8, dtype, seed=splits + ratio)
    ref = _reference(q, k, v, tables, lens, 32 ** -0.5)
    for _ in range(2):  # a second call over the same counters
        out = paged_decode_attention(q, kp, vp, tables, lens, 32 ** -0.5, block_n=16, splits=splits,
                                     min_split_tiles=min_tiles)
        _check(out.cpu(), ref, dtype, f"splits={splits} gqa={ratio} {dtype}")
        if splits > 1:
            assert int(attention._COUNTERS[out.device].abs().sum()) == 0, "merge counters not reset"


def _rope_tables(max_len, head_dim, dtype, device=DEVICE):
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    freqs = torch.arange(max_len, dtype=torch.float64)[:, None] * inv[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)


def _rope_case(context_lens, n_heads, kv_heads, head_dim, block_size, dtype, seed, block_n=None, splits=None):
    """ROPE against rope_write_kv followed by the plain kernel: caches and output bit for bit, and
    the fp32 reference. The new token's cache slots start as NaN, so a kernel that read them
    before writing them fails."""
    from spear.kernels.fused import rope_write_kv

    q, kp, vp, k, v, tables, lens = make_batch(context_lens, n_heads, kv_heads, head_dim, block_size, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    b = q.shape[0]
    qkv = torch.randn(b, (n_heads + 2 * kv_heads) * head_dim, generator=g).to(dtype).to(DEVICE)
    q_raw, k_new, v_new = qkv.split([n_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    q_raw = q_raw.view(b, n_heads, head_dim)
    k_new, v_new = k_new.view(b, kv_heads, head_dim), v_new.view(b, kv_heads, head_dim)
    cos, sin = _rope_tables(max(context_lens) + 1, head_dim, dtype)
    pos = lens - 1
    slots = tables.gather(1, (pos // block_size)[:, None])[:, 0] * block_size + pos % block_size
    blk, off = slots // block_size, slots % block_size
    kp[blk, off] = float("nan")
    vp[blk, off] = float("nan")
    k_sep, v_sep = kp.clone(), vp.clone()
    q_rot = rope_write_kv(q_raw, k_new, v_new, cos, sin, k_sep, v_sep, slots, positions=pos)
    scale = head_dim ** -0.5
    what = f"rope H={n_heads}/{kv_heads} d={head_dim} bs={block_size} {dtype} splits={splits}"
    expect = paged_decode_attention(q_rot, k_sep, v_sep, tables, lens, scale, block_n=block_n, splits=splits)
    out = paged_decode_attention(q_raw, kp, vp, tables, lens, scale, block_n=block_n, splits=splits,
                                 rope=(k_new, v_new, cos, sin))
    assert torch.equal(kp.nan_to_num(7.0), k_sep.nan_to_num(7.0)), f"{what}: k cache differs from rope_write_kv's"
    assert torch.equal(vp.nan_to_num(7.0), v_sep.nan_to_num(7.0)), f"{what}: v cache differs from rope_write_kv's"
    if DEVICE == "cuda":
        # compiled, the two kernels may sum the scores in another order: one unit in the last place
        ulp = torch.finfo(dtype).eps * expect.float().abs().clamp_min(1.0)
        diff = (out.float() - expect.float()).abs()
        assert (diff <= ulp).all(), f"{what}: output more than 1 ulp off rope_write_kv + attention ({diff.max():.3g})"
    else:
        assert torch.equal(out, expect), f"{what}: output differs from rope_write_kv + attention"
    k_ref, v_ref = k.clone(), v.clone()
    k_ref[blk, off], v_ref[blk, off] = k_sep[blk, off], v_sep[blk, off]
    _check(out.cpu(), _reference(q_rot, k_ref, v_ref, tables, lens, scale), dtype, what)


@pytest.mark.parametrize("splits,ratio,dtype,block_size", [(1, 1, torch.float16, 8), (8, 4, torch.float32, 8),
                                                          (4, 2, torch.bfloat16, 16), (2, 4, torch.float16, 32)])
def test_rope_in_attention_equals_rope_write_then_attention(poisoned, grid_order, splits, ratio, dtype, block_size):
    """The rotary and the new token's cache write inside the attention kernel (``rope=``): the split
    that holds the new position writes it and no other split reads it, in either program order."""
    _rope_case(CONTEXT_LENS, 2 * ratio, 2, 32, block_size, dtype, seed=splits + ratio + block_size, block_n=16,
               splits=splits)


def test_rope_in_attention_checks_its_arguments():
    q = torch.zeros(2, 4, 16, device=DEVICE)
    k = torch.zeros(5, 8, 2, 16, device=DEVICE)
    tables, lens = torch.zeros(2, 3, dtype=torch.long, device=DEVICE), torch.ones(2, dtype=torch.long, device=DEVICE)
    cos = torch.zeros(8, 16, device=DEVICE)
    kn = torch.zeros(2, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="k_new must be"):
        paged_decode_attention(q, k, k, tables, lens, 0.25, rope=(kn[:, :1], kn, cos, cos))
    with pytest.raises(ValueError, match="cos must be"):
        paged_decode_attention(q, k, k, tables, lens, 0.25, rope=(kn, kn, cos[:, :8], cos))
    with pytest.raises(ValueError, match="rope must be the tuple"):
        paged_decode_attention(q, k, k, tables, lens, 0.25, rope=(kn, kn, cos))


def test_split_config_and_chunks():
    from spear.kernels.attention import MAX_SPLITS, split_chunk, split_config

    assert split_config(1, 32, 4096, 64) == 8        # 32 kv heads x 8 splits = 256 programs
    assert split_config(1, 8, 4096, 64) == 32        # GQA: more splits, capped
    assert split_config(1, 8, 200, 64) == 4          # the table's 4 tiles: one per split
    assert split_config(64, 32, 4096, 64) == 1       # enough programs without splitting
    assert split_config(1, 1, 10 ** 6, 64) == MAX_SPLITS
    # the policy's bounds: at most max_splits, until about target_programs programs
    assert split_config(1, 8, 4096, 64, max_splits=8) == 8 and split_config(1, 1, 10 ** 6, 64, max_splits=64) == 64
    assert split_config(1, 32, 4096, 64, target_programs=64) == 2 and split_config(1, 32, 4096, 64, 32, 1024) == 32
    assert split_config(64, 32, 4096, 64, target_programs=4096) == 2
    # a sequence's chunk follows its own context, not the table's width: 192 keys over 8 splits
    # are 3 splits of one 64-key tile (the table-wide chunk would have been 512 keys, one split)
    assert split_chunk(192, 8, 64, min_tiles=1) == 64
    assert split_chunk(192, 8, 64, min_tiles=2) == 128   # 2 splits: 128 + 64 keys
    assert split_chunk(4096, 8, 64, min_tiles=1) == 512
    assert split_chunk(0, 8, 64, min_tiles=1) == 64      # no keys: split 0 writes zeros
    for ctx, splits, n in ((1000, 4, 32), (17, 8, 16), (5000, 32, 64)):
        chunk = split_chunk(ctx, splits, n, min_tiles=1)
        assert chunk % n == 0 and splits * chunk >= ctx and -(-ctx // chunk) <= splits


def test_the_policys_split_bounds_reach_the_launch(poisoned):
    """max_splits, target_programs and min_split_tiles (KernelPolicy.attention_*) set the launch's
    context splits (the partials' workspace) and the keys per split; the output is the same."""
    # 6 rows, 2 kv heads, a table of 14 blocks of 8 keys: 7 tiles of 16
    q, kp, vp, k, v, tables, lens = make_batch((1, 7, 16, 17, 100), 8, 2, 16, 8, torch.float16, seed=8)
    ref = _reference(q, k, v, tables, lens, 0.25)
    for kw, splits in ((dict(), 4), (dict(max_splits=2), 2), (dict(target_programs=24), 2),
                       (dict(target_programs=12), 1), (dict(min_split_tiles=3), 4), (dict(max_splits=1), 1)):
        with allocations() as shapes:
            out = paged_decode_attention(q, kp, vp, tables, lens, 0.25, block_n=16, **kw)
        parts = [sh for sh in shapes if len(sh) == 5]
        assert [sh[2] for sh in parts] == ([splits] if splits > 1 else []), f"{kw}: workspaces {parts}"
        _check(out.cpu(), ref, torch.float16, f"splits by {kw}")
    with pytest.raises(ValueError, match="min_split_tiles must be >= 1; got 0"):
        paged_decode_attention(q, kp, vp, tables, lens, 0.25, min_split_tiles=0)


def test_int32_tables_and_clamped_context():
    """int32 block tables / lengths; a context length past the table's width is clamped to it."""
    q, kp, vp, k, v, tables, lens = make_batch((7, 16), 2, 2, 16, 8, torch.float32, seed=5, extra_blocks=0)
    lens_over = lens.clone()
    lens_over[1] = 1000  # the table has 3 columns of 8: keys 0..23 exist, the reference masks nothing else
    ref = _reference(q, v, v, tables, lens_over, 0.25)  # K = V: every slot of the table is finite there
    out = paged_decode_attention(q, v, v, tables.int(), lens_over.int(), 0.25, block_n=16)
    _check(out.cpu(), ref, torch.float32, "int32 tables, clamped context")


def test_launcher_errors():
    def call(**kw):
        args = dict(q=torch.zeros(2, 4, 16), k=torch.zeros(5, 8, 2, 16), v=None,
                    tables=torch.zeros(2, 3, dtype=torch.long), lens=torch.ones(2, dtype=torch.long))
        args.update(kw)
        args["v"] = args["k"] if args["v"] is None else args["v"]
        a = {n: (t.to(DEVICE) if torch.is_tensor(t) else t) for n, t in args.items()}
        return paged_decode_attention(a["q"], a["k"], a["v"], a["tables"], a["lens"], 0.25)

    with pytest.raises(ValueError, match="head_dim must be a power of two"):
        call(q=torch.zeros(2, 4, 24), k=torch.zeros(5, 8, 2, 24))
    with pytest.raises(ValueError, match="head_dim must be a power of two"):
        call(q=torch.zeros(2, 4, 8), k=torch.zeros(5, 8, 2, 8))
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        call(k=torch.zeros(5, 12, 2, 16))
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        call(q=torch.zeros(2, 3, 16))
    with pytest.raises(ValueError, match="head_dim 16, the caches 32"):
        call(k=torch.zeros(5, 8, 2, 32))
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        call(q=torch.zeros(2, 4, 16, dtype=torch.float64), k=torch.zeros(5, 8, 2, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match="caches must be in q's dtype"):
        call(k=torch.zeros(5, 8, 2, 16, dtype=torch.float16))
    with pytest.raises(ValueError, match="k_cache and v_cache"):
        call(v=torch.zeros(5, 8, 2, 32))
    with pytest.raises(ValueError, match="block_tables must be"):
        call(tables=torch.zeros(3, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="block_tables must be"):
        call(tables=torch.zeros(2, 3))
    with pytest.raises(ValueError, match="context_lens must be"):
        call(lens=torch.ones(2, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="unit stride along head_dim"):
        call(q=torch.zeros(2, 16, 4).transpose(1, 2))
    with pytest.raises(ValueError, match="q must be"):
        call(q=torch.zeros(2, 64))
    q = torch.zeros(2, 4, 16, device=DEVICE)
    k = torch.zeros(5, 8, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="splits must be a power of two"):
        paged_decode_attention(q, k, k, torch.zeros(2, 3, dtype=torch.long, device=DEVICE),
                               torch.ones(2, dtype=torch.long, device=DEVICE), 0.25, splits=3)


# Real shapes on the GPU: Llama-2-7B (MHA, head_dim 128), Llama-3-8B (GQA 4), a head_dim 64 model
GPU_SHAPES = [(32, 32, 128), (32, 8, 128), (16, 4, 64)]
GPU_CONTEXTS = (1, 7, 16, 17, 40, 63, 64, 65, 500, 1023, 2049, 4000)


@pytest.mark.gpu
@pytest.mark.parametrize("n_heads,kv_heads,head_dim", GPU_SHAPES)
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_gpu_real_shapes(poisoned, n_heads, kv_heads, head_dim, block_size, dtype):
    if DEVICE != "cuda":
        pytest.skip("needs CUDA")
    q, kp, vp, k, v, tables, lens = make_batch(GPU_CONTEXTS, n_heads, kv_heads, head_dim, block_size, dtype,
                                               seed=head_dim + block_size)
    scale = head_dim ** -0.5
    ref = _reference(q, k, v, tables, lens, scale)
    what = f"H={n_heads}/{kv_heads} d={head_dim} bs={block_size} {dtype}"
    outs = [paged_decode_attention(q, kp, vp, tables, lens, scale) for _ in range(2)]
    _check(outs[0].cpu(), ref, dtype, what)
    assert torch.equal(outs[0], outs[1]), f"{what}: not deterministic"


@pytest.mark.gpu
def test_gpu_cuda_graph_replay():
    """Captured once over static buffers; new tables and lengths in the same buffers on replay."""
    if DEVICE != "cuda":
        pytest.skip("needs CUDA")
    dtype, scale = torch.float16, 128 ** -0.5
    q, kp, vp, k, v, tables, lens = make_batch((5, 300, 33, 1024), 32, 8, 128, 16, dtype, seed=0, extra_blocks=64)
    q2 = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q)
    tables2 = tables[torch.tensor([3, 2, 4, 0, 1])]  # other rows' blocks: same finite slots, other lengths
    lens2 = lens[torch.tensor([3, 2, 4, 0, 1])]
    s_q, s_t, s_l = q.clone(), tables.clone(), lens.clone()
    paged_decode_attention(s_q, kp, vp, s_t, s_l, scale)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        s_o = paged_decode_attention(s_q, kp, vp, s_t, s_l, scale)
    for qq, tt, ll in ((q, tables, lens), (q2, tables2, lens2)):
        s_q.copy_(qq)
        s_t.copy_(tt)
        s_l.copy_(ll)
        graph.replay()
        _check(s_o.cpu(), _reference(qq, k, v, tt, ll, scale), dtype, "graph replay")


@pytest.mark.gpu
@pytest.mark.parametrize("n_heads,kv_heads,head_dim", GPU_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_rope_in_attention(poisoned, n_heads, kv_heads, head_dim, dtype):
    if DEVICE != "cuda":
        pytest.skip("needs CUDA")
    _rope_case(GPU_CONTEXTS, n_heads, kv_heads, head_dim, 16, dtype, seed=head_dim + n_heads)
