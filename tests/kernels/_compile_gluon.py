"""Compile the Gluon W4 GEMM for Hopper (sm_90) without a GPU and check its PTX; run as a script
(``python -m tests.kernels._compile_gluon``), outside the interpreter. Prints "ok"."""

import re

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

from spear.kernels import gluon_w4 as G

TARGET = GPUTarget("cuda", 90, 32)


def compile_variant(BNC=128, BM=128, BK=64, STAGES=4, GROUP=128, SYM=False, BF16=False, BIAS=True, ACT=0, R=0):
    """The kernel as ``gluon_w4a16`` launches it: TMA descriptors of the same boxes and layouts,
    pointers and sizes 16-divisible as the layer shapes give them."""
    dt, gdt = ("bf16", gl.bfloat16) if BF16 else ("fp16", gl.float16)
    plain = {w: gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=w, rank=2) for w in (8, 16, 32)}
    xl = gl.NVMMASharedLayout.get_default_for([BM, 64], gdt)
    gs = -(-BK // GROUP) if GROUP else 1
    bn = G.NCONS * BNC
    fn = G._w4_gluon_kernel
    sig = dict(x_desc=f"tensordesc<{dt}[{min(BM, 64)}, 64],{xl!r}>",
               w_desc=f"tensordesc<i32[{bn // 16}, {128 * (BK // 64)}],{plain[32]!r}>",
               s_desc=f"tensordesc<fp16[{gs}, {bn}],{plain[16]!r}>", z_desc=f"tensordesc<u8[{gs}, {bn}],{plain[8]!r}>",
               scales_ptr="*fp16", zeros_ptr="*u8", bias_ptr="*" + dt, out_ptr="*" + dt, part_ptr="*fp32",
               locks_ptr="*i32", b_ptr="*" + dt, v_ptr="*" + dt, alpha="fp32")
    consts = dict(BNC=BNC, BM=BM, BK=BK, STAGES=STAGES, GROUP=GROUP, SYMMETRIC=SYM, HAS_BIAS=BIAS, ACT=ACT, R=R)
    sig = {name: sig.get(name) or ("constexpr" if name in consts else "i32") for name in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if name.endswith("_ptr") or name in ("N", "stride_om")}
    return triton.compile(GluonASTSource(fn, sig, consts, attrs), target=TARGET,
                          options=dict(num_warps=4, maxnreg=G.MAX_REGS))


def check_ptx(ptx: str, what: str) -> None:
    """Each block of the main loop (it waits on a stage's mbarrier and issues wgmmas) takes the weight
    operand from registers and stores nothing to shared memory (the tile goes from the 16-byte
    shared loads through the conversion to the MMA); the partitions set their register budgets."""
    blocks = [b for b in re.split(r"\n\$L__BB\d+_\d+:", ptx) if "wgmma.mma_async" in b and "mbarrier.try_wait" in b]
    assert len(blocks) >= 2, f"{what}: no main loop with wgmma in both consumers"
    for b in blocks:
        assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.(f16|bf16)\.(f16|bf16) \{[^}]*\}, \{%r",
                         b), f"{what}: a wgmma does not take the weight tile from registers"
        assert not re.search(r"\bst\.shared|stmatrix", b), f"{what}: the main loop stores to shared memory"
        assert re.search(r"ld\.shared\.v4\.b32", b), f"{what}: the words are not loaded 16 bytes a lane"
    for regs in (G.CONSUMER_REGS, G.PRODUCER_REGS):
        assert re.search(rf"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+{regs};", ptx), f"{what}: no setmaxnreg {regs}"


VARIANTS = [dict(), dict(BF16=True, SYM=True, R=16), dict(GROUP=32, BK=128, BNC=64), dict(GROUP=0, BF16=True, ACT=1, R=32),
            dict(GROUP=64, BM=256, BNC=64, STAGES=3, R=64), dict(BM=16, BK=128, BIAS=False)]

if __name__ == "__main__":
    for v in VARIANTS:
        check_ptx(compile_variant(**v).asm["ptx"], str(v))
    print("ok")
