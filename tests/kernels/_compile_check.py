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
from spear.kernels.dequant import _dequant_kernel, _dequant_kmajor_kernel
from spear.kernels.ec import _ec_gate_finish_kernel, _ec_gate_kernel, _ec_up_kernel
from spear.kernels.fused import _silu_mul_kernel
from spear.kernels.paged_prefill import _paged_prefill_kernel
from spear.kernels.paged_prefill import launch_config as prefill_config
from spear.kernels.tp_reduce import _tp_reduce_ec_kernel
from spear.kernels.w4a16 import _w4a16_kernel

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


def compile_w4(bf16, ec_mode, mv, bm, gate=True, kmajor=False, prefetch=False, act=0, pdl=0, ftype="fp32", mma=False,
               bn=64, bk=64, group=128, sym=False, split=4, num_warps=4):
    dt = "bf16" if bf16 else "fp16"
    ptrs = dict(x_ptr=dt, qw_ptr="i32", scales_ptr="fp16", zeros_ptr="u8", bias_ptr=dt, out_ptr=dt, part_ptr="fp32",
                locks_ptr="i32", a_ptr=dt, b_ptr=dt, w1_ptr=dt, b1_ptr=dt, w2_ptr=dt, b2_ptr=dt, upart_ptr="fp32",
                v_ptr=dt)
    # unused EC pointers get the launcher's fp16 placeholder (the scales tensor), as in w4a16_matmul
    unused = {"a_ptr", "b_ptr", "w1_ptr", "b1_ptr", "w2_ptr", "b2_ptr"} if ec_mode == 0 else (
        {"a_ptr", "w1_ptr", "b1_ptr", "w2_ptr", "b2_ptr"} if ec_mode == 2 else set())
    ptrs = {k: "*" + ("fp16" if k in unused else v) for k, v in ptrs.items()}
    gate = gate and ec_mode == 1
    consts = dict(GROUP=group, SYMMETRIC=sym, HAS_BIAS=True, IS_BF16=bf16, EC_MODE=ec_mode, GATE=gate, R=32, H=32,
                  BM=bm, BN=bn, BK=bk, MV=mv, DOT_F32=False,
                  PTX=bool(mv) and not bf16, KMAJOR=kmajor, PREFETCH=prefetch, SPLIT_K=split,
                  U_SPLIT=8 if ec_mode == 1 else 0, ACT=act, PDL=pdl, MMA=mma, ASM=mma)
    src = ASTSource(_w4a16_kernel, sig(_w4a16_kernel, ptrs, ("alpha", "bound"), consts, ftype), consts,
                    divisible(_w4a16_kernel))
    return triton.compile(src, target=TARGET, options=dict(num_warps=num_warps, num_stages=3 if mma else 2))


def check_mma_loop(ptx: str) -> None:
    """The fragment layout's main loop (the PTX loop that issues wgmma): the weight tile never
    passes through shared memory (no st.shared: it reaches the wgmma from the registers its
    16-byte loads filled), the wgmma takes it as its register operand, and each step ends with
    ``wgmma.wait_group 0`` (_mma._wgmma_drain: the next step's conversion reuses those registers)."""
    parts = re.split(r"\n\$L__BB\d+_\d+:", ptx)
    loops = [p for p in parts if "Inner Loop Header" in p.split("\n")[0] and "wgmma.mma_async" in p]
    assert loops, "no main loop issues wgmma"
    loop = loops[0]
    assert "st.shared" not in loop, "the weight tile takes a trip through shared memory in the main loop"
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.(f16|bf16)\.(f16|bf16) \{[^}]*\}, \{%r",
                     loop), "the wgmma does not take the weight tile from registers"
    assert "wgmma.wait_group.sync.aligned 0" in loop, "no wgmma drain at the end of a step"


def check_frag_fma_loop(ptx: str, bf16: bool, bn: int, bk: int, num_warps: int) -> None:
    """The fragment layout's CUDA-core loop (_frag_fma.py) in compiled PTX: its main loop loads
    every weight word once per step, in 16-byte vectors (a lane's four words: BN · BK / 8 words
    over the program's threads, four a load), touches no shared memory and no barrier (nothing
    changes register layout between the load and the products: the scale loads are inline PTX for
    that reason), and makes its products in fp16x2 PTX (fp16: ``_frag_dq``'s LOP3 with the fp16
    1024 and ``_frag_dot``'s fma.rn.f16x2) or from exact fp32 codes (bf16: the OR with 2^23)."""
    marker = "1258291200" if bf16 else "0x64006400"  # 0x4B000000 (2^23 as fp32), fp16x2 1024
    parts = re.split(r"\n\$L__BB\d+_\d+:", ptx)
    loops = [p for p in parts if "Loop Header" in "".join(p.split("\n")[:2]) and marker in p]
    assert len(loops) == 1, f"{len(loops)} main loops with the code conversion, expected 1"
    loop = loops[0]
    v4 = len(re.findall(r"ld\.global(\.nc)?\.v4\.b32", loop))
    assert v4 == bn * bk // 8 // (32 * num_warps) // 4, f"{v4} 16-byte loads a step"
    assert not re.search(r"(st|ld)\.shared|bar\.sync", loop), "shared memory or a barrier in the main loop"
    if not bf16:
        assert "fma.rn.f16x2" in loop and "lop3.b32" in loop, "the fp16x2 word products are not in the main loop"


