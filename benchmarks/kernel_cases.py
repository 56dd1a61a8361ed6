"""The random layers and compensators the kernel benchmarks time (bench_kernels.py and its
``--tune`` mode, bench_kernels_tune.py): RTN 4-bit, group 128, asymmetric, random non-zero
weights, with enough copies of each weight to stream it from HBM on every call."""

from __future__ import annotations

import torch

from kernel_timing import copies_for
from spear.kernels import reference
from spear.kernels.layout import Layout, pack, pack_ec
from spear.kernels.dequant import dequantize
from spear.quant.primitives import rtn

MODELS = {  # hidden, intermediate
    "Llama-3.2-1B": (2048, 8192),
    "Llama-2-7B": (4096, 11008),
    "Llama-3-8B": (4096, 14336),
    "Llama-2-13B": (5120, 13824),
}
HIDDEN = 32
DEVICE = "cuda"
GROUP = 128


def layer_shapes(models):
    """Unique (N, K) per model: q and o share one shape."""
    out = []
    for name in models:
        h, i = MODELS[name]
        out += [(name, "q/o", h, h), (name, "gate_up", 2 * i, h), (name, "down", h, i)]
    return out


# ----------------------------------------------------------------------------- layers
class Layer:
    """One quantized random layer and the copies each variant rotates through."""

    def __init__(self, n, k, l2, with_int4, seed=0, layout=Layout.FRAGMENT):
        g = torch.Generator(device=DEVICE).manual_seed(seed)
        w = torch.randn(n, k, device=DEVICE, generator=g) * 0.02
        self.codes, self.scales, self.zeros = rtn(w, 4, GROUP, symmetric=False)
        self.scales = self.scales.half()
        del w
        self.n, self.k, self.layout = n, k, layout
        base = pack(self.codes, self.scales, self.zeros, GROUP, layout=layout)
        w4_bytes = sum(t.numel() * t.element_size() for t in (base.qweight, base.scales, base.zeros))
        self.w4 = [base] + [pack(self.codes, self.scales, self.zeros, GROUP, layout=layout)
                            for _ in range(copies_for(w4_bytes, l2) - 1)]
        w16 = dequantize(base, torch.float16)
        self.fp16 = [w16] + [w16.clone() for _ in range(copies_for(w16.numel() * 2, l2) - 1)]
        self.int4 = []
        if with_int4:
            self.int4 = [self._int4pack() for _ in range(copies_for(w4_bytes, l2))]

    def _int4pack(self):
        # torch's layout: w = (q - 8) * scale + zero, with zero = (8 - z) * scale for our (q - z) * scale
        q = self.codes.to(torch.int32)
        packed = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
        w = torch._convert_weight_to_int4pack(packed, 8)
        s = self.scales.float()
        zf = (8.0 - self.zeros.float()) * s
        sz = torch.stack([s, zf], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        return w, sz

    def reference(self, x, e=None):
        args = () if e is None else (e.a, e.b, e.w1, e.b1, e.w2, e.b2, e.alpha, e.bound)
        return reference.w4a16_ec(x, self.codes, self.scales, self.zeros, GROUP, None, *args)


def make_ec(n, k, r, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed + r)
    dev = dict(device=DEVICE, generator=g)
    return pack_ec(torch.randn(r, k, **dev) / k**0.5, torch.randn(n, r, **dev) * 0.02, 0.5, torch.float16,
                   torch.randn(HIDDEN, r, **dev) / r**0.5, torch.randn(HIDDEN, **dev) * 0.1,
                   torch.randn(r, HIDDEN, **dev) / HIDDEN**0.5, torch.randn(r, **dev) * 0.1, bound=0.5)
