"""Which modules of a model get quantized.

Architecture-generic: every ``nn.Linear`` inside the model, except the output head
(``lm_head`` / whatever ``get_output_embeddings`` returns) unless asked for. GPT-2-style
models compute their projections with transformers' ``Conv1D`` (``x @ W + b`` with W
stored (in, out)); :func:`linearize_conv1d` swaps each for the equivalent ``nn.Linear``
(W transposed) so every quantizer, compensator and checkpoint sees one layout.
"""

from __future__ import annotations

import torch
from torch import nn


def _conv1d_type():
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # transformers absent: no Conv1D can be in the model
        return None
    return Conv1D


@torch.no_grad()
def linearize_conv1d(model: nn.Module) -> int:
    """Replace every transformers ``Conv1D`` in ``model`` by the same map as an ``nn.Linear``, in place.

    Works on real and meta tensors (a checkpoint's empty shell). Returns how many were replaced.
    """
    conv1d = _conv1d_type()
    if conv1d is None:
        return 0
    found = [(n, m) for n, m in model.named_modules() if isinstance(m, conv1d)]
    for name, conv in found:
        w = conv.weight  # (in, out)
        lin = nn.Linear(w.shape[0], w.shape[1], bias=conv.bias is not None, device=w.device, dtype=w.dtype)
        if w.device.type != "meta":
            lin.weight.copy_(w.T)
            if conv.bias is not None:
                lin.bias.copy_(conv.bias)
        lin.weight.requires_grad_(w.requires_grad)
        set_module(model, name, lin)
    return len(found)


def quantizable_linears(model: nn.Module, include_lm_head: bool = False) -> dict[str, nn.Linear]:
    """Ordered ``{qualified name: nn.Linear}`` of the linears spear quantizes (``Conv1D`` made linear first)."""
    linearize_conv1d(model)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    out = {}
    for name, module in model.named_modules():
        if type(module) is not nn.Linear:
            continue
        if module is head and not include_lm_head:
            continue
        out[name] = module
    return out


def set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Replace the submodule at dotted path ``name``."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def module_kind(name: str) -> str:
    """The module's type within its block (``q_proj``, ``down_proj``…): the last name part."""
    return name.rsplit(".", 1)[-1]
