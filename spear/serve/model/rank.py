"""One way to build a rank of the engine: its share of the model, its KV cache and its runner.

    rank = build_rank(model_config, quantized, tensors, config, tp, device, dtype, agree)

Rank 0 (the engine, spear/serve/core/engine.py) and the tensor-parallel workers (spear/serve/model/workers.py)
both call it, with the same ``EngineConfig`` and their own ``TPRank``; they differ only in how the
ranks agree on the KV cache (``agree``): every rank holds the same number of blocks, the fewest
any rank can, and rank 0 decides the context length from them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from spear.errors import SpearError
from spear.parallel.shard import TPRank
from spear.serve.config import EngineConfig

if TYPE_CHECKING:  # the runner module imports the kernels: only when a rank is built
    from spear.serve.model.model_runner import ModelRunner

log = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 8192


@dataclass
class Rank:
    """A built rank: ``comm`` its collectives (None with one rank), ``load_report`` the quantized
    layers that run off the kernel path on CUDA, with the reason."""

    model: torch.nn.Module
    runner: ModelRunner
    num_blocks: int
    max_model_len: int
    load_report: list[tuple[str, str]]
    comm: object | None = None


def max_model_len(model_config, config: EngineConfig, num_blocks: int) -> int:
    """The context length: ``config.max_model_len`` if the model, its KV cache and its sliding
    window allow it (else a SpearError naming the limit), by default the smallest of them, at most
    ``DEFAULT_MAX_MODEL_LEN``."""
    capacity = num_blocks * config.block_size
    limits = {"max_position_embeddings": getattr(model_config, "max_position_embeddings", None)
              or DEFAULT_MAX_MODEL_LEN, "KV cache capacity": capacity}
    window = getattr(model_config, "sliding_window", None)
    if window and getattr(model_config, "use_sliding_window", True):
        limits["sliding_window"] = window  # attention here is full; stay inside the window
    if config.max_model_len is None:
        return min(min(limits.values()), DEFAULT_MAX_MODEL_LEN)
    for name, limit in limits.items():
        if config.max_model_len > limit:
            raise SpearError(f"max_model_len {config.max_model_len} exceeds the model's {name} ({limit})")
    return config.max_model_len


def alone(model_config, config: EngineConfig) -> Callable[[int], tuple[int, int]]:
    """The agreement of a single rank: its own blocks, the context they allow."""
    return lambda blocks: (blocks, max_model_len(model_config, config, blocks))


def build_rank(model_config, quantized, tensors, config: EngineConfig, tp: TPRank, device: torch.device,
               dtype: torch.dtype, agree: Callable[[int], tuple[int, int]]) -> Rank:
    """Rank ``tp.rank``'s model share (which takes ``tensors`` over), KV cache and runner.
    ``agree(blocks this rank can hold)`` returns the (blocks, context length) every rank uses;
    with several ranks the process group must be formed already."""
    from spear.kernels.layout import MAX_RANK
    from spear.serve.model.llama import build_model
    from spear.serve.model.model_runner import ModelRunner, local_blocks

    model, report = build_model(model_config, quantized, tensors, device, dtype, MAX_RANK, tp=tp)
    if device.type == "cuda":  # an attention kernel that cannot take the model's shapes is said once, here
        from spear.serve.model.layers.attention import PagedAttention

        attn = next((m for m in model.modules() if isinstance(m, PagedAttention)), None)
        if attn is not None:
            report = report + attn.kernel_fallbacks(config.block_size, dtype)
    num_blocks, context = agree(local_blocks(model_config, config.block_size, dtype, device, config.kv_memory,
                                             config.num_blocks, tp.size))
    comm = None
    if tp.size > 1:
        from spear.parallel.comm import make_comm

        comm = make_comm(tp, config.tp_reduce, device, dtype, config.tp_timeout_s)
        model.set_comm(comm)
    runner = ModelRunner(model, config, num_blocks, context)
    return Rank(model, runner, num_blocks, context, report, comm)
