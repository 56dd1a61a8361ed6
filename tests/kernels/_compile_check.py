"""Compile the kernels for Hopper (sm_90) without a GPU; run as a script, outside the interpreter.

The interpreter only executes the branches a launch takes, so a constexpr variant that does
not type-check (e.g. a dot of fp16 and bf16 tiles) passes it; ptxas does not. Prints "ok".
"""

import re
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from spear.kernels.attention import _paged_decode_kernel, launch_config
from spear.kernels.dequant import _dequant_kernel
from spear.kernels.ec import _ec_gate_finish_kernel, _ec_gate_kernel, _ec_up_kernel
from spear.kernels.fused import _silu_mul_kernel
from spear.kernels.paged_prefill import _paged_prefill_kernel
from spear.kernels.paged_prefill import launch_config as prefill_config
from spear.kernels.tp_reduce import _tp_reduce_ec_kernel
from spear.kernels.w4a16 import Comp, Form, Tile, Weight, _w4a16_kernel

TARGET = GPUTarget("cuda", 90, 128)


def sig(fn, ptrs, floats, consts, ftype="fp32"):
    """ftype: the float scalars' type; torch.compile passes Python floats as fp64."""
    out = {}
    for name in fn.arg_names:
        out[name] = ptrs.get(name) or (ftype if name in floats else ("constexpr" if name in consts else "i32"))
    return out


def divisible(fn):
    """The JIT's specialisation of a launch on real tensors: pointers 16-byte aligned, and sizes
    and strides divisible by 16 (what the layer shapes give). Without it the loads compile
    unvectorised, unlike the kernels that run."""
    names = fn.arg_names
    return {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
            if n.endswith("_ptr") or n in ("N", "K", "stride_xm", "stride_om", "stride_wn")}


def compile_w4(bf16, ec_mode, mv, bm, gate=True, act=0, pdl=0, ftype="fp32", fragment=False, bn=64, bk=64, group=128,
               sym=False, split=4, num_warps=4):
    """The W4 GEMM as ``w4a16_matmul`` launches it: the weight and compensator pointers as tuples,
    every pointer 16-byte aligned and N, K and the strides divisible by 16 (the JIT's
    specialisation of a launch at the layer shapes)."""
    dt = "*bf16" if bf16 else "*fp16"
    # unused EC pointers get the launcher's fp16 placeholder (the scales tensor)
    gate = gate and ec_mode == 1
    ec = Comp(*(dt if (ec_mode == 1 and (name == "a" or gate)) or (ec_mode and name == "b") else "*fp16"
                for name in Comp._fields))
    sig = dict(x_ptr=dt, out_ptr=dt, bias_ptr=dt, w=Weight("*i32", "*fp16", "*u8"), ec=ec, part_ptr="*fp32",
               locks_ptr="*i32", upart_ptr="*fp32", v_ptr=dt, alpha=ftype, bound=ftype)
    consts = dict(FORM=Form(fragment, group, sym, bf16), TILE=Tile(bm, bn, bk, mv, split), EC_MODE=ec_mode, GATE=gate,
                  R=32, U_SPLIT=8 if ec_mode == 1 else 0, HAS_BIAS=True, ACT=act, PDL=pdl, DOT_F32=False,
                  PTX=bool(mv) and not bf16)
    names = _w4a16_kernel.arg_names
    sig = {n: sig.get(n) or ("constexpr" if n in consts else "i32") for n in names}
    attrs = {}
    for i, n in enumerate(names):
        if n in ("w", "ec"):
            attrs.update({(i, j): [["tt.divisibility", 16]] for j in range(len(sig[n]))})
        elif n.endswith("_ptr") or n in ("N", "K", "stride_xm", "stride_om"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(_w4a16_kernel, sig, consts, attrs)
    return triton.compile(src, target=TARGET, options=dict(num_warps=num_warps, num_stages=3 if fragment else 2))


def check_fragment_loop(ptx: str) -> None:
    """The fragment layout's main loop (the PTX loop that converts the codes, _fragment._convert_ptx's
    mask 0x000f000f, and issues wgmma; a fused compensator's u programs have a wgmma loop of their
    own): the weight tile never passes through shared memory (no st.shared: it reaches the wgmma
    from the registers its 16-byte loads filled), the wgmma takes it as its register operand, and
    each step ends with ``wgmma.wait_group 0`` (_fragment._wgmma_drain: the next step's conversion
    reuses those registers)."""
    parts = re.split(r"\n\$L__BB\d+_\d+:", ptx)
    loops = [p for p in parts if "Inner Loop Header" in p.split("\n")[0] and "wgmma.mma_async" in p
             and "0x000f000f" in p]
    assert len(loops) == 1, f"{len(loops)} main loops convert codes and issue wgmma, expected 1"
    loop = loops[0]
    assert "st.shared" not in loop, "the weight tile takes a trip through shared memory in the main loop"
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.(f16|bf16)\.(f16|bf16) \{[^}]*\}, \{%r",
                     loop), "the wgmma does not take the weight tile from registers"
    assert "wgmma.wait_group.sync.aligned 0" in loop, "no wgmma drain at the end of a step"


