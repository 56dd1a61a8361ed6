"""Bytes of an EC and budgets ("1%" of the W4 model, or a byte count)."""

from __future__ import annotations

import re

from spear.compensate.registry import STORAGE_DTYPE

BYTES = STORAGE_DTYPE.itemsize


def ec_params(in_features: int, out_features: int, rank: int, hidden: int = 8, gated: bool = False,
              per_rank: bool = True) -> int:
    """Parameters + buffers of a :class:`~spear.compensate.ec.GatedCompensator` of this shape (the
    checkpoint's record of it, :class:`~spear.compensate.spec.CompensatorSpec`, counts them)."""
    if rank == 0:
        return 0
    from spear.compensate.spec import CompensatorSpec

    spec = CompensatorSpec("spear-ec", rank, hidden if gated else 0, gated, per_rank=per_rank)
    return spec.params(in_features, out_features)


def ec_bytes(in_features: int, out_features: int, rank: int, hidden: int = 8, gated: bool = False,
             per_rank: bool = True) -> int:
    """Bytes as stored and counted by :func:`spear.eval.memory.compensator_bytes`."""
    return BYTES * ec_params(in_features, out_features, rank, hidden, gated, per_rank)


def parse_budget(text: str | float | int, model_bytes: int) -> int:
    """``"1%"`` (of ``model_bytes``), ``"2.5MB"``/``"300KiB"``, or a plain byte count → bytes."""
    s = str(text).strip()
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*(%|[kKmMgG]i?[bB]|[bB])?", s)
    if not m:
        raise ValueError(f"budget must look like '1%', '2MB' or a byte count; got {text!r}")
    value, unit = float(m.group(1)), (m.group(2) or "b").lower()
    if unit == "%":
        if not 0 < value <= 100:
            raise ValueError(f"a percentage budget must be in (0, 100], got {s}")
        return int(value / 100 * model_bytes)
    scale = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30}[unit]
    out = int(value * scale)
    if out <= 0:
        raise ValueError(f"budget must be positive, got {s}")
    return out


def estimate_quantized_bytes(model, quant) -> int:
    """Bytes of ``model`` once quantized with ``quant``, counted as :func:`spear.eval.memory.quantized_model_bytes`
    counts them, computed from the FP model (a budget is known before quantizing)."""
    from spear.models.modules import quantizable_linears
    from spear.quant.primitives import n_groups, packed_nbytes

    targets = quantizable_linears(model, quant.include_lm_head)
    seen: set[int] = set()
    total = 0
    for lin in targets.values():
        g = n_groups(lin.in_features, quant.group_size)
        total += packed_nbytes(lin.out_features, lin.in_features, quant.bits) + lin.out_features * g * BYTES
        if not quant.symmetric:
            total += (lin.out_features * g * quant.bits + 7) // 8
        if lin.bias is not None:
            total += lin.bias.numel() * BYTES
        seen.update(id(p) for p in lin.parameters())
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * BYTES
    return total
