"""Shared builders for the kernel tests: random layers, compensators, what a launch allocates."""

from __future__ import annotations

import contextlib
import os

import torch

from spear.kernels import reference as ref
from spear.kernels.layout import Layout, pack, pack_ec
from spear.quant.primitives import rtn

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"
# fp32 reference vs a kernel that rounds W_hat (grouped) and the output once to 16 bits
TOL = {torch.float16: 4e-3, torch.bfloat16: 3e-2}
SQNR_FLOOR = {torch.float16: 55.0, torch.bfloat16: 38.0}


@contextlib.contextmanager
def allocations():
    """Yields a list that collects the shape of every non-empty tensor allocated uninitialized
    meanwhile (``aten.empty``: a launcher's outputs and workspaces), in order. Empty ones are left
    out: Triton's interpreter makes those for itself while it runs a kernel."""
    from torch.utils._python_dispatch import TorchDispatchMode

    shapes: list[tuple[int, ...]] = []

    class _Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.empty.memory_format and 0 not in args[0]:
                shapes.append(tuple(args[0]))
            return func(*args, **(kwargs or {}))

    with _Record():
        yield shapes


def sqnr_db(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.double().cpu(), out.double().cpu()
    return float(20 * torch.log10(ref.norm() / (ref - out).norm()))


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    assert torch.isfinite(out).all(), f"{what}: non-finite values (unwritten output?)"
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    err = float((out.float().cpu() - ref.float().cpu()).abs().max() / ref.float().abs().max().clamp_min(1e-30))
    s = sqnr_db(ref, out.float())
    assert err <= TOL[dtype] and s >= SQNR_FLOOR[dtype], (
        f"{what}: max error {err:.2e} (tol {TOL[dtype]:.0e}), SQNR {s:.1f} dB (floor {SQNR_FLOOR[dtype]} dB)")


def make_layer(n: int, k: int, group_size: int, symmetric: bool, seed: int, device: str = DEVICE):
    """RTN-quantized random weight: (codes, scales, zeros) in spear's layout."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    codes, scales, zeros = rtn(w, 4, group_size, symmetric)
    return codes.to(device), scales.to(torch.float16).to(device), zeros.to(device)


def make_ec(n: int, k: int, r: int, h: int | None, dtype: torch.dtype, seed: int, device: str = DEVICE):
    """Random EC parameters sized so the correction is a visible part of the output."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(r, k, generator=g) / k**0.5
    b = torch.randn(n, r, generator=g) * 0.05
    params = dict(a=a, b=b, alpha=0.75, dtype=dtype, bound=0.5)
    if h is not None:
        params.update(w1=torch.randn(h, r, generator=g) / r**0.5, b1=torch.randn(h, generator=g) * 0.1,
                      w2=torch.randn(r, h, generator=g) / h**0.5, b2=torch.randn(r, generator=g) * 0.1)
    return {key: (val.to(device) if torch.is_tensor(val) else val) for key, val in params.items()}


N_SMALL, K_SMALL = 96, 256  # N not a multiple of the 64-wide tile: exercises the column mask


def setup_case(m, k, n, gs, sym, dtype, seed, bias=True, ec=None, layout=None):
    """A packed random layer, activations, bias, packed EC (``make_ec``'s dict) and the fp32 reference output."""
    codes, scales, zeros = make_layer(n, k, gs, sym, seed)
    w = pack(codes, scales, zeros, gs, sym, layout=layout or Layout.NMAJOR)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    b = (torch.randn(n, generator=g) * 0.1).to(dtype).to(DEVICE) if bias else None
    e = pack_ec(**ec) if ec is not None else None
    # the reference reads the stored (fp16/bf16, zero-padded) EC parameters, as the kernels do
    expect = ref.w4a16_ec(x, codes, scales, zeros, gs, b,
                          *(() if e is None else (e.a, e.b, e.w1, e.b1, e.w2, e.b2, e.alpha, e.bound)))
    return x, w, b, e, expect


def capture(fn):
    """``fn()`` once eagerly (its kernels compile outside the capture), then captured in a CUDA
    graph: (the graph, the output tensor its replays rewrite)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out
