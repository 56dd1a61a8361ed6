"""Next-token selection from a batch of logits: greedy, temperature, top-k, top-p, seeds.

The masks are pure functions on tensors (one row per sequence, each row with its
own k / p), so a batch with mixed settings is one call. Sampling draws from a
per-request ``torch.Generator`` when the request set a seed: the same seed and
prompt give the same text whatever else shares the batch.
"""

from __future__ import annotations

import torch

from spear.serve.core.messages import SamplingParams


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Set every logit below row ``i``'s ``top_k[i]``-th largest to -inf (ties kept; 0 = no cut)."""
    v = logits.shape[-1]
    k = torch.where(top_k <= 0, v, top_k.clamp(max=v)).to(torch.long)
    kth = logits.sort(dim=-1, descending=True).values.gather(-1, (k - 1)[:, None])
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches ``top_p[i]`` (nucleus)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # A token is dropped when the more likely ones already reach p; the first always stays.
    drop_sorted = mass_before >= top_p[:, None].to(probs.dtype)
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int | None]:
    """One token per row of ``logits`` (N, V), or None for a row that cannot be sampled (NaN or
    +inf in it, nothing but -inf, or settings the batch cannot hold): that request fails alone,
    the others of the batch are not touched. Greedy rows take the argmax; ``None`` generators
    draw from torch's default generator.

    The batch is sampled in one pass; should that raise (a row's settings, whatever the field),
    each row is sampled on its own and the rows that still raise give None."""
    if logits.shape[0] != len(params) or len(params) != len(generators):
        raise ValueError(f"need one SamplingParams and one generator per row; got {logits.shape[0]} rows, "
                         f"{len(params)} params, {len(generators)} generators")
    try:
        return _sample(logits, params, generators)
    except Exception:
        out: list[int | None] = []
        for i in range(logits.shape[0]):
            try:
                out += _sample(logits[i:i + 1], params[i:i + 1], generators[i:i + 1])
            except Exception:
                out.append(None)
        return out


def _sample(logits: torch.Tensor, params: list[SamplingParams],
            generators: list[torch.Generator | None]) -> list[int | None]:
    logits = logits.float()
    # torch's max propagates NaN, so one reduction gives the argmax and tells the bad rows apart;
    # argmax alone is 3x slower on the CPU (torch 2.13); the first index wins ties in both
    top, best = logits.max(dim=-1)
    ok = torch.isfinite(top)
    out: list[int | None] = [t if t >= 0 else None for t in torch.where(ok, best, -1).tolist()]
    rows = [i for i, p in enumerate(params) if not p.greedy and out[i] is not None]
    if not rows:
        return out
    # Shifted by the row's maximum before dividing: every scaled logit is <= 0 with one at 0, so
    # softmax neither overflows nor divides by zero at any temperature the params allow.
    index = torch.tensor(rows, device=logits.device)
    temps = torch.tensor([params[i].temperature for i in rows], dtype=torch.float32, device=logits.device)
    sub = (logits[index] - top[index, None]) / temps[:, None]
    # a cut beyond the vocabulary is no cut: clamped before the tensor, which holds 64-bit integers
    vocab = logits.shape[-1]
    top_k = torch.tensor([min(params[i].top_k, vocab) for i in rows], device=logits.device)
    if bool((top_k > 0).any()):
        sub = apply_top_k(sub, top_k)
    top_p = torch.tensor([params[i].top_p for i in rows], device=logits.device)
    if bool((top_p < 1).any()):
        sub = apply_top_p(sub, top_p)
    probs = sub.softmax(dim=-1)
    for j, i in enumerate(rows):
        gen = generators[i]
        row = probs[j] if gen is None or gen.device == probs.device else probs[j].to(gen.device)
        out[i] = int(torch.multinomial(row, 1, generator=gen))
    return out


def _mix64(seed: int) -> int:
    """SplitMix64's finalizer of ``seed`` (mod 2**64): every input bit moves every output bit."""
    z = seed % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return z ^ (z >> 31)


def make_generator(seed: int | None) -> torch.Generator | None:
    """A CPU generator for a seeded request (draws happen on a CPU copy of the row).

    torch's CPU generator (a Mersenne Twister) keeps only the low 32 bits of the seed it is given,
    so seeds that differ above them would draw the same stream: the 64-bit seed is mixed first and
    the generator takes the mix's high 32 bits."""
    return None if seed is None else torch.Generator().manual_seed(_mix64(seed) >> 32)
