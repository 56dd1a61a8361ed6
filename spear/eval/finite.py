"""Where a forward pass stops being finite: the first module whose output holds a NaN/inf."""

from __future__ import annotations

import torch
from torch import nn


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    if isinstance(out, dict) or hasattr(out, "values"):
        try:
            return [t for o in out.values() for t in _tensors(o)]
        except TypeError:
            return []
    return []


@torch.no_grad()
def first_nonfinite_module(model: nn.Module, input_ids: torch.Tensor) -> str | None:
    """The qualified name of the first leaf module (in execution order) whose output is not finite on
    ``input_ids`` (1, L) or (n, L); ``None`` when the whole forward is finite."""
    found: list[str] = []

    def hook(name):
        def fn(_mod, _args, out):
            if not found and any(t.is_floating_point() and not torch.isfinite(t).all() for t in _tensors(out)):
                found.append(name)
        return fn

    # leaves plus every module with parameters of its own: the finest place the first NaN can show
    names = [(n, m) for n, m in model.named_modules()
             if n and (not list(m.children()) or any(True for _ in m.parameters(recurse=False)))]
    handles = [m.register_forward_hook(hook(n)) for n, m in names]
    device = next(model.parameters()).device
    try:
        out = model(input_ids=input_ids.to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    if found:
        return found[0]
    logits = getattr(out, "logits", None)
    if logits is not None and not torch.isfinite(logits).all():
        return "the output logits"
    return None
