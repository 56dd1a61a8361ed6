"""The compensator's parts of the W4A16 kernel (w4a16.py, EC_MODE 1 and 2).

``_u_program``: the u = A x programs of the fused EC, one per K range; the last to finish
sums the partials and writes v = gamma(u) ⊙ u. ``_fused_ec``: alpha · B_tile v added on a W
tile's last split. The B_tile v product
itself, ``_b_times_v``, is in _epilogue.py, which the v-epilogue (EC_MODE 2) shares.
"""

from __future__ import annotations

import triton
import triton.language as tl

from spear.kernels._common import (_column0, _dot, _gate_apply, _gate_params, _pdl_wait, _signal, _sum_partials,
                                   _wait_above)
from spear.kernels._epilogue import _b_times_v


@triton.jit
def _u_program(x_ptr, ec, upart_ptr, v_ptr, bound, u_lock, offs_m, m_mask, k_lo, k_hi, split, M, K, stride_xm,
               n_wt, U_SPLIT: tl.constexpr, GATE: tl.constexpr, R: tl.constexpr, BM: tl.constexpr,
               BK: tl.constexpr, MV: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr):
    """Partial u for one K range: uT [R, BM] = A[R, BK] . xT[BK, BM], then signal. ``ec``: the
    compensator's pointers (w4a16.Comp; a gated one's hidden width is R too, layout.py). The last u program
    of the m-tile to finish sums the partials, writes v = gamma(u) ⊙ u and signals once more; on
    CUDA it then waits until each of the n_wt W tiles has signalled that it is past its wait, and
    re-arms both counters for the next call (``_fused_ec``)."""
    offs_r = tl.arange(0, R)
    if MV > 0:
        # one token: fp32 FMAs on [R, UK] tiles (a tensor-core dot here would set the register
        # count of the whole kernel, W programs included); UK keeps each tile at 2048 elements (16
        # fp32 registers per thread at 4 warps) for any rank
        UK: tl.constexpr = min(BK, 2048 // R)
        offs_u = tl.arange(0, UK)
        a_base = ec.a + offs_r[:, None] * K + offs_u[None, :]
        c = tl.zeros((R, UK), tl.float32)
        # register prefetch: tile k + UK is loaded before tile k's FMAs, so a u program has two
        # tiles in flight instead of one round trip per tile; clamped to the range's last tile
        # (in bounds even for an empty range: k_hi >= BK >= UK)
        k_last = k_hi - UK
        kk = tl.minimum(k_lo, k_last)
        a = tl.load(a_base + kk)
        _pdl_wait(PDL)
        x0 = tl.load(x_ptr + kk + offs_u).to(tl.float32)
        for k in range(k_lo, k_hi, UK):
            kn = tl.minimum(k + UK, k_last)
            a_next = tl.load(a_base + kn)
            y0 = tl.load(x_ptr + kn + offs_u).to(tl.float32)
            c += a.to(tl.float32) * x0[None, :]
            a, x0 = a_next, y0
        uT = _column0(c, BM)
    else:
        # tensor cores over K tiles of at most 1024 / R (the dot's operand tiles set the register
        # count of the whole kernel, W programs included)
        _pdl_wait(PDL)
        DK: tl.constexpr = max(16, min(BK, 1024 // R))
        offs_dk = tl.arange(0, DK)
        x_base = x_ptr + offs_m[None, :] * stride_xm + offs_dk[:, None]
        uT = tl.zeros((R, BM), tl.float32)
        for k in range(k_lo, k_hi, DK):
            a = tl.load(ec.a + offs_r[:, None] * K + (k + offs_dk)[None, :])
            xt = tl.load(x_base + k, mask=m_mask[None, :], other=0.0)
            uT = _dot(a, xt, uT, DOT_F32)
    u_offs = offs_m[None, :] * R + offs_r[:, None]
    if GATE:
        # the gate's weights before the arrival: whichever program arrives last has them in
        # registers instead of a dependent round trip after its acquire (they are parameters)
        w1t, b1, w2t, b2 = _gate_params(ec.w1, ec.b1, ec.w2, ec.b2, R, R)
    tl.store(upart_ptr + split * M * R + u_offs, uT, mask=m_mask[None, :])
    # every thread's stores must precede the (single-thread) release
    tl.debug_barrier()
    arrived = tl.atomic_add(u_lock, 1, sem="acq_rel")
    if arrived == U_SPLIT - 1:
        # all partials in one round trip while that stays within 4096 fp32 values in flight
        UCHUNK: tl.constexpr = max(1, min(U_SPLIT, 4096 // (R * BM)))
        uT = _sum_partials(upart_ptr + u_offs, M * R, m_mask[None, :], tl.zeros((R, BM), tl.float32), U_SPLIT,
                           UCHUNK)
        if GATE:
            vT = _gate_apply(uT, w1t, b1, w2t, b2, bound, R, BM, R, DOT_F32)
        else:
            vT = uT
        tl.store(v_ptr + u_offs, vT.to(v_ptr.dtype.element_ty), mask=m_mask[None, :])
        tl.debug_barrier()
        tl.atomic_add(u_lock, 1, sem="release")  # U_SPLIT + 1: v is ready
        if not DOT_F32:
            # the re-arm, here instead of in the W tiles: they signal with a red (no round trip on
            # their path), this program waits for all n_wt of them and zeroes both counters
            _wait_above(u_lock + 1, n_wt - 1, False)
            # every warp past its poll before any zeroes the counters: each warp polls on its
            # own, so without the barrier a warp that saw the last count could zero the done
            # counter while another warp of this program, whose last poll was just before that
            # count, polls again, reads 0 and spins forever (the engine's decode hung this way)
            tl.debug_barrier()
            tl.store(u_lock, 0)
            tl.store(u_lock + 1, 0)


@triton.jit
def _fused_ec(accT, offs_m, m_mask, n_ld, n_wt, lock_base, locks_ptr, b_ptr, v_ptr, alpha, U_SPLIT: tl.constexpr,
              R: tl.constexpr, DOT_F32: tl.constexpr, MV: tl.constexpr):
    """accT + alpha · B_tile v once the u programs have published v (EC_MODE 1)."""
    offs_r = tl.arange(0, R)
    # B's tile does not depend on v: issue its load before the wait, so it overlaps the wait
    bt = tl.load(b_ptr + n_ld[:, None] * R + offs_r[None, :])
    u_lock = locks_ptr + lock_base + n_wt
    done_lock = u_lock + 1  # the m-tile's done counter (the slot after the u counter)
    # poll with loads (an atomic per poll from every waiting program would contend on one L2
    # line); the acquiring load orders the read of v after the last u program's release.
    # DOT_F32 is the interpreter's mode (w4a16_matmul), which has no inline PTX
    _wait_above(u_lock, U_SPLIT, DOT_F32)
    if not DOT_F32:
        # every warp past its poll, then one fire-and-forget count: the last u program waits for
        # all n_wt counts and re-arms the counters (_u_program). v is not reset (the next call's u
        # programs rewrite it after this kernel has ended)
        tl.debug_barrier()
        _signal(done_lock)
    # .cg: read at L2, where the u program wrote v
    accT += alpha * _b_times_v(bt, v_ptr, offs_m, m_mask, offs_r, accT, R, MV, DOT_F32, ".cg")
    if DOT_F32:
        # the interpreter (no PTX; programs run one after another, so the u programs cannot wait
        # for the W tiles): each tile counts once, from its last split, and the last of the
        # m-tile's tiles re-arms the u counter and the done counter. Relaxed: every tile counts
        # only after its wait, so the last count follows every wait
        done = tl.atomic_add(done_lock, 1, sem="relaxed")
        if done == n_wt - 1:
            tl.atomic_xchg(u_lock, 0)
            tl.atomic_xchg(done_lock, 0)
    return accT
