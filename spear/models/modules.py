"""Which modules of a model get quantized.

Architecture-generic: every ``nn.Linear`` inside the model, except the output head
(``lm_head`` / whatever ``get_output_embeddings`` returns) unless asked for.
"""

from __future__ import annotations

from torch import nn


def quantizable_linears(model: nn.Module, include_lm_head: bool = False) -> dict[str, nn.Linear]:
    """Ordered ``{qualified name: nn.Linear}`` of the linears spear quantizes."""
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
