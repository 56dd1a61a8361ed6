"""An interpreter of the few PTX instructions the decode loops' inline assembly uses, so that Triton's
CPU interpreter (which runs no PTX) can run those kernels' CUDA paths in tests.

Each instruction is executed elementwise on numpy arrays with the rounding PTX specifies: fp16x2
products and sums are exact in fp64 and rounded once to fp16 (``.rn``), fp32 adds in fp32. Loads
read the host memory the interpreter's pointers address. Anything else raises: a kernel using an
instruction this does not know fails its test instead of computing something else.
"""

from __future__ import annotations

import ctypes
import re

import numpy as np

_OUT_DTYPES = {"r": np.uint32, "f": np.float32, "h": np.float16}


def _halves(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    v = v.astype(np.uint32)
    return ((v & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float64),
            (v >> 16).astype(np.uint16).view(np.float16).astype(np.float64))


def _pack(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    lo16 = lo.astype(np.float16).view(np.uint16).astype(np.uint32)
    hi16 = hi.astype(np.float16).view(np.uint16).astype(np.uint32)
    return lo16 | (hi16 << 16)


def _load(addrs: np.ndarray, ctype, dtype) -> np.ndarray:
    flat = [ctype.from_address(int(a)).value for a in np.asarray(addrs, dtype=np.uint64).ravel()]
    return np.array(flat, dtype=dtype).reshape(np.shape(addrs))


def run(asm: str, constraints: str, args: list[np.ndarray]) -> list[np.ndarray]:
    """Execute ``asm`` (Triton's inline-asm text with $i operands) on ``args`` (the inputs, in
    order): the outputs, by the constraints' "=r" (uint32), "=f" (float32), "=h" (float16)."""
    cons = [c.strip() for c in constraints.split(",")]
    outs = [c[1:] for c in cons if c.startswith("=")]
    regs: dict[str, np.ndarray] = {f"${len(outs) + i}": np.asarray(a) for i, a in enumerate(args)}
    for a in list(regs):
        if regs[a].dtype == np.int32:
            regs[a] = regs[a].view(np.uint32)
        elif regs[a].dtype == np.float16:
            regs[a] = regs[a].view(np.uint16).astype(np.uint32)
    shape = np.broadcast(*[regs[a] for a in regs]).shape

    def val(x: str) -> np.ndarray:
        x = x.strip()
        if re.fullmatch(r"0x[0-9a-fA-F]+|\d+", x):
            return np.full(shape, int(x, 0), dtype=np.uint32)
        return regs[x]

    for stmt in (s.strip() for s in re.split(r"[;\n]", asm)):
        if stmt in ("", "{", "}") or stmt.startswith(".reg") or stmt.startswith("//"):
            continue
        op, _, rest = stmt.partition(" ")
        if op == "mov.b32" and rest.strip().startswith("{"):  # unpack into two 16-bit registers
            dst, src = re.match(r"\{\s*(\S+)\s*,\s*(\S+)\s*\}\s*,\s*(\S+)", rest).group(1, 2), rest.split(",")[-1]
            v = val(src).astype(np.uint32)
            regs[dst[0]], regs[dst[1]] = v & 0xFFFF, v >> 16
            continue
        if op.startswith("ld.global"):
            dst, addr = re.match(r"(\S+)\s*,\s*\[\s*(\S+)\s*\]", rest).groups()
            if op.endswith(".b16"):
                regs[dst] = _load(regs[addr], ctypes.c_uint16, np.uint32)
            elif op.endswith(".u8"):
                regs[dst] = _load(regs[addr], ctypes.c_uint8, np.uint32)
            else:
                raise NotImplementedError(f"PTX emulator: {stmt!r}")
            continue
        ops = [o.strip() for o in rest.split(",")]
        dst, src = ops[0], ops[1:]
        if op == "mov.b32":
            regs[dst] = val(src[0]).astype(np.uint32)
        elif op == "shr.u32":
            regs[dst] = val(src[0]) >> np.uint32(int(src[1], 0))
        elif op == "lop3.b32":
            if int(src[3], 0) != 0xEA:
                raise NotImplementedError(f"PTX emulator: lop3 table {src[3]}")
            regs[dst] = (val(src[0]) & val(src[1])) | val(src[2])
        elif op in ("fma.rn.f16x2", "mul.rn.f16x2"):
            (al, ah), (bl, bh) = _halves(val(src[0])), _halves(val(src[1]))
            cl, ch = _halves(val(src[2])) if op.startswith("fma") else (0.0, 0.0)
            regs[dst] = _pack(al * bl + cl, ah * bh + ch)  # exact in fp64, rounded once to fp16
        elif op == "cvt.f32.f16":
            regs[dst] = (val(src[0]).astype(np.uint32) & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float32)
        elif op == "add.f32":
            regs[dst] = (regs[src[0]].astype(np.float32) + regs[src[1]].astype(np.float32)).astype(np.float32)
        else:
            raise NotImplementedError(f"PTX emulator: {stmt!r}")
    results = []
    for i, kind in enumerate(outs):
        v = regs[f"${i}"]
        if kind == "r":
            results.append(np.asarray(v).astype(np.uint32).view(np.int32))
        elif kind == "h":
            results.append((np.asarray(v).astype(np.uint32) & 0xFFFF).astype(np.uint16).view(np.float16))
        else:
            results.append(np.asarray(v).astype(np.float32))
    return results


def install(monkeypatch) -> None:
    """Let Triton's interpreter run inline assembly through :func:`run` (until the test ends)."""
    from triton.runtime import interpreter
    import triton.language as tl

    tl_types = {np.dtype(np.int32): tl.int32, np.dtype(np.float32): tl.float32, np.dtype(np.float16): tl.float16}

    class _Call:
        def __init__(self, results):
            self.results = results

        def get_result(self, i):
            r = self.results[i]
            return interpreter.TensorHandle(r, tl_types[r.dtype])

    def create_inline_asm(self, asm, constraints, values, type, is_pure, pack):
        if pack != 1:
            raise NotImplementedError("PTX emulator: pack > 1")
        return _Call(run(asm, constraints, [v.data for v in values]))

    monkeypatch.setattr(type(interpreter.interpreter_builder), "create_inline_asm", create_inline_asm)
