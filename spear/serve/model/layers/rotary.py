"""Rotary tables (cos, sin) for every position up to the context, from the model's config.

The tables come from transformers' own rotary computation for the config (its ``rope_parameters``:
default, linear, llama3, yarn, ... scaling), evaluated once at load in fp32 and cast to the
activation dtype, exactly as transformers' Llama forward computes them per call; the engine then
indexes them by position.
"""

from __future__ import annotations

import torch


def rotary_tables(config, max_len: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (max_len, head_dim) in ``dtype``."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope = LlamaRotaryEmbedding(config).to(device)
    positions = torch.arange(max_len, device=device)[None]
    probe = torch.zeros((), dtype=torch.float32, device=device)
    with torch.no_grad():
        cos, sin = rope(probe, positions)  # fp32, as transformers computes them
    return cos[0].to(dtype), sin[0].to(dtype)
