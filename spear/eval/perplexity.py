"""Perplexity with the SPEAR.md §4 protocol.

Tokenizer-level, non-overlapping windows of ``seq_len``; every window scores its
``seq_len - 1`` next-token predictions; ppl = exp(mean NLL over all scored tokens).
A window whose loss is not finite stops the evaluation with an error naming the first
module whose output went non-finite (a NaN is never reported as a perplexity).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from spear.errors import SpearError


@dataclass(frozen=True)
class PerplexityResult:
    ppl: float
    nll: float  # mean negative log-likelihood per scored token (nats)
    tokens: int  # tokens scored
    windows: int
    seq_len: int

    def to_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def perplexity(model: torch.nn.Module, windows: torch.Tensor, batch_size: int = 1,
               progress: bool = True, desc: str = "perplexity") -> PerplexityResult:
    """Score ``windows`` (n, seq_len) token ids with ``model``; returns :class:`PerplexityResult`."""
    if windows.dim() != 2 or windows.shape[1] < 2:
        raise ValueError(f"windows must be (n, seq_len>=2), got {tuple(windows.shape)}")
    device = next(model.parameters()).device
    total, count = 0.0, 0
    bar = tqdm(total=windows.shape[0], desc=desc, unit="win", disable=not progress, leave=False)
    for start in range(0, windows.shape[0], batch_size):
        ids = windows[start:start + batch_size].to(device)
        logits = model(input_ids=ids, use_cache=False).logits
        nll = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                              reduction="sum")
        if not torch.isfinite(nll):
            from spear.eval.finite import first_nonfinite_module

            bar.close()
            where = first_nonfinite_module(model, ids)
            raise SpearError(f"{desc}: the loss of window {start} is not finite"
                             + (f"; the first non-finite output is {where}'s" if where else ""))
        total += nll.item()
        count += ids[:, 1:].numel()
        bar.update(ids.shape[0])
        bar.set_postfix(ppl=f"{math.exp(total / count):.2f}")
    bar.close()
    mean = total / count
    return PerplexityResult(ppl=math.exp(mean), nll=mean, tokens=count, windows=windows.shape[0],
                            seq_len=windows.shape[1])