def resources(kernel) -> tuple[int, int] | None:
    """(registers, local memory bytes) per thread of a compiled kernel, from the cuobjdump Triton
    ships (None without one): local memory means ptxas spilled registers."""
    import os
    import subprocess
    import tempfile

    import triton.backends.nvidia as nv

    tool = os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")
    if not os.path.exists(tool):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", out)
    return int(m.group(1)), int(m.group(2)) + int(m.group(3))


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
    triton.compile(ASTSource(_dequant_kernel, sig(_dequant_kernel, p, (), c), c), target=TARGET)
    c = dict(GROUP=128, SYMMETRIC=False, IS_BF16=bf16, BN=64, BK=128, KMAJOR=True)  # K-major words to (N, K)
    triton.compile(ASTSource(_dequant_kernel, sig(_dequant_kernel, p, (), c), c, divisible(_dequant_kernel)),
                   target=TARGET)
    c = dict(GROUP=64, SYMMETRIC=False, IS_BF16=bf16, BN=64, BK=128)
    p = dict(qw_ptr="*i32", scales_ptr="*fp16", zeros_ptr="*u8", wt_ptr=dt)
    triton.compile(ASTSource(_dequant_kmajor_kernel, sig(_dequant_kmajor_kernel, p, (), c), c), target=TARGET)
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
    for ec_mode, mv, bm in ((0, 0, 64), (1, 1, 16), (1, 0, 16), (2, 0, 64)):
        kernel = compile_w4(bf16, ec_mode, mv, bm)
        if ec_mode == 1:  # the W tiles' wait for v and the last u program's wait for the W tiles
            assert check_polls(kernel.asm["ptx"]) == 2
    for ec_mode, mv, bm in ((0, 1, 16), (1, 4, 16), (0, 0, 64), (2, 0, 128)):  # the K-major layout
        compile_w4(bf16, ec_mode, mv, bm, kmajor=True)
    for ec_mode, mv in ((0, 1), (1, 2), (0, 4)):  # with the register prefetch of the next K step
        compile_w4(bf16, ec_mode, mv, 16, kmajor=True, prefetch=True)
    for ec_mode, mv, bm in ((1, 1, 16), (0, 0, 64), (2, 0, 128)):  # the SiLU·mul epilogue
        compile_w4(bf16, ec_mode, mv, bm, kmajor=True, prefetch=bool(mv), act=1)
    for ec_mode, mv, prefetch in ((1, 1, True), (0, 1, False), (1, 0, False)):  # programmatic dependent launch
        kernel = compile_w4(bf16, ec_mode, mv, 16, kmajor=True, prefetch=prefetch, pdl=1)
        assert "griddepcontrol.wait" in kernel.asm["ptx"], "PDL 1 without the wait for the kernel before"
        assert check_polls(kernel.asm["ptx"]) == (2 if ec_mode == 1 else 0)
    for ec_mode, mv, bm in ((1, 1, 16), (1, 0, 16), (2, 0, 128)):  # fp64 scalars, as torch.compile passes them
        compile_w4(bf16, ec_mode, mv, bm, kmajor=True, prefetch=bool(mv), ftype="fp64")
    # the fragment layout: decode tiles with split-K, the fused EC and the v-epilogue with SiLU·mul,
    # prefill tiles of 8 warps, per-channel symmetric and 64-input steps
    for ec_mode, bm, bn, bk, warps, split, group, sym, act in ((0, 16, 64, 128, 4, 4, 128, False, 0),
                                                              (1, 16, 64, 128, 4, 4, 128, False, 0),
                                                              (2, 64, 64, 128, 4, 2, 128, True, 1),
                                                              (0, 256, 128, 64, 8, 1, 128, False, 0),
                                                              (0, 64, 128, 64, 4, 1, 0, True, 0)):
        check_mma_loop(compile_w4(bf16, ec_mode, 0, bm, mma=True, bn=bn, bk=bk, group=group, sym=sym, split=split,
                                  num_warps=warps, act=act).asm["ptx"])
    # the fragment layout's CUDA-core loop (1-4 tokens): the built-in launches (BN 64, BK 128; 2
    # warps at one and two tokens, 4 at four and in the narrow one-token launch) over every group
    # form, with the fused EC, the v-epilogue, SiLU·mul, PDL, and a 256-input step
    dt = "bf16" if bf16 else "fp16"
    for mv, ec_mode, group, sym, warps, act, pdl, prefetch, bk in ((1, 0, 128, False, 2, 0, 0, True, 128),
                                                                 (1, 1, 128, False, 4, 0, 1, True, 128),
                                                                 (2, 0, 32, False, 2, 0, 0, False, 128),
                                                                 (4, 1, 64, True, 4, 1, 0, True, 128),
                                                                 (4, 2, 0, False, 4, 0, 0, True, 128),
                                                                 (2, 0, 0, True, 2, 0, 0, True, 256)):
        kernel = compile_w4(bf16, ec_mode, mv, 16, mma=True, prefetch=prefetch, bn=64, bk=bk, group=group, sym=sym,
                            split=8, num_warps=warps, act=act, pdl=pdl)
        ptx = kernel.asm["ptx"]
        check_frag_fma_loop(ptx, bf16, 64, bk, warps)
        assert check_polls(ptx) == (2 if ec_mode == 1 else 0)
        if pdl:
            assert "griddepcontrol.wait" in ptx, "PDL 1 without the wait for the kernel before"
        use = resources(kernel)
        if use is not None:
            assert use[1] == 0, f"fragment CUDA-core loop {dt} mv={mv} g={group}: {use[1]} bytes of local memory"
            print(f"fragment CUDA-core loop {dt} mv={mv} group={group} sym={sym} EC={ec_mode} act={act} "
                  f"warps={warps} BK={bk}: {use[0]} registers, no local memory")
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
