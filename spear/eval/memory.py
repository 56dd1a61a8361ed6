"""Memory accounting (SPEAR.md §4).

Memory % = extra bytes of the compensators ÷ bytes of the quantized model, where the
quantized model counts packed integer codes, fp16 scales, packed zero points (only
when asymmetric), and every other parameter in fp16 (tied tensors once).
"""

from __future__ import annotations

from torch import nn

from spear.quant.linear import QuantLinear
from spear.quant.primitives import packed_nbytes

FP16_BYTES = 2


def quantized_model_bytes(model: nn.Module) -> int:
    total = 0
    seen: set[int] = set()
    for module in model.modules():
        if isinstance(module, QuantLinear):
            total += packed_nbytes(module.out_features, module.in_features, module.bits)
            total += module.scales.numel() * FP16_BYTES
            if not module.symmetric:
                total += (module.zeros.numel() * module.bits + 7) // 8
            if module.bias is not None:
                total += module.bias.numel() * FP16_BYTES
            seen.update(id(t) for t in module.parameters())
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel() * FP16_BYTES
    return total


def compensator_bytes(model: nn.Module) -> int:
    """Bytes of every compensator's tensors (parameters and buffers) in their storage dtype (fp16)."""
    total = 0
    for module in model.modules():
        if isinstance(module, QuantLinear) and module.compensator is not None:
            comp = module.compensator
            n = sum(p.numel() for p in comp.parameters()) + sum(b.numel() for b in comp.buffers())
            total += n * FP16_BYTES
    return total
