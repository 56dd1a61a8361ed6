"""A persistent, warp-specialized W4A16 GEMM for Hopper (sm_90), written in Gluon, over the
fragment layout (``Layout.FRAGMENT``).

    out (M, N) = x (M, K) · W_hatᵀ (+ bias) (+ alpha · v Bᵀ), optionally silu(gate) * up over
    (gate, up) pairs

Why Gluon: the weight is the wgmma's register operand (accT [BN, BM] += W[BN, 64] · xT[64, BM],
tokens on the MMA's N), and Triton's automatic warp specialization does not take a
register-operand wgmma; Gluon lets the kernel name its partitions, layouts and barriers.

Partitions of each program (one program per SM, ``persistent``):
  * a producer warp streams every K step's operands into a ring of STAGES shared-memory stages
    with TMA: the activations [BM, 64] per 64-input block, the packed codes of the program's
    NCONS · BNC output rows (the fragment layout's words, [NCONS · BNC / 16, 128] per block),
    and per group the scales (and zero points) of those rows, so that the scales travel with the
    codes; one mbarrier per stage says "full", one "empty";
  * NCONS = 2 consumer warpgroups, BNC rows each, share the stage (the activations are read once
    per NCONS · BNC outputs). Each loads its words from shared memory (a lane's 16 bytes are
    exactly its fragments), turns codes into fp16/bf16 in registers (one LOP3 per pair:
    ``_fragment._convert_ptx``), issues async register-A wgmmas against the activations in shared
    memory and, once they are done, frees the stage. The two warpgroups run out of phase, so one
    converts while the other's MMAs run.

Work units are (output tile, K split) pairs, taken in turn by the programs; with a K split > 1,
each unit stores its fp32 partial and bumps the tile's counter in ``locks``; the unit that
arrives last sums the partials, runs the epilogue (per-channel scales, bias, the compensator's
alpha · v Bᵀ as one more wgmma, SiLU·mul, the cast)
and sets the counter back to zero, so ``locks`` stays zero between calls and CUDA-graph replays.
Gluon does not run under Triton's interpreter: ``planner.target`` says where this kernel may run,
and the Triton kernels (w4a16.py) are the path everywhere else. The conversion of fragment words,
the block's scales and the compensator's wgmma are in gluon_fragment.py.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from spear.kernels.launch import (GLUON_SMEM_LIMIT, GluonConfig, fit_gluon, gluon_smem,  # noqa: F401
                                  pick_split)  # (the launch shapes live there)
from spear.kernels.layout import LOCK_SLOTS, Layout, PackedEC, PackedW4

try:  # Gluon ships inside Triton 3.5+; absent or partial elsewhere
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_init,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    HAVE_GLUON = True
except Exception:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False

NCONS = 2                 # consumer warpgroups per program
CONSUMER_REGS = 232       # registers per thread of a consumer warpgroup (setmaxnreg)
PRODUCER_REGS = 40        # of the producer warp's warpgroup
MAX_REGS = 168            # the kernel's register cap: 3 warpgroups x 128 threads x 168 = 64,512


# ----------------------------------------------------------------------------- the schedule
def k_steps(k: int, bk: int) -> int:
    return -(-k // bk)


def split_range(split: int, steps: int, n_split: int) -> tuple[int, int]:
    """The K steps [lo, hi) of split ``split`` of ``n_split`` over ``steps`` steps (what the kernel
    computes): equal ranges of ceil(steps / n_split), the last ones shorter or empty."""
    per = -(-steps // n_split)
    lo = min(split * per, steps)
    return lo, min(lo + per, steps)


def units(m: int, n: int, cfg: GluonConfig) -> tuple[int, int, int]:
    """(m tiles, n tiles, work units) of an (m, n) output under ``cfg``."""
    mt, nt = -(-m // cfg.BM), -(-n // cfg.BN)
    return mt, nt, mt * nt * cfg.split_k


def unit_of(u: int, m_tiles: int, split_k: int) -> tuple[int, int, int]:
    """Work unit ``u`` -> (m tile, n tile, K split): the splits of a tile are consecutive units,
    and the tiles of one n tile (one weight slab) are consecutive tiles."""
    tile, split = divmod(u, split_k)
    n_tile, m_tile = divmod(tile, m_tiles)
    return m_tile, n_tile, split


if HAVE_GLUON:
    from spear.kernels.gluon_fragment import _a_tile, _barrier, _block_params, _ec_epilogue, _pair16, _plain

    # the TMA load ``async_load`` (``async_copy_global_to_shared`` before)
    _tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
    _CONSUMER_REGS = gl.constexpr(CONSUMER_REGS)
    _PRODUCER_REGS = gl.constexpr(PRODUCER_REGS)

    @gluon.jit
    def _producer(x_desc, w_desc, s_desc, z_desc, x_bufs, w_bufs, s_bufs, z_bufs, ready, empty,
                  M, m_tiles, n_units, steps, split_k,
                  BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                  GROUP: gl.constexpr, SYMMETRIC: gl.constexpr):
        KB: gl.constexpr = BK // 64
        T_ALL: gl.constexpr = BN // 16
        GS: gl.constexpr = (BK + GROUP - 1) // GROUP if GROUP > 0 else 1
        # the activations come in boxes of XR tokens: those wholly past the last token are not loaded
        # (a box past the tensor's end costs more than one within it: gate_up at 144 tokens on BM 256
        # took 123 us against 102 us with the rows there; H100, 2026-12-07). Their stale rows only
        # reach output columns (tokens) that are never stored: tokens are the MMA's N.
        XR: gl.constexpr = 64 if BM > 64 else BM
        XB: gl.constexpr = BM // XR
        # the bytes each stage's TMA copies bring (whole boxes, out-of-bounds parts included)
        NBYTES_W: gl.constexpr = (T_ALL * 128 * KB * 4 + (GS * BN * 2 if GROUP > 0 else 0)
                                  + (GS * BN if GROUP > 0 and not SYMMETRIC else 0))
        XBYTES: gl.constexpr = KB * XR * 64 * 2
        per = gl.cdiv(steps, split_k)
        it = 0
        for u in range(gl.program_id(0), n_units, gl.num_programs(0)):
            tile = u // split_k
            split = u % split_k
            m0 = (tile % m_tiles) * BM
            n0 = (tile // m_tiles) * BN
            nx = gl.minimum(gl.cdiv(M - m0, XR), XB)  # boxes holding tokens
            lo = gl.minimum(split * per, steps)
            hi = gl.minimum(lo + per, steps)
            for ks in range(lo, hi):
                idx = it % STAGES
                mbarrier.wait(empty.index(idx), ((it // STAGES) & 1) ^ 1)
                bar = ready.index(idx)
                for r in gl.static_range(1, XB + 1):  # the byte count is a constant: one expect fires
                    mbarrier.expect(bar, NBYTES_W + r * XBYTES, pred=nx == r)
                k = ks * BK
                for kb in gl.static_range(KB):
                    for r in gl.static_range(XB):
                        _tma_load(x_desc, [m0 + r * XR, k + 64 * kb], bar,
                                  x_bufs.index(idx * KB + kb).slice(r * XR, XR), pred=r < nx)
                _tma_load(w_desc, [n0 // 16, 2 * k], bar, w_bufs.index(idx))
                if GROUP > 0:
                    _tma_load(s_desc, [k // GROUP, n0], bar, s_bufs.index(idx))
                    if not SYMMETRIC:
                        _tma_load(z_desc, [k // GROUP, n0], bar, z_bufs.index(idx))
                it += 1

    @gluon.jit
    def _consumer(x_bufs, w_bufs, s_bufs, z_bufs, ready, empty, scales_ptr, zeros_ptr, bias_ptr, out_ptr, part_ptr,
                  locks_ptr, b_ptr, v_ptr, alpha, M, N, stride_om, m_tiles, n_units, steps, split_k,
                  CID: gl.constexpr, BNC: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                  GROUP: gl.constexpr, SYMMETRIC: gl.constexpr, HAS_BIAS: gl.constexpr, ACT: gl.constexpr,
                  R: gl.constexpr):
        IS_BF16: gl.constexpr = x_bufs.dtype == gl.bfloat16
        KB: gl.constexpr = BK // 64
        T: gl.constexpr = BNC // 16
        BN: gl.constexpr = 2 * BNC
        GROUPED: gl.constexpr = GROUP > 0
        # the accumulator, the register-A operand, the words [T, 8 (g), 4 (q), 4 (c)] as a lane loads
        # them (lane 4g + q, its four k16 chunks in one 16-byte load) and their rows g [T, 8]
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BM, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        words_layout: gl.constexpr = gl.BlockedLayout([1, 1, 1, 4], [1, 8, 4, 1], [4, 1, 1, 1], [3, 2, 1, 0])
        rows_layout: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, words_layout))
        c_layout: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, words_layout)))
        flat_layout: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0])
        if IS_BF16:
            base = 128.0
            dtype: gl.constexpr = gl.bfloat16
        else:
            base = 1024.0
            dtype: gl.constexpr = gl.float16
        row0: gl.constexpr = CID * BNC
        if R > 0:  # v [BM, R] of a tile, the compensator's wgmma operand
            v_smem = gl.allocate_shared_memory(dtype, [BM, R], gl.NVMMASharedLayout.get_default_for([BM, R], dtype))
        else:
            v_smem = x_bufs.index(0)  # never read
        GS: gl.constexpr = (BK + GROUP - 1) // GROUP if GROUP > 0 else 1
        s_plain = _plain(s_bufs, gl.float16, STAGES, GS, BN)
        z_plain = _plain(z_bufs, gl.uint8, STAGES, GS, BN)
        per = gl.cdiv(steps, split_k)
        offs_r = gl.arange(0, BNC, gl.SliceLayout(1, acc_layout))
        offs_c = gl.arange(0, BM, gl.SliceLayout(0, acc_layout))
        t_ids = gl.arange(0, T, gl.SliceLayout(1, rows_layout))
        g_ids = gl.arange(0, 8, gl.SliceLayout(0, rows_layout))
        it = 0
        for u in range(gl.program_id(0), n_units, gl.num_programs(0)):
            tile = u // split_k
            split = u % split_k
            m0 = (tile % m_tiles) * BM
            n0 = (tile // m_tiles) * BN + row0
            lo = gl.minimum(split * per, steps)
            hi = gl.minimum(lo + per, steps)
            if not GROUPED:  # per channel: (c - z) here, the scale on the accumulator
                rlo = n0 + gl.expand_dims(t_ids, 1) * 16 + gl.expand_dims(g_ids, 0)
                if SYMMETRIC:
                    zc_lo = gl.full([T, 8], base + 8.0, gl.float32, rows_layout)
                    zc_hi = zc_lo
                else:
                    zc_lo = base + gl.load(zeros_ptr + rlo, mask=rlo < N, other=0).to(gl.float32)
                    zc_hi = base + gl.load(zeros_ptr + rlo + 8, mask=rlo + 8 < N, other=0).to(gl.float32)
                zlo_w = _pair16(gl.expand_dims(gl.expand_dims(zc_lo, 2), 3), IS_BF16)
                zhi_w = _pair16(gl.expand_dims(gl.expand_dims(zc_hi, 2), 3), IS_BF16)
            # (an in-flight accumulator from the start: the loop carries it with a wgmma outstanding)
            acc = warpgroup_mma_init(gl.zeros([BNC, BM], gl.float32, acc_layout))
            # software pipeline: block b's codes are converted while block b - 1's wgmma runs; the
            # wait that follows retires it (its register operand stays allocated until then) and,
            # at a stage's first block, frees the stage before (its last MMA has retired)
            prev_a = gl.zeros([BNC, 64], dtype, a_layout)
            prev_idx = 0
            for ks in range(lo, hi):
                idx = it % STAGES
                mbarrier.wait(ready.index(idx), (it // STAGES) & 1)
                w_stage = w_bufs.index(idx).slice(CID * T, T)
                for kb in gl.static_range(KB):
                    p = w_stage.slice(128 * kb, 128, dim=1).load(flat_layout)
                    p = gl.convert_layout(gl.reshape(p, [T, 8, 4, 4]), words_layout, assert_trivial=True)
                    if GROUPED:
                        s_lo, s_hi, zc_lo, zc_hi = _block_params(s_plain, z_plain, idx * GS, kb, row0 // 16,
                                                                 rows_layout, c_layout, base, T, GROUP, SYMMETRIC)
                        if IS_BF16:
                            a = _a_tile(p, _pair16(zc_lo, True), _pair16(zc_hi, True), s_lo, s_hi, a_layout, True,
                                        True, BNC)
                        else:
                            a = _a_tile(p, _pair16(zc_lo, False), _pair16(zc_hi, False), _pair16(s_lo, False),
                                        _pair16(s_hi, False), a_layout, False, True, BNC)
                    else:
                        a = _a_tile(p, zlo_w, zhi_w, zlo_w, zhi_w, a_layout, IS_BF16, False, BNC)
                    acc, prev_a = warpgroup_mma_wait(num_outstanding=0, deps=(acc, prev_a))
                    if kb == 0:
                        mbarrier.arrive(empty.index(prev_idx), count=1, pred=ks > lo)
                    acc = warpgroup_mma(a, x_bufs.index(idx * KB + kb).permute((1, 0)), acc, is_async=True)
                    prev_a = a
                prev_idx = idx
                it += 1
            acc, prev_a = warpgroup_mma_wait(num_outstanding=0, deps=(acc, prev_a))
            mbarrier.arrive(empty.index(prev_idx), count=1, pred=hi > lo)
            # ------------------------------------------------------------ split-K and the epilogue
            rows = n0 + offs_r
            cols = m0 + offs_c
            if split_k > 1:
                tile_ws = part_ptr + ((tile * 2 + CID) * split_k) * (BNC * BM)
                offs = gl.expand_dims(offs_r, 1) * BM + gl.expand_dims(offs_c, 0)
                gl.store(tile_ws + split * (BNC * BM) + offs, acc)
                _barrier()
                lock = locks_ptr + tile * 2 + CID
                arrived = gl.atomic_add(lock, 1, sem="acq_rel", scope="gpu")
                last = arrived == split_k - 1
                if last:
                    _barrier()
                    acc = gl.zeros([BNC, BM], gl.float32, acc_layout)
                    for s in range(split_k):
                        acc += gl.load(tile_ws + s * (BNC * BM) + offs, cache_modifier=".cg")
                    gl.store(lock, 0)
            else:
                last = True
            if last:
                r_ok = rows < N
                if not GROUPED:
                    acc = acc * gl.expand_dims(gl.load(scales_ptr + rows, mask=r_ok, other=0.0).to(gl.float32), 1)
                if HAS_BIAS:
                    acc = acc + gl.expand_dims(gl.load(bias_ptr + rows, mask=r_ok, other=0.0).to(gl.float32), 1)
                if R > 0:  # the compensator: acc += (alpha B)[rows] · v[cols]ᵀ, one more wgmma
                    acc = _ec_epilogue(acc, b_ptr, v_ptr, alpha, rows, r_ok, m0, M, v_smem, a_layout, dtype, BM, R)
                if ACT:
                    # rows 2i, 2i + 1 are (gate, up): silu(gate) * up, written to feature i of (M, N / 2)
                    pair_layout: gl.constexpr = gl.BlockedLayout([2, 1], [16, 2], [1, 4], [0, 1])
                    y = gl.convert_layout(acc, pair_layout)
                    gate, up = gl.split(gl.permute(gl.reshape(y, [BNC // 2, 2, BM]), (0, 2, 1)))
                    res = (gate / (1.0 + gl.exp(-gate)) * up).to(dtype)
                    half_layout: gl.constexpr = res.type.layout
                    hr = n0 // 2 + gl.arange(0, BNC // 2, gl.SliceLayout(1, half_layout))
                    hc = m0 + gl.arange(0, BM, gl.SliceLayout(0, half_layout))
                    gl.store(out_ptr + gl.expand_dims(hc, 0) * stride_om + gl.expand_dims(hr, 1), res,
                             mask=gl.expand_dims(hr < N // 2, 1) & gl.expand_dims(hc < M, 0))
                else:
                    store_layout: gl.constexpr = gl.BlockedLayout([8, 1], [16, 2], [1, 4], [0, 1])
                    y = gl.convert_layout(acc.to(dtype), store_layout)
                    sr = n0 + gl.arange(0, BNC, gl.SliceLayout(1, store_layout))
                    sc = m0 + gl.arange(0, BM, gl.SliceLayout(0, store_layout))
                    gl.store(out_ptr + gl.expand_dims(sc, 0) * stride_om + gl.expand_dims(sr, 1), y,
                             mask=gl.expand_dims(sr < N, 1) & gl.expand_dims(sc < M, 0))

    @gluon.jit
    def _w4_gluon_kernel(x_desc, w_desc, s_desc, z_desc, scales_ptr, zeros_ptr, bias_ptr, out_ptr, part_ptr,
                         locks_ptr, b_ptr, v_ptr, alpha, M, N, stride_om, m_tiles, n_units, steps, split_k,
                         BNC: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                         GROUP: gl.constexpr, SYMMETRIC: gl.constexpr, HAS_BIAS: gl.constexpr, ACT: gl.constexpr,
                         R: gl.constexpr):
        KB: gl.constexpr = BK // 64
        BN: gl.constexpr = 2 * BNC
        GS: gl.constexpr = (BK + GROUP - 1) // GROUP if GROUP > 0 else 1
        dtype: gl.constexpr = x_desc.dtype
        x_bufs = gl.allocate_shared_memory(dtype, [STAGES * KB, BM, 64], x_desc.layout)
        w_bufs = gl.allocate_shared_memory(gl.int32, [STAGES, BN // 16, 128 * KB], w_desc.layout)
        s_bufs = gl.allocate_shared_memory(gl.float16, [STAGES, GS, BN], s_desc.layout)
        z_bufs = gl.allocate_shared_memory(gl.uint8, [STAGES, GS, BN], z_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)
        fence_async_shared()
        C0: gl.constexpr = 0
        C1: gl.constexpr = 1
        gl.warp_specialize([
            (_consumer, (x_bufs, w_bufs, s_bufs, z_bufs, ready, empty, scales_ptr, zeros_ptr, bias_ptr, out_ptr,
                         part_ptr, locks_ptr, b_ptr, v_ptr, alpha, M, N, stride_om, m_tiles, n_units, steps, split_k,
                         C0, BNC, BM, BK, STAGES, GROUP, SYMMETRIC, HAS_BIAS, ACT, R)),
            (_consumer, (x_bufs, w_bufs, s_bufs, z_bufs, ready, empty, scales_ptr, zeros_ptr, bias_ptr, out_ptr,
                         part_ptr, locks_ptr, b_ptr, v_ptr, alpha, M, N, stride_om, m_tiles, n_units, steps, split_k,
                         C1, BNC, BM, BK, STAGES, GROUP, SYMMETRIC, HAS_BIAS, ACT, R)),
            (_producer, (x_desc, w_desc, s_desc, z_desc, x_bufs, w_bufs, s_bufs, z_bufs, ready, empty, M, m_tiles,
                         n_units, steps, split_k, BM, BN, BK, STAGES, GROUP, SYMMETRIC)),
        ], [4, 1], [_CONSUMER_REGS, _PRODUCER_REGS])


# ----------------------------------------------------------------------------- host side
@lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def check(x: torch.Tensor, w: PackedW4, cfg: GluonConfig, rank: int = 0) -> None:
    """Raise ValueError where the Gluon kernel cannot take (x, w) under ``cfg``."""
    if w.layout is not Layout.FRAGMENT:
        raise ValueError(f"the Gluon GEMM takes the fragment layout; got {w.layout.value}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (tokens, in_features); got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"x must be float16 or bfloat16; got {x.dtype}")
    if w.group_size and w.group_size < 32:
        raise ValueError(f"group size {w.group_size} is not supported")
    if gluon_smem(cfg, w.group_size, rank) > GLUON_SMEM_LIMIT:
        fitted = fit_gluon(cfg, w.group_size, rank)
        raise ValueError(f"{cfg} with a rank-{rank} compensator needs {gluon_smem(cfg, w.group_size, rank)} bytes of "
                         f"shared memory, more than {GLUON_SMEM_LIMIT}; "
                         + (f"{fitted.stages} stages fit" if fitted else "not even two stages fit"))


def _desc(t: torch.Tensor, block: list[int], layout):
    """A TMA descriptor of a 2-D tensor of unit column stride. torch may give a tensor of one row
    (the per-channel scales and zeros, one token's activations) any row stride, and TMA takes only
    multiples of 16 bytes, so such a tensor gets its row length as its row stride."""
    return TensorDescriptor(t, list(t.shape), [t.stride(0) if t.shape[0] > 1 else t.shape[1], 1], block, layout)


def gluon_w4a16(x: torch.Tensor, w: PackedW4, bias: torch.Tensor | None, cfg: GluonConfig,
                act: int = 0, ec: PackedEC | None = None, v: torch.Tensor | None = None) -> torch.Tensor:
    """``x W_hatᵀ (+ bias) (+ alpha · v Bᵀ)``, or SiLU·mul of its (gate, up) pairs (``act`` 1), with the
    Gluon kernel. ``ec`` and ``v``: the compensator's B and alpha, and v = gamma(u) ⊙ u (M, R) from
    ``ec.ec_gate``; the epilogue adds alpha · v Bᵀ (alpha B rounded once to the activation dtype)."""
    check(x, w, cfg, ec.b.shape[1] if ec is not None else 0)
    if (ec is None) != (v is None):
        raise ValueError("the compensator's epilogue needs both ec (for B and alpha) and v")
    if ec is not None and (v.shape != (x.shape[0], ec.b.shape[1]) or v.dtype != x.dtype or not v.is_contiguous()
                           or ec.b.shape[0] != w.out_features or ec.b.dtype != x.dtype):
        raise ValueError(f"v must be ({x.shape[0]}, {ec.b.shape[1]}) {x.dtype}, contiguous, and B "
                         f"({w.out_features}, R) in that dtype; got v {tuple(v.shape)} {v.dtype}, B "
                         f"{tuple(ec.b.shape)} {ec.b.dtype}")
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:  # TMA: 16-byte aligned rows
        x = x.clone(memory_format=torch.contiguous_format)
    m, k = x.shape
    n = w.out_features
    if k != w.in_features:
        raise ValueError(f"x has {k} features, the packed weight expects in_features={w.in_features}")
    out = torch.empty((m, n // 2 if act else n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    m_tiles, n_tiles, n_units = units(m, n, cfg)
    steps = k_steps(k, cfg.BK)
    if cfg.split_k > 1:
        if m_tiles * n_tiles * NCONS > w.locks.numel():
            raise ValueError(f"a K split needs {m_tiles * n_tiles * NCONS} lock slots; the layer has "
                             f"{w.locks.numel()} (LOCK_SLOTS={LOCK_SLOTS})")
        part = torch.empty(m_tiles * n_tiles * NCONS * cfg.split_k * cfg.BNC * cfg.BM, dtype=torch.float32,
                           device=x.device)
    else:
        part = w.locks  # never read
    gdt = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
    # boxes of at most 64 tokens (the producer's XR), in the [BM, 64] tile's own layout
    x_desc = _desc(x, [min(cfg.BM, 64), 64], gl.NVMMASharedLayout.get_default_for([cfg.BM, 64], gdt))
    plain32 = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    w_desc = _desc(w.qweight, [cfg.BN // 16, 128 * (cfg.BK // 64)], plain32)
    gs = -(-cfg.BK // w.group_size) if w.group_size else 1
    s_desc = _desc(w.scales, [gs, cfg.BN], gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2))
    z_desc = _desc(w.zeros, [gs, cfg.BN], gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2))
    grid = (min(_sm_count(x.device.index or 0), n_units),)
    _w4_gluon_kernel[grid](
        x_desc, w_desc, s_desc, z_desc, w.scales, w.zeros, bias if bias is not None else w.scales, out, part,
        w.locks, ec.b if ec is not None else w.scales, v if v is not None else w.scales,
        float(ec.alpha) if ec is not None else 0.0, m, n, out.stride(0), m_tiles, n_units, steps, cfg.split_k,
        BNC=cfg.BNC, BM=cfg.BM, BK=cfg.BK, STAGES=cfg.stages, GROUP=w.group_size, SYMMETRIC=w.symmetric,
        HAS_BIAS=bias is not None, ACT=act,
        R=ec.b.shape[1] if ec is not None else 0,
        num_warps=4, maxnreg=MAX_REGS,
    )
    return out
