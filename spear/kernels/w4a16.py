"""W4A16 GEMM with split-K and an optional error-compensator epilogue.

    out (M, N) = x (M, K) · W_hatᵀ (+ bias) (+ alpha · B (gamma(A x) ⊙ A x))

Algorithm. Programs form a 1-D grid: per m-tile, first the u programs (fused EC only), then
column tiles x split_k. Each W program streams BN rows of packed codes over its K range with the
main loop of the weight's layout (layout.py), accT [BN, BM] += W[BN, BK] · xT[BK, BM] in fp32,
tiles transposed (weights on the left) so that decode's few tokens sit on the small MMA dimension:
  * the fragment layout (FRAGMENT, _fragment.py): each lane's 16-byte load holds the codes of its
    MMA fragments, turned into 16-bit floats in registers and fed to the tensor cores as loaded;
  * the N-major fallback (_nmajor.py): the tile unpacked on chip for the tensor cores, or at one
    token (MV = 1) exact fp32 codes on CUDA cores, in fp16x2 PTX with fp16 activations on CUDA
    (``_common._word2_dot``).

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

Arguments come grouped: the weight's and the compensator's pointers as ``Weight`` and ``Comp``
tuples, what one compilation computes as the constexpr tuples ``Form`` (the weight) and ``Tile``
(the launch).

ACT 1 (gate/up as one layer with interleaved features, spear/serve/model/layers/linear.py): after bias
and EC the epilogue stores silu(gate) * up for each pair of rows, N / 2 output features.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from spear.kernels._common import INTERPRET, _pdl_wait, pdl_args
from spear.kernels._ec_programs import _fused_ec, _u_program
from spear.kernels._epilogue import _epilogue, _finish_tile
from spear.kernels._fragment import _fragment_mainloop
from spear.kernels._nmajor import _nmajor_mainloop
from spear.kernels.launch import BUILTIN, TritonConfig, pick_triton
from spear.kernels.layout import LOCK_SLOTS, Layout, PackedEC, PackedW4

U_SPLIT_MAX = 32  # fused EC: u = A x programs per m-tile at most (KernelPolicy.u_split_max; 32 timed best of 8-32)


class Weight(NamedTuple):
    """The packed weight's tensors (layout.py), as the kernel's pointers."""
    codes: object
    scales: object
    zeros: object


class Comp(NamedTuple):
    """The padded compensator's tensors (layout.py), as the kernel's pointers; placeholders where a
    launch reads none of them."""
    a: object
    b: object
    w1: object
    b1: object
    w2: object
    b2: object


class Form(NamedTuple):
    """Constexpr: the weight (its layout, group size, zero points) and the activations' dtype."""
    FRAGMENT: bool
    GROUP: int
    SYMMETRIC: bool
    IS_BF16: bool


class Tile(NamedTuple):
    """Constexpr: the launch (BM tokens by BN outputs, BK inputs a step; MV 1 the one-token loop;
    SPLIT_K ranges of K, constexpr so that the reduction over their partials unrolls)."""
    BM: int
    BN: int
    BK: int
    MV: int
    SPLIT_K: int


