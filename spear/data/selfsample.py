"""Data-free calibration text: sequences sampled from the FP model itself.

N sequences of L tokens, each starting at the tokenizer's BOS token, sampled with
temperature and nucleus (top-p) sampling under a fixed seed; end-of-sequence is
suppressed so every sequence has exactly L tokens. Results are cached on disk
(safetensors, atomic write) keyed by a fingerprint of the model's weights and
every sampling setting, so GPTQ/AWQ, selection and KL calibration share them.

The sampler is a plain loop over the model with its KV cache (no ``generate()``): each
sequence draws its tokens by inverse CDF from a generator of its own, seeded by (seed,
sequence index), so sequence i is the same whatever n and the batch size (up to the
floating-point rounding of a differently batched forward), and the first n of a larger set
are the smaller set. The nucleus is found among the 1024 most likely tokens and only rows
whose nucleus reaches beyond them sort the whole vocabulary: a full sort of a 49k
vocabulary per row and step cost more than the model's forward pass at batch 16.

With ``on_logits`` the FP model's next-token logits are handed out as they are computed
(the calibration's teacher comes out of the sampling pass instead of a second forward
pass over every sequence): the loop then runs one more step, for the last position's
logits; the sequences are the same as without it.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import tempfile
from collections.abc import Callable
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


# Part of the cache key: sequences another sampler drew (transformers' generate() before it) are not reused.
SAMPLER = "inverse-cdf per sequence, v2"
# The nucleus is searched among this many most likely tokens first (see the module docstring).
NUCLEUS_CANDIDATES = 1024


def _cache_path(model: nn.Module, cfg: SampleConfig) -> Path:
    from spear.models.loading import cache_dir

    settings = {k: v for k, v in asdict(cfg).items() if k != "batch_size"}
    key = hashlib.sha1(json.dumps([model_fingerprint(model), settings, SAMPLER],
                                  sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "selfsample" / f"{key}.safetensors"


def cached_samples(model: nn.Module, cfg: SampleConfig) -> torch.Tensor | None:
    """The cached ``(cfg.n, cfg.length)`` self-samples of ``model``, or None if not cached."""
    from safetensors.torch import load_file

    path = _cache_path(model, cfg)
    return load_file(str(path))["ids"] if path.is_file() else None


def next_tokens(logits: torch.Tensor, u: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0,
                banned: int | None = None) -> torch.Tensor:
    """Tokens drawn from ``softmax(logits / temperature)`` restricted to its nucleus (the most likely
    tokens whose mass before them is below ``top_p``), without the token ``banned``, by inverse CDF
    with one uniform number ``u`` (n,) in [0, 1) per row of ``logits`` (n, vocab)."""
    z = logits.float() / temperature
    if banned is not None:
        z[:, banned] = float("-inf")
    p = torch.softmax(z, dim=-1)
    n, vocab = p.shape
    out = torch.empty(n, dtype=torch.long, device=p.device)
    if top_p >= 1:  # the whole distribution, in vocabulary order
        cum = p.cumsum(-1)
        j = torch.searchsorted(cum, (u.to(cum) * cum[:, -1])[:, None], right=True)[:, 0]
        return j.clamp(max=vocab - 1)
    top, idx = p.topk(min(NUCLEUS_CANDIDATES, vocab), dim=-1)  # sorted, most likely first
    short = top.sum(-1) < top_p  # the nucleus reaches beyond the candidates: sort those rows whole
    rows = [(slice(None), top, idx)] if not short.any() else \
        [(~short, top[~short], idx[~short]), (short, *p[short].sort(-1, descending=True))]
    for sel, t, i in rows:
        if t.shape[0] == 0:
            continue
        cum = t.cumsum(-1)
        last = ((cum - t) < top_p).sum(-1, keepdim=True) - 1  # the nucleus: every token before it below top_p
        mass = cum.gather(-1, last)
        j = torch.searchsorted(cum, u.to(cum)[sel][:, None] * mass, right=True).minimum(last)
        out[sel] = i.gather(-1, j)[:, 0]
    return out


def _cache_keyword(model) -> str:
    """The name transformers gives the key/value cache, in the forward's arguments and its output:
    ``cache`` in the newest releases, ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def _sample_batch(model, bos: int, eos: int | None, rows: range, cfg: SampleConfig,
                  on_logits: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
    device = next(model.parameters()).device
    n = len(rows)
    gens = [torch.Generator().manual_seed(cfg.seed * 1_000_003 + r) for r in rows]
    ids = torch.full((n, cfg.length), bos, dtype=torch.long)
    cur, past = ids[:, :1].to(device), None
    cache_kw = _cache_keyword(model)
    # One more step yields the logits after the last kept token (for on_logits); it draws nothing.
    for t in range(cfg.length if on_logits is not None else cfg.length - 1):
        out = model(input_ids=cur, use_cache=True, **{cache_kw: past},
                    attention_mask=torch.ones(n, t + 1, dtype=torch.long, device=device))
        past, logits = getattr(out, cache_kw), out.logits[:, -1]
        if on_logits is not None:
            on_logits(logits)
        if t == cfg.length - 1:
            break
        u = torch.cat([torch.rand(1, generator=g) for g in gens])
        ids[:, t + 1] = next_tokens(logits, u, cfg.temperature, cfg.top_p, eos).cpu()
        cur = ids[:, t + 1:t + 2].to(device)
    return ids


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
        for start in tqdm(range(0, cfg.n, cfg.batch_size), desc="self-sampling", unit="batch",
                          disable=not progress, leave=False):
            n = min(cfg.batch_size, cfg.n - start)
            hook = None if on_logits is None else (lambda logits, start=start: on_logits(start, logits))
            chunks.append(_sample_batch(model, bos, tokenizer.eos_token_id, range(start, start + n), cfg, hook))
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