def check_polls(ptx: str) -> int:
    """The spin-waits of the fused EC (``_common._wait_above``) in compiled PTX: after each poll
    loop (an ``ld.acquire.gpu`` and a branch back to it) the first barrier, store or atomic must
    be a ``bar.sync``. Each warp polls on its own and a program's scalar stores come from one
    thread, so a store right after the loop can change the polled counter while another warp of
    the program is still polling it (that warp then spins forever). Returns the loops checked."""
    lines = ptx.splitlines()
    loops = 0
    for i, line in enumerate(lines):
        if "ld.acquire.gpu.global" not in line:
            continue
        back = next(j for j in range(i + 1, len(lines)) if re.search(r"\bbra(\.uni)?\s", lines[j]))
        after = next((lines[j].strip() for j in range(back + 1, len(lines))
                      if re.search(r"\b(bar\.sync|st\.global|red\.|atom\.)", lines[j])), "")
        assert after.startswith("bar.sync"), f"poll loop at PTX line {i + 1} is followed by {after!r}, not a barrier"
        loops += 1
    return loops


def compile_small(bf16, ftype="fp32"):
    dt = "*bf16" if bf16 else "*fp16"
    c = dict(GROUP=64, SYMMETRIC=True, IS_BF16=bf16, BN=64, BK=64)
    p = dict(qw_ptr="*i32", scales_ptr="*fp16", zeros_ptr="*u8", w_ptr=dt)
    triton.compile(ASTSource(_dequant_kernel, sig(_dequant_kernel, p, (), c), c, divisible(_dequant_kernel)),
                   target=TARGET)
    # one program per token tile, or shares of K into an fp32 workspace
    for split in (1, 4):
        c = dict(GATE=True, R=16, H=16, BM=16, BK=64, DOT_F32=False, SPLIT=split)
        p = {k: dt for k in ("x_ptr", "a_ptr", "w1_ptr", "b1_ptr", "w2_ptr", "b2_ptr")}
        p["v_ptr"] = dt if split == 1 else "*fp32"
        triton.compile(ASTSource(_ec_gate_kernel, sig(_ec_gate_kernel, p, ("bound",), c, ftype), c), target=TARGET)
    c = dict(GATE=True, R=16, H=16, BM=16, DOT_F32=False, SPLIT=4)
    p = {k: dt for k in ("w1_ptr", "b1_ptr", "w2_ptr", "b2_ptr", "v_ptr")}
    p["ws_ptr"] = "*fp32"
    triton.compile(ASTSource(_ec_gate_finish_kernel, sig(_ec_gate_finish_kernel, p, ("bound",), c, ftype), c),
                   target=TARGET)
    c = dict(R=16, BM=64, BN=64, DOT_F32=False)
    p = {k: dt for k in ("v_ptr", "b_ptr", "out_ptr")}
    triton.compile(ASTSource(_ec_up_kernel, sig(_ec_up_kernel, p, ("alpha",), c, ftype), c), target=TARGET)
    for pairs in (False, True):
        c = dict(BLOCK=1024, PDL=0, PAIRS=pairs)
        p = {k: dt for k in ("g_ptr", "u_ptr", "out_ptr")}
        triton.compile(ASTSource(_silu_mul_kernel, sig(_silu_mul_kernel, p, (), c), c), target=TARGET)


