"""Data-free calibration text: sequences sampled from the FP model itself.

N sequences of L tokens, each starting at the tokenizer's BOS token, sampled with
temperature and nucleus (top-p) sampling under a fixed seed; end-of-sequence is
suppressed so every sequence has exactly L tokens. Results are cached on disk
(safetensors, atomic write) keyed by a fingerprint of the model's weights and
every sampling setting, so GPTQ/AWQ, selection and KL calibration share them.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from spear.config import SampleConfig
from spear.errors import SpearError


def model_fingerprint(model: nn.Module) -> str:
    """A cheap, stable hash of the model's config and weights (strided sums of every tensor)."""
    h = hashlib.sha1()
    cfg = getattr(model, "config", None)
    if cfg is not None:
        h.update(cfg.to_json_string(use_diff=False).encode())
    with torch.no_grad():
        for name, t in model.state_dict().items():
            flat = t.detach().reshape(-1)
            step = max(1, flat.numel() // 4096)
            h.update(f"{name}:{tuple(t.shape)}:{flat[::step].double().sum().item():.12e}".encode())
    return h.hexdigest()[:16]


def _cache_path(model: nn.Module, cfg: SampleConfig) -> Path:
    from spear.models.loading import cache_dir

    settings = {k: v for k, v in asdict(cfg).items() if k != "batch_size"}
    key = hashlib.sha1(json.dumps([model_fingerprint(model), settings], sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "selfsample" / f"{key}.safetensors"


@torch.no_grad()
def _sample_batch(model, bos: int, eos: int | None, n: int, cfg: SampleConfig, seed: int) -> torch.Tensor:
    device = next(model.parameters()).device
    ids = torch.full((n, 1), bos, dtype=torch.long, device=device)
    # generate() samples from the global RNG: seed it inside a fork so the
    # caller's random state is untouched and every batch is reproducible.
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=cfg.temperature,
            top_p=cfg.top_p, top_k=0, max_new_tokens=cfg.length - 1, min_new_tokens=cfg.length - 1,
            pad_token_id=eos if eos is not None else bos, eos_token_id=eos)
    return out[:, : cfg.length].cpu()


def sample_sequences(model: nn.Module, tokenizer, cfg: SampleConfig = SampleConfig(), cache: bool = True,
                     progress: bool = True) -> torch.Tensor:
    """``(cfg.n, cfg.length)`` int64 token ids sampled from ``model`` (cached on disk)."""
    from safetensors.torch import load_file, save_file

    path = _cache_path(model, cfg) if cache else None
    if path is not None and path.is_file():
        return load_file(str(path))["ids"]
    bos = tokenizer.bos_token_id
    if bos is None:
        bos = tokenizer.eos_token_id
    if bos is None:
        raise SpearError("self-sampling needs a BOS (or EOS) token in the tokenizer")
    was_training = model.training
    model.eval()
    chunks = []
    try:
        for i, start in enumerate(tqdm(range(0, cfg.n, cfg.batch_size), desc="self-sampling", unit="batch",
                                       disable=not progress, leave=False)):
            n = min(cfg.batch_size, cfg.n - start)
            chunks.append(_sample_batch(model, bos, tokenizer.eos_token_id, n, cfg, cfg.seed * 100003 + i))
    finally:
        model.train(was_training)
    ids = torch.cat(chunks)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        os.close(fd)
        try:
            save_file({"ids": ids.contiguous()}, tmp, metadata={"config": json.dumps(asdict(cfg))})
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return ids
