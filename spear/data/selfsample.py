"""Data-free calibration text: sequences sampled from the FP model itself.

N sequences of L tokens, each starting at the tokenizer's BOS token, sampled with
temperature and nucleus (top-p) sampling under a fixed seed; end-of-sequence is
suppressed so every sequence has exactly L tokens. Results are cached on disk
(safetensors, atomic write) keyed by a fingerprint of the model's weights and
every sampling setting, so GPTQ/AWQ, selection and KL calibration share them.

With ``on_logits`` the FP model's next-token logits are handed out as they are computed
(the calibration's teacher comes out of the sampling pass instead of a second forward
pass over every sequence): generation then runs one more step, for the last position's
logits, and the sequences are the same as without it.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from spear.errors import SpearError


@dataclass(frozen=True)
class SampleConfig:
    n: int = 64
    length: int = 128
    temperature: float = 1.0
    top_p: float = 0.95
    seed: int = 0
    batch_size: int = 16

    def __post_init__(self):
        if self.n < 1 or self.length < 2 or self.batch_size < 1:
            raise SpearError(f"self-sampling needs n>=1, length>=2, batch_size>=1; got {self}")
        if self.temperature <= 0:
            raise SpearError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SpearError(f"top_p must be in (0, 1], got {self.top_p}")


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


def cached_samples(model: nn.Module, cfg: SampleConfig) -> torch.Tensor | None:
    """The cached ``(cfg.n, cfg.length)`` self-samples of ``model``, or None if not cached."""
    from safetensors.torch import load_file

    path = _cache_path(model, cfg)
    return load_file(str(path))["ids"] if path.is_file() else None


@torch.no_grad()
def _sample_batch(model, bos: int, eos: int | None, n: int, cfg: SampleConfig, seed: int,
                  on_logits: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
    device = next(model.parameters()).device
    ids = torch.full((n, 1), bos, dtype=torch.long, device=device)
    # One more step yields the logits after the last kept token; the extra token is dropped. Every
    # step before it draws from the same generator state as without it, so the sequences are unchanged.
    new = cfg.length - (on_logits is None)
    handle = None
    if on_logits is not None:
        # the head's output at each step, before any logits processor (min-length, top-p) touches it
        handle = model.get_output_embeddings().register_forward_hook(
            lambda mod, args, out: on_logits(out[:, -1]))
    # generate() samples from the global RNG: seed it inside a fork so the
    # caller's random state is untouched and every batch is reproducible.
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=cfg.temperature,
                top_p=cfg.top_p, top_k=0, max_new_tokens=new, min_new_tokens=new,
                pad_token_id=eos if eos is not None else bos, eos_token_id=eos)
    finally:
        if handle is not None:
            handle.remove()
    return out[:, : cfg.length].cpu()


def sample_sequences(model: nn.Module, tokenizer, cfg: SampleConfig = SampleConfig(), cache: bool = True,
                     progress: bool = True,
                     on_logits: Callable[[int, torch.Tensor], None] | None = None) -> torch.Tensor:
    """``(cfg.n, cfg.length)`` int64 token ids sampled from ``model`` (cached on disk).

    ``on_logits(start, logits)``, if given, receives for every batch of sequences ``start …`` and every
    position in order the model's next-token logits ``(batch, vocab)``; the sequences are then always
    sampled (a cached copy is not read, the new one is written)."""
    from safetensors.torch import load_file, save_file

    path = _cache_path(model, cfg) if cache else None
    if path is not None and path.is_file() and on_logits is None:
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
            hook = None if on_logits is None else (lambda logits, start=start: on_logits(start, logits))
            chunks.append(_sample_batch(model, bos, tokenizer.eos_token_id, n, cfg, cfg.seed * 100003 + i, hook))
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
