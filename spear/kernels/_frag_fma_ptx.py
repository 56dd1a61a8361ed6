"""The fp16x2 PTX of the fragment layout's CUDA-core loop (_frag_fma.py, "Products"): ``_frag_dq``
turns fragment words into fp16x2 (code - zero)/16 pairs, ``_frag_dot`` sums a chunk's pairs times
one token's activation words. CUDA only (inline assembly); the loop's exact fp32 path runs
everywhere else."""

from __future__ import annotations

import triton
import triton.language as tl


def _dq_ptx() -> str:
    """``_frag_dq``: $4 the word, $5 / $6 fp16x2 -(1024 + z)/16 of row g and -(64 + z)/16 of row
    g + 8 (``_common._neg_zero_pairs``); $0..$3 pairs 0..3 (rows g, g + 8, g, g + 8). Outputs are
    written last: an output may share its register with an input."""
    return "\n".join([
        "{", ".reg .b32 s, c16, c256, t<4>;",
        "mov.b32 c16, 0x2c002c00;",   # 1/16 in both halves
        "mov.b32 c256, 0x1c001c00;",  # 1/256
        "shr.u32 s, $4, 8;",
        "lop3.b32 t0, $4, 0x000f000f, 0x64006400, 0xea;",  # nibbles (0, 4): 1024 + code
        "lop3.b32 t1, $4, 0x00f000f0, 0x64006400, 0xea;",  # nibbles (1, 5): 1024 + 16 code
        "lop3.b32 t2, s, 0x000f000f, 0x64006400, 0xea;",   # nibbles (2, 6)
        "lop3.b32 t3, s, 0x00f000f0, 0x64006400, 0xea;",   # nibbles (3, 7)
        "fma.rn.f16x2 t0, t0, c16, $5;",
        "fma.rn.f16x2 t1, t1, c256, $6;",
        "fma.rn.f16x2 t2, t2, c16, $5;",
        "fma.rn.f16x2 t3, t3, c256, $6;",
        "mov.b32 $0, t0;", "mov.b32 $1, t1;", "mov.b32 $2, t2;", "mov.b32 $3, t3;", "}"])


def _dot_ptx(split: bool) -> str:
    """``_frag_dot``: inputs the 16 pairs of a chunk (word c's pair j at 4c + j) and the token's 8
    activation words (c's A and B at 16 + 2c, 17 + 2c), after the outputs; outputs the fp32 sums
    of rows g and g + 8 (split: of words 0-1 and 2-3 apart, (g, g + 8, g, g + 8))."""
    n_out = 4 if split else 2
    d = [[f"${n_out + 4 * c + j}" for j in range(4)] for c in range(4)]
    xa = [f"${n_out + 16 + 2 * c}" for c in range(4)]
    xb = [f"${n_out + 17 + 2 * c}" for c in range(4)]
    lines = ["{", ".reg .b32 al<2>, ah<2>;", ".reg .f16 l, h;", ".reg .f32 fl, fh;"]
    for c in range(4):
        a = c // 2 if split else 0
        if c == 0 or (split and c == 2):
            lines += [f"mul.rn.f16x2 al{a}, {d[c][0]}, {xa[c]};", f"mul.rn.f16x2 ah{a}, {d[c][1]}, {xa[c]};"]
        else:
            lines += [f"fma.rn.f16x2 al{a}, {d[c][0]}, {xa[c]}, al{a};",
                      f"fma.rn.f16x2 ah{a}, {d[c][1]}, {xa[c]}, ah{a};"]
        lines += [f"fma.rn.f16x2 al{a}, {d[c][2]}, {xb[c]}, al{a};", f"fma.rn.f16x2 ah{a}, {d[c][3]}, {xb[c]}, ah{a};"]
    for i, acc in enumerate(("al0", "ah0", "al1", "ah1")[:n_out]):
        lines += [f"mov.b32 {{l, h}}, {acc};", "cvt.f32.f16 fl, l;", "cvt.f32.f16 fh, h;", f"add.f32 ${i}, fl, fh;"]
    return "\n".join(lines + ["}"])


# one literal per variant, built once (the kernels take constexpr strings)
_PTX_DQ = tl.constexpr(_dq_ptx())
_PTX_DOT = tl.constexpr(_dot_ptx(False))
_PTX_DOT_SPLIT = tl.constexpr(_dot_ptx(True))


@triton.jit
def _frag_dq(w, zn_lo, zn16_hi):
    """The four fp16x2 (code - zero)/16 pairs of fragment words ``w`` (``_dq_ptx``)."""
    return tl.inline_asm_elementwise(_PTX_DQ, "=r,=r,=r,=r,r,r,r", [w, zn_lo, zn16_hi],
                                     dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)


@triton.jit
def _frag_dot(d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, h0, h1, h2, h3,
              a0, b0, a1, b1, a2, b2, a3, b3, SPLIT: tl.constexpr):
    """One token's sums over a chunk (``_dot_ptx``): words 0..3's pairs d, e, f, h; the token's
    activation words (a, b) of each word."""
    args = [d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, h0, h1, h2, h3, a0, b0, a1, b1, a2, b2, a3, b3]
    if SPLIT:
        return tl.inline_asm_elementwise(_PTX_DOT_SPLIT, "=f,=f,=f,=f" + ",r" * 24, args,
                                         dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True,
                                         pack=1)
    else:
        lo, hi = tl.inline_asm_elementwise(_PTX_DOT, "=f,=f" + ",r" * 24, args, dtype=(tl.float32, tl.float32),
                                           is_pure=True, pack=1)
        return lo, hi, lo, hi  # one group a chunk: the second pair is never read