def compile_tp_reduce(bf16, peers, ec, gate, bias, ftype="fp32"):
    """The row-parallel sum with the compensator's second half (tp_reduce.py): peers' buffers as
    eight pointers, of which PEERS are read."""
    dt = "*bf16" if bf16 else "*fp16"
    names = [f"p{i}" for i in range(8)] + ["out_ptr", "bias_ptr", "b_ptr", "w1_ptr", "b1_ptr", "w2_ptr", "b2_ptr"]
    c = dict(PEERS=peers, EC=ec, GATE=gate, HAS_BIAS=bias, R=32, H=16, BM=16, BN=128, DOT_F32=False)
    src = ASTSource(_tp_reduce_ec_kernel, sig(_tp_reduce_ec_kernel, {k: dt for k in names}, ("alpha", "bound"), c,
                                              ftype), c)
    return triton.compile(src, target=TARGET, options=dict(num_warps=4, num_stages=1))


def compile_attention(dtype, head_dim, block_size, group, splits=8, pdl=0, rope=False):
    """The paged decode kernel as the launcher specializes it: pointers 16-byte aligned (torch's
    allocations), strides multiples of head_dim >= 16, context_lens contiguous."""
    fn = _paged_decode_kernel
    ptrs = dict(q_ptr="*" + dtype, k_ptr="*" + dtype, v_ptr="*" + dtype, bt_ptr="*i64", lens_ptr="*i64",
                out_ptr="*" + dtype, part_ptr="*fp32", count_ptr="*i32", kn_ptr="*" + dtype, vn_ptr="*" + dtype,
                cos_ptr="*" + dtype, sin_ptr="*" + dtype)
    div16 = list(ptrs) + [n for n in fn.arg_names if n.startswith(("stride_q", "stride_o", "stride_k", "stride_v"))]
    block_n, num_warps = launch_config(getattr(torch, dict(fp16="float16", bf16="bfloat16", fp32="float32")[dtype]),
                                       head_dim)
    c = dict(GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
             BLOCK_N=block_n, IS_FP32=dtype == "fp32", DOT_F32=False, stride_len=1, SPLITS=splits, PDL=pdl,
             ROPE=rope)
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in div16}
    src = ASTSource(fn, sig(fn, ptrs, ("qk_scale",), c), c, attrs)
    return triton.compile(src, target=TARGET, options=dict(num_warps=num_warps, num_stages=2))


def compile_prefill(dtype, head_dim, block_size, group, table="i32"):
    """The paged prefill kernel as ``paged_prefill_attention`` specializes it (default tiles): pointers
    16-byte aligned, q/out/cache strides multiples of head_dim >= 16."""
    fn = _paged_prefill_kernel
    ptrs = dict(q_ptr="*" + dtype, k_ptr="*" + dtype, v_ptr="*" + dtype, bt_ptr="*" + table, qsl_ptr="*i32",
                lens_ptr="*i32", out_ptr="*" + dtype)
    div16 = list(ptrs) + [n for n in fn.arg_names if n.startswith(("stride_q", "stride_o", "stride_k", "stride_v"))
                          and n != "stride_qsl"]
    block_m, block_n, num_warps, num_stages = prefill_config(
        getattr(torch, dict(fp16="float16", bf16="bfloat16", fp32="float32")[dtype]), head_dim, group)
    c = dict(GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_m // group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
             BLOCK_N=block_n, IS_FP32=dtype == "fp32", DOT_F32=False)
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in div16}
    src = ASTSource(fn, sig(fn, ptrs, ("qk_scale",), c), c, attrs)
    return triton.compile(src, target=TARGET, options=dict(num_warps=num_warps, num_stages=num_stages))


