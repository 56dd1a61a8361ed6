"""Compensator kinds a checkpoint can hold, by the name it records."""

from __future__ import annotations

import torch
from torch import nn

from spear.compensate.ec import GatedCompensator
from spear.compensate.lowrank import LowRankCompensator
from spear.errors import SpearError

# Compensator tensors are stored (and counted, and checkpointed) in fp16; a fresh
# initialisation is rounded to it once so that a saved model equals the live one.
STORAGE_DTYPE = torch.float16


def as_stored(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` rounded to the storage dtype, returned in ``dtype``."""
    return t.to(STORAGE_DTYPE).to(dtype)


def stored_checked(t: torch.Tensor, dtype: torch.dtype, what: str) -> torch.Tensor:
    """:func:`as_stored`, raising a SpearError naming ``what`` when the rounding leaves a non-finite value."""
    out = as_stored(t, dtype)
    if not torch.isfinite(out).all():
        big = t.detach().abs().max().item()
        raise SpearError(f"{what} is not finite in {str(STORAGE_DTYPE).replace('torch.', '')} "
                         f"(largest magnitude {big:.3g}; the format holds up to {torch.finfo(STORAGE_DTYPE).max:g})")
    return out


# Every kind a checkpoint can hold. The compensator modules know nothing of this table (the import runs
# one way: registry -> kinds), so a new kind is added here.
COMPENSATOR_KINDS: dict[str, type[nn.Module]] = {cls.kind: cls for cls in (LowRankCompensator, GatedCompensator)}


def compensator_spec(comp: nn.Module) -> dict:
    return {"kind": comp.kind, **comp.spec()}


def build_compensator(spec: dict, in_features: int, out_features: int, device=None, dtype=None) -> nn.Module:
    spec = dict(spec)
    kind = spec.pop("kind", None)
    cls = COMPENSATOR_KINDS.get(kind)
    if cls is None:
        raise SpearError(f"unknown compensator kind {kind!r}; known: {sorted(COMPENSATOR_KINDS)}")
    try:
        return cls.empty(in_features, out_features, device=device, dtype=dtype, **spec)
    except TypeError as exc:
        raise SpearError(f"compensator {kind!r} spec {spec} does not fit: {exc}") from exc
