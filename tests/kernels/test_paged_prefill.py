"""Paged attention of mixed batches (spear.kernels.paged_prefill) against its torch reference and an
independent fp64 computation.

Each batch is a list of (chunk length, sequence length) pairs in one launch: 1-token decodes,
whole prompts (chunk = sequence), and later chunks of a chunked prefill (the chunk starts
mid-context), over contexts that cross cache blocks. The sequences' keys and values are drawn as
dense tensors first, then scattered into the cache over blocks handed out in a random order; every
cache slot that holds no token is NaN, so a key the kernel loads without need shows up. The fp64
truth is per-sequence SDPA on those dense tensors with an explicit causal mask: it never reads the
cache or the block tables. Rows past query_start_loc[B] are padding and must come out as zeros; the
output buffer starts as NaN (``poisoned``), so an unwritten row fails.

On the CPU these run through TRITON_INTERPRET=1 at small shapes (conftest.py); the tests marked
``gpu`` repeat them at Llama-3-8B's shape, and inside a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from spear.kernels.paged_prefill import paged_prefill_attention, supports
from spear.kernels.reference import prefill_attention as paged_prefill_attention_reference
from tests.kernels._helpers import DEVICE, SQNR_FLOOR, TOL, sqnr_db

# fp32 reference vs a kernel in fp32 (exp2 with the scale folded, another summation order)
TOLS = {**TOL, torch.float32: 1e-5}
FLOORS = {**SQNR_FLOOR, torch.float32: 100.0}

# decodes at contexts 1, 9 and 40; a whole 3-token prompt; a second chunk of 17 from position 22
# (crossing blocks of 8 and 16); a chunk of 5 starting on a block boundary (position 16)
MIXED = [(1, 9), (3, 3), (1, 40), (17, 39), (1, 1), (5, 21)]
# a 255-token chunk mid-context beside decodes and a whole 17-token prompt
LONG = [(1, 30), (255, 280), (17, 17), (1, 3)]


@dataclass
class Batch:
    q: torch.Tensor            # (T, n_heads, head_dim), possibly a strided view
    k_cache: torch.Tensor      # NaN wherever no token sits
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    keys: list                 # per sequence (seq_len, n_kv_heads, head_dim), the values scattered into the cache
    values: list
    n_valid: int               # query_start_loc[B]: rows from here on are padding


def make_batch(chunks, n_heads, kv_heads, head_dim, block_size, dtype, seed, *, pad_rows=3,
               table_dtype=torch.int32, q_layout="contiguous", device=DEVICE) -> Batch:
    """``chunks``: (queries, keys) per sequence. ``table_dtype`` "int64-colmajor": an int64 table
    stored column-major (stride (1, B)). q_layout "qkv": q is the column slice of a fused
    (T, (n_heads + 2 n_kv_heads) head_dim) projection; "heads": every other head_dim slice of a
    (T, n_heads, 2 head_dim) tensor (head stride 2 head_dim, row offset head_dim)."""
    g = torch.Generator().manual_seed(seed)
    ns, lens = [n for n, _ in chunks], [c for _, c in chunks]
    need = [-(-c // block_size) for c in lens]
    max_blocks = max(need, default=0) + 1  # one more column than any row needs: every table is padded
    num_blocks = sum(need) + 3
    scratch = num_blocks - 1               # padding entries of the tables point here (all NaN)
    perm = torch.randperm(num_blocks - 1, generator=g).tolist()
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    tables, keys, values = [], [], []
    for c, nb in zip(lens, need):
        row = [perm.pop() for _ in range(nb)]
        k = torch.randn(c, kv_heads, head_dim, generator=g).to(dtype).float()
        v = torch.randn(c, kv_heads, head_dim, generator=g).to(dtype).float()
        pos = torch.arange(c)
        blocks = torch.tensor(row, dtype=torch.long)[pos // block_size]
        k_cache[blocks, pos % block_size] = k
        v_cache[blocks, pos % block_size] = v
        tables.append(row + [scratch] * (max_blocks - nb))
        keys.append(k)
        values.append(v)
    n_valid = sum(ns)
    t = n_valid + pad_rows
    if q_layout == "contiguous":
        q = torch.randn(t, n_heads, head_dim, generator=g).to(dtype).to(device)
    elif q_layout == "qkv":
        qkv = torch.randn(t, (n_heads + 2 * kv_heads) * head_dim, generator=g).to(dtype).to(device)
        q = qkv[:, :n_heads * head_dim].view(t, n_heads, head_dim)
    else:
        q = torch.randn(t, n_heads, 2 * head_dim, generator=g).to(dtype).to(device)[:, :, head_dim:]
    qsl = torch.tensor([0] + torch.tensor(ns).cumsum(0).tolist() if ns else [0], dtype=torch.int32, device=device)
    if table_dtype == "int64-colmajor":
        table = torch.tensor(tables, dtype=torch.int64).reshape(len(chunks), max_blocks).t().contiguous().t()
    else:
        table = torch.tensor(tables, dtype=table_dtype).reshape(len(chunks), max_blocks)
    return Batch(q, k_cache.to(dtype).to(device), v_cache.to(dtype).to(device), table.to(device), qsl,
                 torch.tensor(lens, dtype=torch.int32, device=device), keys, values, n_valid)


def truth_fp64(batch: Batch, scale: float) -> torch.Tensor:
    """The valid rows' attention in fp64: per sequence, SDPA of its queries over its dense keys with
    an explicit mask (query i of an n-token chunk sees keys 0 .. seq_len - n + i)."""
    q = batch.q.double()
    n_heads, head_dim = q.shape[1:]
    out = torch.zeros(batch.n_valid, n_heads * head_dim, dtype=torch.float64, device=q.device)
    starts = batch.query_start_loc.tolist()
    for b, (k, v) in enumerate(zip(batch.keys, batch.values)):
        lo, hi = starts[b], starts[b + 1]
        if hi == lo:
            continue
        qpos = k.shape[0] - (hi - lo) + torch.arange(hi - lo)
        mask = (torch.arange(k.shape[0])[None, :] <= qpos[:, None]).to(q.device)
        k, v = (x.to(q.device, torch.float64).transpose(0, 1)[None] for x in (k, v))
        o = F.scaled_dot_product_attention(q[lo:hi].transpose(0, 1)[None], k, v, attn_mask=mask, scale=scale,
                                           enable_gqa=k.shape[1] != n_heads)
        out[lo:hi] = o[0].transpose(0, 1).flatten(1)
    return out.cpu()


def reference(batch: Batch, scale: float) -> torch.Tensor:
    """The torch reference in fp32 on the (rounded) inputs the kernel reads."""
    return paged_prefill_attention_reference(batch.q.float(), batch.k_cache.float(), batch.v_cache.float(),
                                             batch.block_tables, batch.query_start_loc, batch.seq_lens, scale)


def _close(out, expect, dtype, what):
    err = float((out.double() - expect.double()).abs().max() / expect.double().abs().max())
    s = sqnr_db(expect, out)
    assert err <= TOLS[dtype] and s >= FLOORS[dtype], (
        f"{what}: max error {err:.2e} (tol {TOLS[dtype]:.0e}), SQNR {s:.1f} dB (floor {FLOORS[dtype]} dB)")


def check(out: torch.Tensor, batch: Batch, scale: float, dtype: torch.dtype, what: str, ref=None) -> None:
    t, n_heads, head_dim = batch.q.shape
    assert out.shape == (t, n_heads * head_dim) and out.dtype == dtype, f"{what}: {tuple(out.shape)} {out.dtype}"
    out = out.cpu()
    assert torch.isfinite(out).all(), f"{what}: non-finite values (an unwritten row or a NaN slot read)"
    assert (out[batch.n_valid:] == 0).all(), f"{what}: padding rows are not zero"
    ref = reference(batch, scale).cpu() if ref is None else ref
    assert (ref[batch.n_valid:] == 0).all(), f"{what}: the reference's padding rows are not zero"
    _close(out[:batch.n_valid], ref[:batch.n_valid], dtype, what + " vs reference")
    _close(out[:batch.n_valid], truth_fp64(batch, scale), dtype, what + " vs fp64 truth")


@pytest.fixture(params=["forward", "reversed"])
def grid_order(request, monkeypatch):
    """The interpreter runs a launch's programs one after another in grid order; "reversed" runs
    them last to first, so a program that relied on another having run first fails."""
    if request.param == "reversed":
        if DEVICE == "cuda":
            pytest.skip("the interpreter's program order")
        from triton.runtime import interpreter

        builder = type(interpreter.interpreter_builder)
        forward = builder.set_grid_idx

        def reversed_idx(self, x, y, z):
            gx, gy, gz = self.grid_dim
            forward(self, gx - 1 - x, gy - 1 - y, gz - 1 - z)

        monkeypatch.setattr(builder, "set_grid_idx", reversed_idx)
    return request.param


# (chunks, block_size, GQA group, head_dim, dtype, table dtype, q layout, rows per tile, keys per tile):
# key tiles over two blocks (8 / 16, 16 / 32), four and eight (the default 64 keys over blocks of 16
# and 8), half a block (32 / 16); query tiles of 16 queries (group 1 in 16 rows), 4 (group 4 in 16),
# 5 with a spare row (group 3: the default model's 9 heads over 3 kv heads), 32 (the default 64 rows
# over group 2), 16 (64 over group 4) and 32 (group 1 in 32)
CASES = [
    (MIXED, 8, 1, 32, torch.float32, torch.int32, "contiguous", 16, 16),
    (MIXED, 16, 2, 32, torch.float16, "int64-colmajor", "qkv", None, None),
    (MIXED, 8, 4, 64, torch.bfloat16, torch.int32, "heads", 16, 16),
    (MIXED, 16, 3, 64, torch.float16, torch.int32, "qkv", 16, 32),
    (LONG, 16, 4, 32, torch.float16, torch.int32, "qkv", 64, 32),
    (LONG, 8, 2, 64, torch.float32, torch.int64, "contiguous", None, None),
    (LONG, 32, 1, 32, torch.bfloat16, torch.int64, "heads", 32, 16),
]


@pytest.mark.parametrize("chunks,block_size,group,head_dim,dtype,table_dtype,q_layout,block_m,block_n", CASES)
def test_mixed_batch(poisoned, chunks, block_size, group, head_dim, dtype, table_dtype, q_layout, block_m, block_n):
    kv_heads = 2
    batch = make_batch(chunks, kv_heads * group, kv_heads, head_dim, block_size, dtype,
                       seed=block_size + 10 * group + head_dim + len(chunks), table_dtype=table_dtype,
                       q_layout=q_layout)
    scale = head_dim ** -0.5
    out = paged_prefill_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.query_start_loc,
                                  batch.seq_lens, scale, block_m=block_m, block_n=block_n)
    what = (f"{len(chunks)} chunks bs={block_size} gqa={group} d={head_dim} {dtype} {table_dtype} {q_layout} "
            f"tile={block_m}x{block_n}")
    check(out, batch, scale, dtype, what)


@pytest.mark.parametrize("group,dtype", [(2, torch.float16), (4, torch.float32)])
def test_program_order_and_tile_shapes(poisoned, grid_order, group, dtype):
    """Each tile's sequence comes from its own search, in either program order; the query tile's
    size (16 rows or the default 64) changes the grid, not the result, and so does no
    ``max_query_len`` hint."""
    batch = make_batch(MIXED, 2 * group, 2, 32, 8, dtype, seed=group, pad_rows=5)
    scale = 32 ** -0.5
    ref = reference(batch, scale).cpu()
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens, scale)
    for hint, block_m in ((None, None), (1, 16)):
        out = paged_prefill_attention(*args, max_query_len=hint, block_m=block_m, block_n=16)
        check(out, batch, scale, dtype, f"gqa={group} {dtype} {grid_order} max_query_len={hint} block_m={block_m}",
              ref=ref)


def test_empty_sequences_and_padding(poisoned):
    """Sequences with no queries (as a batch padded to a captured size has), one with no keys yet,
    a batch of padding rows only, and no rows at all."""
    chunks = [(0, 0), (2, 10), (0, 5), (1, 17), (0, 0)]
    batch = make_batch(chunks, 4, 2, 16, 8, torch.float16, seed=3, pad_rows=20)
    out = paged_prefill_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.query_start_loc,
                                  batch.seq_lens, 0.25)
    check(out, batch, 0.25, torch.float16, "empty sequences")
    # every row padding: a batch whose sequences have no queries, and a batch of no sequences
    for chunks in ([(0, 4), (0, 0)], []):
        batch = make_batch(chunks, 4, 2, 16, 8, torch.float16, seed=4, pad_rows=37)
        out = paged_prefill_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
                                      batch.query_start_loc, batch.seq_lens, 0.25, block_m=16, block_n=16)
        assert out.shape == (37, 64) and (out.cpu() == 0).all(), f"{len(chunks)} sequences: padding rows not zero"
    q = torch.zeros(0, 4, 16, dtype=torch.float16, device=DEVICE)
    out = paged_prefill_attention(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.query_start_loc,
                                  batch.seq_lens, 0.25)
    assert out.shape == (0, 64)


def test_supports_and_errors():
    def args(**kw):
        a = dict(q=torch.zeros(5, 4, 16), k=torch.zeros(6, 8, 2, 16), v=None,
                 tables=torch.zeros(2, 3, dtype=torch.int32), qsl=torch.tensor([0, 2, 5], dtype=torch.int32),
                 lens=torch.tensor([4, 9], dtype=torch.int32))
        a.update(kw)
        a["v"] = a["k"] if a["v"] is None else a["v"]
        return {n: (t.to(DEVICE) if torch.is_tensor(t) else t) for n, t in a.items()}

    def call(max_query_len=None, block_m=None, block_n=None, **kw):
        a = args(**kw)
        return paged_prefill_attention(a["q"], a["k"], a["v"], a["tables"], a["qsl"], a["lens"], 0.25,
                                       max_query_len=max_query_len, block_m=block_m, block_n=block_n)

    good = args()
    assert supports(good["q"], good["k"])
    for q, k in ((torch.zeros(5, 4, 24), torch.zeros(6, 8, 2, 24)), (torch.zeros(5, 4, 8), torch.zeros(6, 8, 2, 8)),
                 (torch.zeros(5, 4, 16), torch.zeros(6, 12, 2, 16)), (torch.zeros(5, 3, 16), torch.zeros(6, 8, 2, 16)),
                 (torch.zeros(5, 4, 16, dtype=torch.float64), torch.zeros(6, 8, 2, 16, dtype=torch.float64)),
                 (torch.zeros(5, 4, 16), torch.zeros(6, 8, 2, 16, dtype=torch.float16))):
        assert not supports(q, k), f"supports() accepted q {tuple(q.shape)} {q.dtype}, cache {tuple(k.shape)}"
    cases = [
        (dict(q=torch.zeros(5, 4, 24), k=torch.zeros(6, 8, 2, 24)), "head_dim must be a power of two"),
        (dict(q=torch.zeros(5, 4, 512), k=torch.zeros(6, 8, 2, 512)), "head_dim must be a power of two"),
        (dict(k=torch.zeros(6, 12, 2, 16)), "block_size must be a power of two"),
        (dict(q=torch.zeros(5, 3, 16)), "multiple of n_kv_heads"),
        (dict(k=torch.zeros(6, 8, 2, 32)), "head_dim 16, the caches 32"),
        (dict(q=torch.zeros(5, 4, 16, dtype=torch.float64), k=torch.zeros(6, 8, 2, 16, dtype=torch.float64)),
         "float16, bfloat16 or float32"),
        (dict(k=torch.zeros(6, 8, 2, 16, dtype=torch.float16)), "caches must be in q's dtype"),
        (dict(v=torch.zeros(6, 8, 2, 32)), "k_cache and v_cache"),
        (dict(q=torch.zeros(5, 64)), "q must be"),
        (dict(q=torch.zeros(5, 16, 4).transpose(1, 2)), "unit stride along head_dim"),
        (dict(k=torch.zeros(6, 8, 16, 2).transpose(2, 3)), "unit stride along head_dim"),
        (dict(tables=torch.zeros(3, 3, dtype=torch.int32)), "block_tables must be"),
        (dict(tables=torch.zeros(2, 3)), "block_tables must be"),
        (dict(tables=torch.zeros(2, 0, dtype=torch.int32)), "at least one column"),
        (dict(qsl=torch.tensor([0, 5], dtype=torch.int32)), "query_start_loc must be"),
        (dict(qsl=torch.tensor([0.0, 2.0, 5.0])), "query_start_loc must be"),
        (dict(lens=torch.tensor([[4, 9]], dtype=torch.int32)), "seq_lens must be"),
        (dict(lens=torch.tensor([4.0, 9.0])), "seq_lens must be"),
        (dict(max_query_len=0), "max_query_len must be"),
        (dict(max_query_len=2.0), "max_query_len must be"),
        (dict(block_m=8), "block_m must be"),
        (dict(block_m=24), "block_m must be"),
        (dict(q=torch.zeros(5, 64, 16), block_m=16), "block_m must be"),
        (dict(block_n=8), "block_n must be"),
    ]
    for kw, match in cases:
        with pytest.raises(ValueError, match=match):
            call(**kw)
    if DEVICE == "cuda":
        with pytest.raises(ValueError, match="one device"):
            a = args()
            paged_prefill_attention(a["q"], a["k"], a["v"], a["tables"].cpu(), a["qsl"], a["lens"], 0.25)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(12))
def test_random_batches_sweep(poisoned, seed):
    """Random mixes of decodes, whole prompts and later chunks over random shapes and tiles."""
    g = torch.Generator().manual_seed(1000 + seed)
    pick = lambda xs: xs[int(torch.randint(len(xs), (1,), generator=g))]  # noqa: E731
    chunks = []
    for _ in range(int(torch.randint(1, 9, (1,), generator=g))):
        n = pick([0, 1, 1, 1, 2, 3, 16, 17, 33, 64, 100, 255])
        chunks.append((n, n + pick([0, 0, 1, 7, 16, 40, 129])))
    group, head_dim, block_size = pick([1, 2, 3, 4, 8]), pick([16, 32, 64, 128]), pick([1, 4, 8, 16, 32, 64])
    dtype = pick([torch.float16, torch.bfloat16, torch.float32])
    block_m = pick([None, 16 if group <= 16 else None, 32 if group <= 32 else None])
    block_n = pick([None, 16, 32])
    batch = make_batch(chunks, 2 * group, 2, head_dim, block_size, dtype, seed=seed, pad_rows=pick([0, 1, 9]),
                       table_dtype=pick([torch.int32, torch.int64, "int64-colmajor"]),
                       q_layout=pick(["contiguous", "qkv", "heads"]))
    scale = head_dim ** -0.5
    out = paged_prefill_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.query_start_loc,
                                  batch.seq_lens, scale, max_query_len=pick([None, 1, 64]), block_m=block_m,
                                  block_n=block_n)
    check(out, batch, scale, dtype, f"seed {seed}: {chunks} bs={block_size} gqa={group} d={head_dim} {dtype}")


def _llama3_step(seed, decodes=20, device=DEVICE):
    """A mixed step at Llama-3-8B's attention shape: a whole 512-token prompt, a second 512-token
    chunk from position 1024, a 492-token chunk from 1,608, and 1-3k-context decodes."""
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(1000, 3001, (decodes,), generator=g).tolist()
    chunks = [(512, 512), (1, ctx[0]), (512, 1536)] + [(1, c) for c in ctx[1:]] + [(492, 2100)]
    return chunks


GPU_SHAPES = [(32, 8, 128), (32, 32, 128), (9, 3, 64)]  # Llama-3-8B, Llama-2-7B, the default model


@pytest.mark.gpu
@pytest.mark.parametrize("n_heads,kv_heads,head_dim", GPU_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_gpu_mixed_step_real_shapes(poisoned, n_heads, kv_heads, head_dim, dtype):
    if DEVICE != "cuda":
        pytest.skip("needs CUDA")
    batch = make_batch(_llama3_step(head_dim), n_heads, kv_heads, head_dim, 16, dtype, seed=n_heads, pad_rows=40,
                       q_layout="qkv")
    scale = head_dim ** -0.5
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens, scale)
    what = f"H={n_heads}/{kv_heads} d={head_dim} {dtype}"
    ref = reference(batch, scale).cpu()
    outs = [paged_prefill_attention(*args) for _ in range(2)]
    check(outs[0], batch, scale, dtype, what, ref=ref)
    assert torch.equal(outs[0], outs[1]), f"{what}: not deterministic"
    check(paged_prefill_attention(*args, max_query_len=512), batch, scale, dtype, what + " max_query_len=512", ref=ref)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay():
    """Captured once over static buffers of a padded token count; other chunk lengths, contexts and
    tables in the same buffers on replay."""
    if DEVICE != "cuda":
        pytest.skip("needs CUDA")
    dtype, scale, t = torch.float16, 128 ** -0.5, 2048
    steps = [_llama3_step(1), [(1, 700), (300, 300), (1, 2900), (250, 1250)] + [(1, 1500)] * 19,
             [(1, 100 + 97 * i) for i in range(23)]]
    batches = [make_batch(c, 32, 8, 128, 16, dtype, seed=i, pad_rows=t - sum(n for n, _ in c))
               for i, c in enumerate(steps)]
    width = max(b.block_tables.shape[1] for b in batches)
    blocks = max(b.k_cache.shape[0] for b in batches)
    s_q = torch.zeros_like(batches[0].q)
    s_k = torch.zeros(blocks, 16, 8, 128, dtype=dtype, device="cuda")
    s_v = torch.zeros_like(s_k)
    s_t = torch.zeros(23, width, dtype=torch.int32, device="cuda")
    s_qsl = torch.zeros(24, dtype=torch.int32, device="cuda")
    s_len = torch.zeros(23, dtype=torch.int32, device="cuda")

    def run():
        return paged_prefill_attention(s_q, s_k, s_v, s_t, s_qsl, s_len, scale)

    run()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        s_o = run()
    for i, batch in enumerate(batches):
        assert batch.block_tables.shape[0] == 23
        s_q.copy_(batch.q)
        s_k.zero_()
        s_v.zero_()
        s_k[:batch.k_cache.shape[0]].copy_(batch.k_cache)
        s_v[:batch.v_cache.shape[0]].copy_(batch.v_cache)
        s_t.zero_()
        s_t[:, :batch.block_tables.shape[1]].copy_(batch.block_tables)
        s_qsl.copy_(batch.query_start_loc)
        s_len.copy_(batch.seq_lens)
        graph.replay()
        check(s_o.clone(), batch, scale, dtype, f"graph replay {i}")