if __name__ == "__main__":
    bf16 = sys.argv[1] == "bf16"
    # the fragment layout: decode tiles with split-K, the fused EC and the v-epilogue with SiLU·mul,
    # prefill tiles of 8 warps, per-channel symmetric and 64-input steps, PDL, fp64 scalars
    for ec_mode, bm, bn, bk, warps, split, group, sym, act, pdl, ftype in (
            (0, 16, 64, 128, 4, 4, 128, False, 0, 0, "fp32"), (1, 16, 64, 128, 4, 4, 128, False, 0, 1, "fp32"),
            (2, 64, 64, 128, 4, 2, 128, True, 1, 0, "fp32"), (0, 256, 128, 64, 8, 1, 128, False, 0, 0, "fp32"),
            (0, 64, 128, 64, 4, 1, 0, True, 0, 0, "fp32"), (1, 32, 64, 128, 4, 2, 128, False, 1, 0, "fp64")):
        kernel = compile_w4(bf16, ec_mode, 0, bm, fragment=True, bn=bn, bk=bk, group=group, sym=sym, split=split,
                            num_warps=warps, act=act, pdl=pdl, ftype=ftype)
        ptx = kernel.asm["ptx"]
        check_fragment_loop(ptx)
        assert check_polls(ptx) == (2 if ec_mode == 1 else 0)  # the W tiles' wait for v, the u programs' for them
        if pdl:
            assert "griddepcontrol.wait" in ptx, "PDL 1 without the wait for the kernel before"
    # the N-major fallback: the one-token loop (fused EC, PDL), the tensor-core tiles (v-epilogue,
    # SiLU·mul), prefill tiles, fp64 scalars as torch.compile passes them
    for ec_mode, mv, bm, act, pdl, ftype in ((0, 1, 16, 0, 0, "fp32"), (1, 1, 16, 0, 1, "fp32"), (1, 0, 16, 1, 0, "fp32"),
                                            (2, 0, 64, 1, 0, "fp32"), (0, 0, 128, 0, 0, "fp32"),
                                            (1, 1, 16, 1, 0, "fp64"), (2, 0, 128, 0, 1, "fp64")):
        kernel = compile_w4(bf16, ec_mode, mv, bm, act=act, pdl=pdl, ftype=ftype)
        ptx = kernel.asm["ptx"]
        assert check_polls(ptx) == (2 if ec_mode == 1 else 0)
        if pdl:
            assert "griddepcontrol.wait" in ptx, "PDL 1 without the wait for the kernel before"
        if mv and not bf16:
            assert "fma.rn.f16x2" in ptx and "lop3.b32" in ptx, "the one-token loop's fp16x2 word products"
    compile_small(bf16)
    compile_small(bf16, "fp64")
    for peers, ec, gate, bias in ((1, True, True, True), (2, True, True, False), (8, True, False, True),
                                  (4, False, False, True)):
        ptx = compile_tp_reduce(bf16, peers, ec, gate, bias).asm["ptx"]
        # each peer's buffer is read (PEERS loads of the partial output tile, and of u with an EC)
        assert len(re.findall(r"ld\.global", ptx)) >= peers * (2 if ec else 1), "a peer's buffer is not read"
    compile_tp_reduce(bf16, 2, True, True, True, "fp64")
    for head_dim, block_size, group in ((128, 16, 4), (128, 8, 1), (64, 32, 8), (256, 16, 4)):
        compile_attention("bf16" if bf16 else "fp16", head_dim, block_size, group)
    if not bf16:
        compile_attention("fp32", 128, 16, 4)
        compile_attention("fp16", 128, 16, 1, splits=1)
        assert "griddepcontrol.wait" in compile_attention("fp16", 128, 16, 4, pdl=1).asm["ptx"]
    for head_dim, group in ((128, 4), (64, 1)):  # rotary and the new token's cache write inside
        ptx = compile_attention("bf16" if bf16 else "fp16", head_dim, 16, group, rope=True).asm["ptx"]
        # the rotary's products are rounded as torch rounds them (rope_write_kv, bit for bit), not
        # contracted into a half-precision fma with the sum
        assert not re.search(r"fma\.rn(\.ftz)?\.(f16|bf16)", ptx), "the rotary's product was contracted into an fma"
    # mixed-step attention: Llama-3-8B (GQA 4), the default model's group of 3 (a spare row per tile),
    # a group filling the tile with one query, fp32; MHA over int64 tables and head_dim 256 in bf16
    if bf16:
        compile_prefill("bf16", 128, 8, 1, table="i64")
        compile_prefill("bf16", 256, 16, 4)
    else:
        compile_prefill("fp16", 128, 16, 4)
        compile_prefill("fp16", 64, 16, 3)
        compile_prefill("fp16", 64, 32, 64, table="i64")
        compile_prefill("fp32", 64, 16, 3)
    print("ok")
