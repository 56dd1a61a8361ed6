"""Registers per thread of the W4A16 kernel's variants for Hopper, from ptxas, without a GPU.

    python benchmarks/kernel_registers.py

Compiles ``_w4a16_kernel`` for sm_90 (Triton's bundled ptxas) and reads the register count
with cuobjdump. The variants are the decode ones BENCHMARKS.md discusses: no EC, fused EC
(EC_MODE 1) and the v-epilogue (EC_MODE 2), CUDA-core (MV = 1) and tensor-core (MV = 0)
loops, K-major and N-major, at EC ranks 16 and 64 (4 warps, split-K 16, the default cap on u
programs, group 128, fp16). A second table takes the engine's launches at 1 to 64 tokens
(``pick_config`` on 4096 x 4096) with and without the fused gated EC, and adds local memory
(spills), shared memory, the programs per SM that registers and shared memory allow, and the
launch's waves on an H200.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from spear.kernels.w4a16 import U_SPLIT_MAX, _w4a16_kernel, pick_config  # noqa: E402
from tests.kernels._compile_check import TARGET, divisible, sig  # noqa: E402


def registers(ec_mode: int, mv: int, kmajor: bool, r: int = 16, bm: int = 16, prefetch: bool = False,
              num_warps: int = 4, split_k: int = 16, gate: bool = False, h: int = 32, num_stages: int = 1,
              spills: bool = False) -> int | tuple[int, int, int]:
    """Registers per thread of one variant; with ``spills`` also the bytes of local memory per
    thread (spilled registers) and of shared memory per program."""
    ptrs = dict(x_ptr="fp16", qw_ptr="i32", scales_ptr="fp16", zeros_ptr="u8", bias_ptr="fp16", out_ptr="fp16",
                part_ptr="fp32", locks_ptr="i32", a_ptr="fp16", b_ptr="fp16", w1_ptr="fp16", b1_ptr="fp16",
                w2_ptr="fp16", b2_ptr="fp16", upart_ptr="fp32", v_ptr="fp16")
    ptrs = {k: "*" + v for k, v in ptrs.items()}
    consts = dict(GROUP=128, SYMMETRIC=False, HAS_BIAS=False, IS_BF16=False, EC_MODE=ec_mode, GATE=gate, R=r, H=h,
                  BM=bm, BN=64, BK=128, MV=mv, DOT_F32=False, PTX=bool(mv), KMAJOR=kmajor, PREFETCH=prefetch,
                  SPLIT_K=split_k,
                  U_SPLIT=U_SPLIT_MAX if ec_mode == 1 else 0, ACT=0, PDL=0, PIPELINE=1)
    src = ASTSource(_w4a16_kernel, sig(_w4a16_kernel, ptrs, ("alpha", "bound"), consts), consts,
                    divisible(_w4a16_kernel))
    kernel = triton.compile(src, target=TARGET, options=dict(num_warps=num_warps, num_stages=num_stages))
    cuobjdump = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump"))[0]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    regs = int(re.findall(r"REG:(\d+)", out)[0])
    local = re.findall(r"LOCAL:(\d+)", out)
    return (regs, int(local[0]) if local else 0, kernel.metadata.shared) if spills else regs


def main() -> int:
    print("| loop | layout | EC | rank | registers |\n|---|---|---|---:|---:|")
    for mv, kmajor in ((1, True), (0, True), (1, False)):
        for ec_mode, r in ((0, 16), (1, 16), (1, 64), (2, 16), (2, 64)):
            if ec_mode == 0 and r != 16:
                continue
            ec = ("none", "fused", "v-epilogue")[ec_mode]
            print(f"| {'CUDA-core' if mv else 'tensor-core'} | {'K' if kmajor else 'N'}-major | {ec} | "
                  f"{r if ec_mode else '—'} | {registers(ec_mode, mv, kmajor, r)} |", flush=True)
    for ec_mode, r in ((0, 16), (1, 16)):
        print(f"| CUDA-core, prefetch | K-major | {('none', 'fused')[ec_mode]} | {r if ec_mode else '—'} | "
              f"{registers(ec_mode, 1, True, r, prefetch=True)} |", flush=True)
    launches()
    return 0


def resident(regs: int, num_warps: int, shared: int = 0) -> int:
    """Programs per SM that the registers and shared memory allow on Hopper (64K registers,
    allocated per warp in steps of 256; 228 KB of shared memory, 1 KB of it reserved per program;
    at most 64 warps and 32 programs per SM)."""
    per_warp = -(-regs * 32 // 256) * 256
    by_smem = 228 * 1024 // (shared + 1024)
    return min(32, 64 // num_warps, 65536 // (per_warp * num_warps), by_smem)


def launches(sms: int = 132) -> None:
    """The engine's decode launches at Llama-2-7B's q/o (4096 x 4096, g128, K-major) with and
    without the fused gated EC (hidden 16), 1 to 64 tokens: registers, local memory (spills),
    programs per SM, and the launch's waves on an H200's 132 SMs (programs include the EC's u
    programs)."""
    print("\n| tokens | tile | warps | EC | rank | registers | local bytes | shared KB | programs / SM | programs | waves |\n"
          "|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for m in (1, 2, 4, 8, 16, 32, 64):
        c = pick_config(m, 4096, 4096, 128, kmajor=True)
        for ec_mode, r in ((0, 16), (1, 16), (1, 32)):
            regs, local, shared = registers(ec_mode, c.mv, True, r, bm=c.BM, prefetch=c.prefetch, num_warps=c.num_warps,
                                    split_k=c.split_k, gate=ec_mode == 1, h=16, num_stages=c.num_stages, spills=True)
            m_tiles = -(-m // c.BM)
            programs = m_tiles * ((4096 // c.BN) * c.split_k + (min(4096 // c.BK, U_SPLIT_MAX) if ec_mode else 0))
            per_sm = resident(regs, c.num_warps, shared)
            tile = f"MV {c.mv}" if c.mv else f"BM {c.BM}"
            print(f"| {m} | {tile} | {c.num_warps} | {('none', 'fused')[ec_mode]} | {r if ec_mode else '—'} | {regs} | "
                  f"{local} | {shared / 1024:.1f} | {per_sm} | {programs} | {-(-programs // (per_sm * sms))} |",
                  flush=True)

if __name__ == "__main__":
    sys.exit(main())
