"""W4A16 GEMM with split-K and an optional error-compensator epilogue.

    out (M, N) = x (M, K) · W_hatᵀ (+ bias) (+ alpha · B (gamma(A x) ⊙ A x))

Algorithm. Programs form a 1-D grid: per m-tile, first the u programs (fused EC only), then
column tiles x split_k. Each W program streams BN rows of packed codes over its K range
(BK/2 bytes per row per step, 16-byte loads) with one of two main loops:
  * tensor cores (MV = 0): codes become floats with the exponent trick (``_unpack_w4``),
    the zero point (and per group the scale) is applied in the activation dtype, and
    accT [BN, BM] += W[BN, BK] · xT[BK, BM] accumulates in fp32. Tiles are transposed
    (weights on the left) so that decode's few tokens sit on the small MMA dimension.
  * CUDA cores (MV = 1, 2, 4 tokens; _nmajor.py, _kmajor.py, _frag_fma.py): exact fp32 codes, one
    FMA per weight and token, no change of register layout; with fp16 activations on CUDA,
    16 products at a time run in fp16x2 PTX instead (``_common._word2_dot``; over the fragment
    layout ``_frag_fma_ptx._frag_dot``).
Per-channel scales are applied once after the loop.

Split-K (decode: N/BN tiles alone cannot fill 132 SMs). Every split writes its fp32
partial to a workspace and bumps the tile's counter in ``locks``; the split that arrives
last sums the partials, runs the epilogue and zeroes the counter again, so the kernel
needs no second launch and ``locks`` stays reusable across calls and CUDA-graph replays.

Fused compensator (EC_MODE 1, decode; _ec_programs.py). ``u_split`` extra programs per m-tile
compute u = A x over their own K ranges in the same launch (so the W programs' loop is untouched);
they write fp32 partials of u and bump a per-m-tile counter. The u program that arrives
last sums the partials, evaluates the gate MLP, writes v = gamma(u) ⊙ u (M, R) and bumps
the counter once more. The program of each W tile's last split (the shortest K range, so
usually the first to finish) waits for that after its loop, loads v (one L2 round trip) and
adds alpha · B_tile v to its partial before storing it, which keeps the EC's round trips off
the split-K reduction's tail. The W programs carry neither the gate's code nor its
registers, and their EC work is one load and, at decode, one FMA row sum per token on B's
tile (a small dot on the tensor-core tiles); the gate runs while the W programs stream their
weights. The wait cannot deadlock: the u programs have the lowest
program ids of their m-tile and the hardware dispatches blocks in id order, so they are
resident or finished before any program that waits on them; until they have published v they
wait on nothing. Re-arming the counters for the next call: on CUDA each W tile, once all its
warps are past the wait, adds 1 to a done counter with a ``red`` (no result, so nothing waits
for it; an ``atomic_add``'s result is broadcast through shared memory, a stall in every tile)
and the last u program, after publishing v, waits for all n_wt counts and, after a
barrier (each of its warps polls on its own, so none may still be polling when the counters
are zeroed), zeroes both counters (the W tiles never wait again, so this wait ends). The
interpreter runs programs one after another, so there the last W tile to count resets the
counters. One launch, not a second one for the EC, because at decode a launch costs about as
much as the whole W4 GEMV. The alternatives measured against this design (the EC after the
reduction, a done ``atomic_add``, programs of their own for alpha · B v, a second launch):
BENCHMARKS.md, "Tried, measured, dropped".

EC_MODE 2 (prefill, serial variant): v = gamma(u) ⊙ u was computed by ``ec.ec_gate``;
the epilogue only adds alpha · B_tile v.

ACT 1 (gate/up as one layer with interleaved features, spear/serve/layers/linear.py): after bias
and EC the epilogue stores silu(gate) * up for each pair of rows, N / 2 output features.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spear.kernels import _common
from spear.kernels._common import INTERPRET, _dequant, _dot, _pdl_wait, _unpack_w4
from spear.kernels._ec_programs import _fused_ec, _u_program
from spear.kernels._epilogue import _epilogue, _finish_tile
from spear.kernels._frag_fma import _frag_fma_mainloop
from spear.kernels._kmajor import _kmajor_mainloop
from spear.kernels._mma import _mma_mainloop
from spear.kernels._nmajor import _fma_mainloop
from spear.kernels.layout import LOCK_SLOTS, PackedEC, PackedW4
from spear.kernels.launch import BUILTIN, Config, pick_config

U_SPLIT_MAX = 32  # fused EC: u = A x programs per m-tile at most (KernelPolicy.u_split_max; 32 timed best of 8-32)


@triton.jit(do_not_specialize=["M"])
def _w4a16_kernel(
    # tensors
    x_ptr, qw_ptr, scales_ptr, zeros_ptr, bias_ptr, out_ptr,
    part_ptr,      # fp32 (split_k, M, N) partial sums
    locks_ptr,     # int32 counters, zero on entry and on exit
    a_ptr, b_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr,  # padded EC (layout.py)
    upart_ptr,     # fp32 (u_split, M, R) partial A x
    v_ptr,         # (M, R) gamma(u) ⊙ u for EC_MODE 2
    # scalars
    alpha, bound,
    # sizes and strides (x and out have unit stride along features)
    M, N, K, stride_xm, stride_om,
    # weight layout
    GROUP: tl.constexpr, SYMMETRIC: tl.constexpr, HAS_BIAS: tl.constexpr, IS_BF16: tl.constexpr,
    # compensator: 0 none, 1 fused, 2 epilogue from v
    EC_MODE: tl.constexpr, GATE: tl.constexpr, R: tl.constexpr, H: tl.constexpr,
    # tiling
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, MV: tl.constexpr, DOT_F32: tl.constexpr,
    PTX: tl.constexpr, KMAJOR: tl.constexpr, PREFETCH: tl.constexpr,
    # split-K and the fused EC's u programs: constexpr so that the reductions over their partials
    # unroll (all loads in flight at once instead of one round trip per partial)
    SPLIT_K: tl.constexpr, U_SPLIT: tl.constexpr,
    # 1: the output features are (gate, up) pairs, features 2i and 2i + 1; store silu(gate) * up
    ACT: tl.constexpr = 0,
    # programmatic dependent launch (KernelPolicy.pdl): start loading weights before the kernel
    # before this one has finished; everything that reads x or writes waits for it
    PDL: tl.constexpr = False,
    # the fragment layout (layout.py, "mma"): the tensor-core loop of _mma.py (MV 0; ASM its PTX
    # conversion) or the CUDA-core loop of _frag_fma.py (MV > 0; PTX its fp16x2 products)
    MMA: tl.constexpr = False, ASM: tl.constexpr = False,
):
    # torch.compile passes Python floats as fp64 scalars; fp32 keeps the accumulators fp32
    alpha = tl.cast(alpha, tl.float32)
    bound = tl.cast(bound, tl.float32)
    pid = tl.program_id(0)
    n_wt = tl.cdiv(N, BN)
    if EC_MODE == 1:
        n_u = U_SPLIT
    else:
        n_u = 0
    per_m = n_u + n_wt * SPLIT_K
    pid_m = pid // per_m
    local = pid % per_m
    lock_base = pid_m * (n_wt + 2)   # n_wt tile counters, u counter, done counter
    offs_m = pid_m * BM + tl.arange(0, BM)
    m_mask = offs_m < M

    if EC_MODE == 1:
        # the u programs of an m-tile have its lowest ids, so they are dispatched first
        if local < n_u:
            iters = tl.cdiv(K // BK, U_SPLIT)
            k_lo = local * iters * BK
            k_hi = tl.minimum(k_lo + iters * BK, K)
            _u_program(x_ptr, a_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, upart_ptr, v_ptr, bound,
                       locks_ptr + lock_base + n_wt, offs_m, m_mask, k_lo, k_hi, local, M, K, stride_xm, n_wt,
                       U_SPLIT, GATE, R, H, BM, BK, MV, DOT_F32, PDL)
        else:
            w_local = local - n_u
            _w_program(x_ptr, qw_ptr, scales_ptr, zeros_ptr, bias_ptr, out_ptr, part_ptr, locks_ptr, b_ptr,
                       v_ptr, alpha, SPLIT_K, U_SPLIT, w_local // SPLIT_K, n_wt, lock_base, offs_m, m_mask,
                       w_local % SPLIT_K, M, N, K, stride_xm, stride_om,
                       GROUP, SYMMETRIC, HAS_BIAS, IS_BF16, EC_MODE, R, BM, BN, BK, MV, DOT_F32, PTX, KMAJOR,
                       PREFETCH, ACT, PDL, MMA, ASM)
    else:
        _w_program(x_ptr, qw_ptr, scales_ptr, zeros_ptr, bias_ptr, out_ptr, part_ptr, locks_ptr, b_ptr, v_ptr,
                   alpha, SPLIT_K, U_SPLIT, local // SPLIT_K, n_wt, lock_base, offs_m, m_mask, local % SPLIT_K,
                   M, N, K, stride_xm, stride_om,
                   GROUP, SYMMETRIC, HAS_BIAS, IS_BF16, EC_MODE, R, BM, BN, BK, MV, DOT_F32, PTX, KMAJOR, PREFETCH,
                   ACT, PDL, MMA, ASM)


@triton.jit
def _w_program(x_ptr, qw_ptr, scales_ptr, zeros_ptr, bias_ptr, out_ptr, part_ptr, locks_ptr, b_ptr, v_ptr, alpha,
               SPLIT_K: tl.constexpr, U_SPLIT: tl.constexpr, wt, n_wt, lock_base, offs_m, m_mask, split, M, N, K,
               stride_xm, stride_om,
               GROUP: tl.constexpr, SYMMETRIC: tl.constexpr, HAS_BIAS: tl.constexpr, IS_BF16: tl.constexpr,
               EC_MODE: tl.constexpr, R: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, MV: tl.constexpr, DOT_F32: tl.constexpr,
               PTX: tl.constexpr, KMAJOR: tl.constexpr, PREFETCH: tl.constexpr, ACT: tl.constexpr,
               PDL: tl.constexpr, MMA: tl.constexpr = False, ASM: tl.constexpr = False):
    """accT [BN, BM] for column tile ``wt`` over one K range, then split-K reduction and epilogue."""
    if not ((KMAJOR and MV > 0 and PTX and PREFETCH) or (MMA and MV > 0 and PREFETCH)):
        _pdl_wait(PDL)  # the prefetching decode loops wait after loading their first weights
    iters = tl.cdiv(K // BK, SPLIT_K)
    k_lo = split * iters * BK
    k_hi = tl.minimum(k_lo + iters * BK, K)
    offs_n = wt * BN + tl.arange(0, BN)
    n_mask = offs_n < N
    n_ld = offs_n % N  # in-bounds rows: unmasked, vectorized loads
    if MMA and MV > 0:  # scales applied inside
        accT = _frag_fma_mainloop(x_ptr, qw_ptr, scales_ptr, zeros_ptr, wt * BN, k_lo, k_hi, M, N, K, stride_xm,
                                  GROUP, SYMMETRIC, IS_BF16, BN, BK, BM, MV, PTX, PREFETCH, ASM, PDL)
    elif MMA:  # scales applied inside
        accT = _mma_mainloop(x_ptr, qw_ptr, scales_ptr, zeros_ptr, wt * BN, k_lo, k_hi, offs_m, m_mask, N, K,
                             stride_xm, GROUP, SYMMETRIC, IS_BF16, BN, BK, BM, DOT_F32, ASM)
    else:
        accT = _w_loop(x_ptr, qw_ptr, scales_ptr, zeros_ptr, wt, k_lo, k_hi, offs_m, m_mask, offs_n, n_mask, n_ld, M,
                       N, K, stride_xm, GROUP, SYMMETRIC, IS_BF16, BM, BN, BK, MV, DOT_F32, PTX, KMAJOR, PREFETCH, PDL)
    if EC_MODE == 1:
        # the fused EC rides on the tile's last split (the shortest K range, so the first to
        # finish) before its partial is stored, off the split-K reduction's tail
        if split == SPLIT_K - 1:
            accT = _fused_ec(accT, offs_m, m_mask, n_ld, n_wt, lock_base, locks_ptr, b_ptr, v_ptr, alpha, U_SPLIT,
                             R, DOT_F32, MV)

    out_mask = n_mask[:, None] & m_mask[None, :]
    mn_offs = offs_m[None, :] * N + offs_n[:, None]
    if SPLIT_K > 1:
        tl.store(part_ptr + split * M * N + mn_offs, accT, mask=out_mask)
        tl.debug_barrier()
        arrived = tl.atomic_add(locks_ptr + lock_base + wt, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            _finish_tile(wt, offs_m, m_mask, lock_base, bias_ptr, out_ptr, part_ptr, locks_ptr, b_ptr, v_ptr, alpha,
                         M, N, stride_om, SPLIT_K, HAS_BIAS, EC_MODE, R, BN, DOT_F32, MV, ACT)
    else:
        _epilogue(accT, offs_m, m_mask, offs_n, n_mask, n_ld, bias_ptr, out_ptr, b_ptr, v_ptr, alpha, stride_om,
                  HAS_BIAS, EC_MODE, R, DOT_F32, MV, ACT, wt, N)


@triton.jit
def _w_loop(x_ptr, qw_ptr, scales_ptr, zeros_ptr, wt, k_lo, k_hi, offs_m, m_mask, offs_n, n_mask, n_ld, M, N, K,
            stride_xm, GROUP: tl.constexpr, SYMMETRIC: tl.constexpr, IS_BF16: tl.constexpr, BM: tl.constexpr,
            BN: tl.constexpr, BK: tl.constexpr, MV: tl.constexpr, DOT_F32: tl.constexpr, PTX: tl.constexpr,
            KMAJOR: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr):
    """accT [BN, BM] of the N- and K-major layouts over one K range, scales applied: the CUDA-core
    loops (MV > 0) or the tensor-core tiles with the tile unpacked on chip."""
    offs_k = tl.arange(0, BK)
    offs_kw = tl.arange(0, BK // 8)
    x_base = x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None]
    w_base = qw_ptr + n_ld[:, None] * (K // 8) + offs_kw[None, :]
    if IS_BF16:
        zbase = 128.0
    else:
        zbase = 1024.0
    s = tl.load(scales_ptr + n_ld).to(tl.float32)
    if SYMMETRIC:
        zc = tl.full((BN,), zbase + 8.0, tl.float32)
    else:
        zc = zbase + tl.load(zeros_ptr + n_ld).to(tl.float32)
    if KMAJOR and MV > 0:  # scales applied inside
        accT = _kmajor_mainloop(x_ptr, qw_ptr, scales_ptr, zeros_ptr, wt * BN, k_lo, k_hi, M, N, stride_xm,
                                GROUP, SYMMETRIC, BN, BK, BM, MV, PTX, PREFETCH, PDL)
    elif MV > 0:
        accT = _fma_mainloop(x_ptr, qw_ptr, scales_ptr, zeros_ptr, n_ld, k_lo, k_hi, M, N, K, stride_xm,
                             GROUP, SYMMETRIC, BN, BK, BM, MV, PTX)
    else:
        if KMAJOR:
            # (K/8, N) words: load the [BN, BK/8] tile directly (N is the contiguous axis; the
            # hints keep 16-byte loads, which the modulo of n_ld would hide; past N is masked)
            offs_nc = tl.max_contiguous(tl.multiple_of(wt * BN + tl.arange(0, BN), BN), BN)
            w_base = qw_ptr + offs_kw[None, :] * N + offs_nc[:, None]
            w_mask = n_mask[:, None] & (offs_kw[None, :] >= 0)
        accT = tl.zeros((BN, BM), tl.float32)
        for k in range(k_lo, k_hi, BK):
            if KMAJOR:
                p = tl.load(w_base + (k // 8) * N, mask=w_mask, other=0)
            else:
                p = tl.load(w_base + k // 8)
            if GROUP > 0:
                g = k // GROUP
                s = tl.load(scales_ptr + g * N + n_ld).to(tl.float32)
                if not SYMMETRIC:
                    zc = zbase + tl.load(zeros_ptr + g * N + n_ld).to(tl.float32)
            w = _dequant(_unpack_w4(p, BN, BK, IS_BF16, KMAJOR), zc, s, GROUP > 0, IS_BF16)
            xt = tl.load(x_base + k, mask=m_mask[None, :], other=0.0)
            accT = _dot(w, xt, accT, DOT_F32)
    if GROUP == 0 and not (KMAJOR and MV > 0):
        accT = accT * s[:, None]
    return accT


def _check(x: torch.Tensor, w: PackedW4, bias: torch.Tensor | None, ec: PackedEC | None) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (tokens, in_features); got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"x must be float16 or bfloat16; got {x.dtype}")
    n, k = w.out_features, w.in_features
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} features, the packed weight expects in_features={k}")
    if x.stride(1) != 1:
        raise ValueError(f"x must have unit stride along features; got strides {x.stride()}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be (out_features,) = ({n},); got {tuple(bias.shape)}")
    if ec is not None:
        if ec.a.shape[1] != k or ec.b.shape[0] != n:
            raise ValueError(f"EC shapes A {tuple(ec.a.shape)}, B {tuple(ec.b.shape)} do not fit the layer ({n}, {k})")
        if ec.a.dtype != x.dtype:
            raise ValueError(f"EC parameters must be in the activation dtype {x.dtype}; got {ec.a.dtype}")


def check_act(act: int, n: int) -> None:
    """``act`` is 0, or 1 with an even number of output features (interleaved (gate, up) pairs)."""
    if act not in (0, 1) or (act and n % 2):
        raise ValueError(f"act must be 0 or 1 (SiLU·mul over interleaved (gate, up) pairs, even out_features); "
                         f"got act={act}, out_features={n}")


def w4a16_matmul(x: torch.Tensor, w: PackedW4, bias: torch.Tensor | None = None, ec: PackedEC | None = None,
                 ec_mode: int | None = None, v: torch.Tensor | None = None, config: Config | None = None,
                 act: int = 0, pdl: int = 0, u_split_max: int = U_SPLIT_MAX,
                 table=BUILTIN, native: bool | None = None) -> torch.Tensor:
    """``out = x W_hatᵀ (+ bias) (+ EC)`` for 2-D ``x``; see the module docstring.

    ``ec_mode``: 0 no EC, 1 fused (needs ``ec``), 2 epilogue from ``v`` = gamma(u) ⊙ u (M, R)
    (needs ``ec`` for B). Defaults to 1 when ``ec`` is given. ``config``: the launch (default:
    ``pick_config`` from ``table``). ``act`` 1: the output features are interleaved (gate, up)
    pairs and the result is silu(gate) * up, (M, N / 2). ``pdl`` 1: launched with programmatic
    dependent launch (CUDA, Hopper or newer). ``native``: the CUDA code (fp16 dot operands, the PTX
    products and inline-asm loads); default: unless Triton's interpreter runs the kernel (its dots
    then take fp32 operands and the inline assembly is left out).
    """
    _check(x, w, bias, ec)
    native = not INTERPRET if native is None else native
    if ec_mode is None:
        ec_mode = 0 if ec is None else 1
    if ec_mode not in (0, 1, 2) or (ec_mode and ec is None) or (ec_mode == 2 and v is None):
        raise ValueError(f"ec_mode must be 0, 1 (with ec) or 2 (with ec and v); got {ec_mode}")
    m, k = x.shape
    n = w.out_features
    check_act(act, n)
    cfg = config or pick_config(m, n, k, w.group_size, w.layout, table)
    mma = w.layout == "mma"
    if mma and cfg.mv:  # the fragment layout's CUDA-core loop: any group, 64-input blocks
        if cfg.BK < 64 or cfg.BK & (cfg.BK - 1) or k % cfg.BK or cfg.BN < 16 or cfg.BN & (cfg.BN - 1):
            raise ValueError(f"the fragment layout's CUDA-core loop takes BK a power of two >= 64 dividing "
                             f"in_features={k} and BN a power of two >= 16; got {cfg}")
        if x.storage_offset() % 2 or (m > 1 and x.stride(0) % 2):
            x = x.clone()  # the loop reads x as 32-bit pairs: rows must start at even elements
    elif mma:  # the fragment loop: any group within a step, 64-input blocks
        if (cfg.BK not in (64, 128) or k % cfg.BK or (cfg.BK == 128 and 0 < w.group_size < 128)
                or cfg.BN % 16 or cfg.BM < 16):
            raise ValueError(f"the fragment layout takes tensor-core launches with BK 64 or 128 dividing "
                             f"in_features={k} (128 only with groups of 128 or more), BN a multiple of 16 "
                             f"and BM >= 16; got {cfg}")
    elif k % cfg.BK or (w.group_size and w.group_size % cfg.BK):  # one scale per K step
        raise ValueError(f"BK={cfg.BK} must divide in_features={k} and the group size {w.group_size}")
    m_tiles, n_wt = triton.cdiv(m, cfg.BM), triton.cdiv(n, cfg.BN)
    if cfg.mv and (m > cfg.mv or cfg.mv not in (1, 2, 4) or cfg.mv > cfg.BM):
        raise ValueError(f"the CUDA-core main loop takes M <= mv, mv in (1, 2, 4), mv <= BM; got M={m}, "
                         f"mv={cfg.mv}, BM={cfg.BM}")
    r = ec.a.shape[0] if ec is not None else 16
    u_split = 0
    if ec_mode == 1:
        # as many u programs as K steps allow, up to u_split_max: each is a single program walking
        # its K range step by step, so u (and then v) is on the W tiles' critical path unless the
        # u programs' ranges are much shorter than the W programs' (which many programs per SM
        # and the register prefetch keep streaming); the last u program sums all partials in one
        # round trip
        u_split = min(cfg.u_split, k // cfg.BK) if cfg.u_split else min(k // cfg.BK, u_split_max)
    needs_locks = cfg.split_k > 1 or ec_mode == 1
    if needs_locks and m_tiles * (n_wt + 2) > w.locks.numel():
        raise ValueError(f"split-K/fused EC needs {m_tiles * (n_wt + 2)} lock slots for M={m}, N={n}; "
                         f"the layer has {w.locks.numel()} (LOCK_SLOTS={LOCK_SLOTS}); use a smaller M per call")
    out = torch.empty((m, n // 2 if act else n), dtype=x.dtype, device=x.device)
    part = torch.empty((cfg.split_k, m, n) if cfg.split_k > 1 else (1,), dtype=torch.float32, device=x.device)
    h = ec.w1.shape[0] if ec is not None and ec.gated else 16
    upart = torch.empty((u_split, m, r) if ec_mode == 1 else (1,), dtype=torch.float32, device=x.device)
    if ec_mode == 1:  # v = gamma(u) ⊙ u, written by the last u program of each m-tile
        v = torch.empty((m, r), dtype=x.dtype, device=x.device)
    dummy = w.scales  # never read when its feature flag is off
    e = ec
    # the PTX loop reads each row's 8 activations as one 16-byte vector (storage offset and row
    # stride in fp16 elements; the allocator aligns the storage itself)
    aligned = x.storage_offset() % 8 == 0 and (m == 1 or x.stride(0) % 8 == 0)
    grid = (m_tiles * (u_split + n_wt * cfg.split_k),)
    _w4a16_kernel[grid](
        x, w.qweight, w.scales, w.zeros, bias if bias is not None else dummy, out, part, w.locks,
        e.a if e else dummy, e.b if e else dummy,
        e.w1 if e and e.gated else dummy, e.b1 if e and e.gated else dummy,
        e.w2 if e and e.gated else dummy, e.b2 if e and e.gated else dummy,
        upart, v if v is not None else dummy,
        float(e.alpha) if e else 0.0, float(e.bound) if e else 0.0,
        m, n, k, x.stride(0), out.stride(0),
        GROUP=w.group_size, SYMMETRIC=w.symmetric, HAS_BIAS=bias is not None, IS_BF16=x.dtype == torch.bfloat16,
        EC_MODE=ec_mode, GATE=bool(e and e.gated), R=r, H=h,
        BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, MV=cfg.mv, DOT_F32=not native,
        PTX=bool(cfg.mv and cfg.ptx and (aligned or mma) and x.dtype == torch.float16 and native),
        KMAJOR=w.kmajor, SPLIT_K=cfg.split_k, U_SPLIT=u_split,
        PREFETCH=bool(cfg.prefetch and (w.kmajor or mma) and cfg.mv), ACT=act,
        MMA=mma, ASM=mma and native,
        **_common.pdl_args(pdl),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