@triton.jit(do_not_specialize=["M"])
def _w4a16_kernel(
    x_ptr, out_ptr, bias_ptr,
    w,             # Weight
    ec,            # Comp
    part_ptr,      # fp32 (split_k, M, N) partial sums
    locks_ptr,     # int32 counters, zero on entry and on exit
    upart_ptr,     # fp32 (u_split, M, R) partial A x
    v_ptr,         # (M, R) gamma(u) ⊙ u (EC_MODE 2: given; 1: written by the u programs)
    alpha, bound,
    M, N, K, stride_xm, stride_om,  # x and out have unit stride along features
    FORM: tl.constexpr, TILE: tl.constexpr,
    # compensator: 0 none, 1 fused, 2 epilogue from v; its (padded) rank, gate, u programs per m-tile
    EC_MODE: tl.constexpr, GATE: tl.constexpr, R: tl.constexpr, U_SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    # 1: the output features are (gate, up) pairs, features 2i and 2i + 1; store silu(gate) * up
    ACT: tl.constexpr = 0,
    # programmatic dependent launch (KernelPolicy.pdl): start loading weights before the kernel
    # before this one has finished; everything that reads x or writes waits for it
    PDL: tl.constexpr = False,
    # the interpreter's dots (fp32 operands, no inline assembly); PTX: the one-token loop's fp16x2 products
    DOT_F32: tl.constexpr = False, PTX: tl.constexpr = False,
):
    # torch.compile passes Python floats as fp64 scalars; fp32 keeps the accumulators fp32
    alpha = tl.cast(alpha, tl.float32)
    bound = tl.cast(bound, tl.float32)
    BM: tl.constexpr = TILE.BM
    SPLIT_K: tl.constexpr = TILE.SPLIT_K
    pid = tl.program_id(0)
    n_wt = tl.cdiv(N, TILE.BN)
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
            iters = tl.cdiv(K // TILE.BK, U_SPLIT)
            k_lo = local * iters * TILE.BK
            k_hi = tl.minimum(k_lo + iters * TILE.BK, K)
            _u_program(x_ptr, ec, upart_ptr, v_ptr, bound, locks_ptr + lock_base + n_wt, offs_m, m_mask, k_lo, k_hi,
                       local, M, K, stride_xm, n_wt, U_SPLIT, GATE, R, BM, TILE.BK, TILE.MV, DOT_F32, PDL)
        else:
            w_local = local - n_u
            _w_program(x_ptr, out_ptr, bias_ptr, w, ec.b, part_ptr, locks_ptr, v_ptr, alpha, w_local // SPLIT_K,
                       n_wt, lock_base, offs_m, m_mask, w_local % SPLIT_K, M, N, K, stride_xm, stride_om, FORM, TILE,
                       EC_MODE, R, U_SPLIT, HAS_BIAS, ACT, PDL, DOT_F32, PTX)
    else:
        _w_program(x_ptr, out_ptr, bias_ptr, w, ec.b, part_ptr, locks_ptr, v_ptr, alpha, local // SPLIT_K, n_wt,
                   lock_base, offs_m, m_mask, local % SPLIT_K, M, N, K, stride_xm, stride_om, FORM, TILE, EC_MODE,
                   R, U_SPLIT, HAS_BIAS, ACT, PDL, DOT_F32, PTX)


@triton.jit
def _w_program(x_ptr, out_ptr, bias_ptr, w, b_ptr, part_ptr, locks_ptr, v_ptr, alpha, wt, n_wt, lock_base, offs_m,
               m_mask, split, M, N, K, stride_xm, stride_om, FORM: tl.constexpr, TILE: tl.constexpr,
               EC_MODE: tl.constexpr, R: tl.constexpr, U_SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
               ACT: tl.constexpr, PDL: tl.constexpr, DOT_F32: tl.constexpr, PTX: tl.constexpr):
    """accT [BN, BM] for column tile ``wt`` over one K range, then split-K reduction and epilogue."""
    BM: tl.constexpr = TILE.BM
    BN: tl.constexpr = TILE.BN
    BK: tl.constexpr = TILE.BK
    MV: tl.constexpr = TILE.MV
    SPLIT_K: tl.constexpr = TILE.SPLIT_K
    _pdl_wait(PDL)
    iters = tl.cdiv(K // BK, SPLIT_K)
    k_lo = split * iters * BK
    k_hi = tl.minimum(k_lo + iters * BK, K)
    offs_n = wt * BN + tl.arange(0, BN)
    n_mask = offs_n < N
    n_ld = offs_n % N  # in-bounds rows: unmasked, vectorized loads
    if FORM.FRAGMENT:  # scales applied inside
        accT = _fragment_mainloop(x_ptr, w.codes, w.scales, w.zeros, wt * BN, k_lo, k_hi, offs_m, m_mask, N, K,
                                  stride_xm, FORM.GROUP, FORM.SYMMETRIC, FORM.IS_BF16, BN, BK, BM, DOT_F32,
                                  not DOT_F32)
    else:
        accT = _nmajor_mainloop(x_ptr, w.codes, w.scales, w.zeros, k_lo, k_hi, offs_m, m_mask, offs_n, n_ld, N, K,
                                stride_xm, FORM.GROUP, FORM.SYMMETRIC, FORM.IS_BF16, BM, BN, BK, MV, DOT_F32, PTX)
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
        if ec.gated and ec.w1.shape != (ec.a.shape[0],) * 2:
            raise ValueError(f"a gated EC's rank and gate width are padded alike (layout.pack_ec); got A "
                             f"{tuple(ec.a.shape)}, W1 {tuple(ec.w1.shape)}")


def _check_launch(cfg: TritonConfig, w: PackedW4, m: int, k: int) -> None:
    if w.layout is Layout.FRAGMENT:  # any group within a step, 64-input blocks
        if (cfg.mv or cfg.BK not in (64, 128) or k % cfg.BK or (cfg.BK == 128 and 0 < w.group_size < 128)
                or cfg.BN % 16 or cfg.BM < 16):
            raise ValueError(f"the fragment layout takes tensor-core launches with BK 64 or 128 dividing "
                             f"in_features={k} (128 only with groups of 128 or more), BN a multiple of 16 "
                             f"and BM >= 16; got {cfg}")
    elif k % cfg.BK or (w.group_size and w.group_size % cfg.BK):  # one scale per K step
        raise ValueError(f"BK={cfg.BK} must divide in_features={k} and the group size {w.group_size}")
    if cfg.mv and m > 1:
        raise ValueError(f"the one-token loop (mv=1) takes one token; got M={m}")


def check_act(act: int, n: int) -> None:
    """``act`` is 0, or 1 with an even number of output features (interleaved (gate, up) pairs)."""
    if act not in (0, 1) or (act and n % 2):
        raise ValueError(f"act must be 0 or 1 (SiLU·mul over interleaved (gate, up) pairs, even out_features); "
                         f"got act={act}, out_features={n}")


def w4a16_matmul(x: torch.Tensor, w: PackedW4, bias: torch.Tensor | None = None, ec: PackedEC | None = None,
                 v: torch.Tensor | None = None, config: TritonConfig | None = None, act: int = 0, pdl: int = 0,
                 table=BUILTIN, native: bool | None = None) -> torch.Tensor:
    """``out = x W_hatᵀ (+ bias) (+ EC)`` for 2-D ``x``; see the module docstring.

    ``ec`` alone: the compensator fused into the launch (EC_MODE 1); with ``v`` = gamma(u) ⊙ u
    (M, R): only alpha · v Bᵀ in the epilogue (EC_MODE 2). ``config``: the launch (default:
    ``pick_triton`` from ``table``). ``act`` 1: the output features are interleaved (gate, up)
    pairs and the result is silu(gate) * up, (M, N / 2). ``pdl`` 1: launched with programmatic
    dependent launch (CUDA, Hopper or newer). ``native``: the CUDA code (fp16 dot operands, the PTX
    products and inline assembly); default: unless Triton's interpreter runs the kernel (its dots
    then take fp32 operands and the inline assembly is left out).
    """
    _check(x, w, bias, ec)
    native = not INTERPRET if native is None else native
    if v is not None and ec is None:
        raise ValueError("v (the semi-fused compensator's gamma(u) ⊙ u) needs ec for B and alpha")
    ec_mode = 0 if ec is None else (2 if v is not None else 1)
    m, k = x.shape
    n = w.out_features
    check_act(act, n)
    fragment = w.layout is Layout.FRAGMENT
    cfg = config or pick_triton(m, n, k, fragment, w.group_size, table)
    _check_launch(cfg, w, m, k)
    m_tiles, n_wt = triton.cdiv(m, cfg.BM), triton.cdiv(n, cfg.BN)
    r = ec.a.shape[0] if ec is not None else 16
    u_split = 0
    if ec_mode == 1:
        # as many u programs as K steps allow, up to u_split: each is a single program walking its
        # K range step by step, so u (and then v) is on the W tiles' critical path unless the u
        # programs' ranges are much shorter than the W programs' (which many programs per SM keep
        # streaming); the last u program sums all partials in one round trip
        u_split = min(cfg.u_split or U_SPLIT_MAX, k // cfg.BK)
    needs_locks = cfg.split_k > 1 or ec_mode == 1
    if needs_locks and m_tiles * (n_wt + 2) > w.locks.numel():
        raise ValueError(f"split-K/fused EC needs {m_tiles * (n_wt + 2)} lock slots for M={m}, N={n}; "
                         f"the layer has {w.locks.numel()} (LOCK_SLOTS={LOCK_SLOTS}); use a smaller M per call")
    out = torch.empty((m, n // 2 if act else n), dtype=x.dtype, device=x.device)
    part = torch.empty((cfg.split_k, m, n) if cfg.split_k > 1 else (1,), dtype=torch.float32, device=x.device)
    upart = torch.empty((u_split, m, r) if ec_mode == 1 else (1,), dtype=torch.float32, device=x.device)
    if ec_mode == 1:  # v = gamma(u) ⊙ u, written by the last u program of each m-tile
        v = torch.empty((m, r), dtype=x.dtype, device=x.device)
    dummy = w.scales  # never read when its feature flag is off
    gated = ec is not None and ec.gated
    comp = Comp(ec.a if ec else dummy, ec.b if ec else dummy,
                *((ec.w1, ec.b1, ec.w2, ec.b2) if gated else (dummy,) * 4))
    # the one-token loop reads its 8 activations a word as one 16-byte vector (storage offset in
    # fp16 elements; the allocator aligns the storage itself)
    aligned = x.storage_offset() % 8 == 0
    grid = (m_tiles * (u_split + n_wt * cfg.split_k),)
    _w4a16_kernel[grid](
        x, out, bias if bias is not None else dummy, Weight(w.qweight, w.scales, w.zeros), comp, part, w.locks, upart,
        v if v is not None else dummy, float(ec.alpha) if ec else 0.0, float(ec.bound) if ec else 0.0,
        m, n, k, x.stride(0), out.stride(0),
        FORM=Form(fragment, w.group_size, w.symmetric, x.dtype == torch.bfloat16),
        TILE=Tile(cfg.BM, cfg.BN, cfg.BK, cfg.mv, cfg.split_k),
        EC_MODE=ec_mode, GATE=gated, R=r, U_SPLIT=u_split, HAS_BIAS=bias is not None, ACT=act,
        DOT_F32=not native, PTX=bool(cfg.mv and aligned and x.dtype == torch.float16 and native),
        **pdl_args(pdl), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
