"""The self-sampler: its token draw against a nucleus computed by hand, and sequences that do not
depend on how they are batched."""

import pytest
import torch

from spear.data import selfsample
from spear.data.selfsample import SampleConfig, next_tokens, sample_sequences


def _by_hand(logits: torch.Tensor, u: float, temperature: float, top_p: float, banned=None) -> int:
    """One row: sort every token by probability (float64), keep those whose mass before them is below
    top_p, walk the renormalized cumulative sum to u; top_p = 1 walks the vocabulary in its order
    (no sort needed when every token is kept)."""
    z = logits.double() / temperature
    if banned is not None:
        z[banned] = float("-inf")
    p = torch.softmax(z, -1)
    order = sorted(range(len(p)), key=lambda i: -float(p[i])) if top_p < 1 else range(len(p))
    kept, before = [], 0.0
    for i in order:
        if before >= top_p:
            break
        kept.append(i)
        before += float(p[i])
    total = sum(float(p[i]) for i in kept)
    acc = 0.0
    for i in kept:
        acc += float(p[i]) / total
        if u < acc:
            return i
    return kept[-1]


@pytest.mark.parametrize("vocab, scale", [(50, 3.0), (3000, 0.3)])
def test_next_tokens_is_the_nucleus_inverse_cdf(vocab, scale, monkeypatch):
    """Rows against the hand reference at several u, temperatures and top-p, with a banned token.
    vocab 3000 with flat logits: the nucleus holds far more than the candidates, so every row takes
    the whole-vocabulary path (also with fewer candidates, below). Ties are avoided: random logits.

    Catches: keeping the token that crosses top_p out (``cum < top_p`` instead of ``cum - p < top_p``),
    or a whole-vocabulary row drawn among the candidates only."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, vocab, generator=g, dtype=torch.float64).float() * scale
    us = torch.tensor([0.0, 0.13, 0.5, 0.77, 0.95, 0.999])
    for candidates in (selfsample.NUCLEUS_CANDIDATES, 16):
        monkeypatch.setattr(selfsample, "NUCLEUS_CANDIDATES", candidates)
        for temperature, top_p in ((1.0, 0.95), (0.7, 0.5), (1.3, 1.0)):
            got = next_tokens(logits.clone(), us, temperature, top_p, banned=3)
            expect = [_by_hand(logits[r], float(us[r]), temperature, top_p, banned=3) for r in range(6)]
            assert got.tolist() == expect, (candidates, temperature, top_p)
            assert 3 not in got.tolist()


def test_next_tokens_draws_the_nucleus_distribution():
    """Frequencies of 40,000 draws against the renormalized nucleus probabilities."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.0, -1.0, -3.0]]).repeat(40_000, 1)
    u = torch.rand(40_000, generator=torch.Generator().manual_seed(1))
    got = torch.bincount(next_tokens(logits, u, top_p=0.8), minlength=6).double() / 40_000
    p = torch.softmax(logits[0].double(), -1)
    keep = torch.tensor([True, True, True, False, False, False])  # mass before token 3: 0.87 >= 0.8
    assert float(p[:2].sum()) < 0.8 <= float(p[:3].sum())
    expect = torch.where(keep, p, torch.zeros_like(p)) / p[keep].sum()
    assert torch.allclose(got, expect, atol=0.01), (got, expect)


def test_sequences_do_not_depend_on_the_batching(tiny_llama, tmp_path, monkeypatch):
    """Sequence i comes from its own generator: batches of 1, 2 or 5 give the same 5 sequences, and
    the first 3 of them are the 3-sequence set. In float64, so that differently batched forwards
    round alike (in float32 a near-flat random model's distribution can flip a draw).

    Catches: one generator per batch (the draws of a row then depend on the rows beside it)."""
    monkeypatch.setenv("SPEAR_CACHE", str(tmp_path))
    model, tok = tiny_llama
    model.double()
    runs = [sample_sequences(model, tok, SampleConfig(n=5, length=10, seed=4, batch_size=b), cache=False,
                             progress=False) for b in (1, 2, 5)]
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])
    three = sample_sequences(model, tok, SampleConfig(n=3, length=10, seed=4), cache=False, progress=False)
    assert torch.equal(three, runs[0][:3])
    assert len({tuple(r) for r in runs[0].tolist()}) == 5  # five different sequences


class _OlderSignature(torch.nn.Module):
    """The same model behind a forward of the older transformers signature: the key/value cache goes in
    and comes out as ``past_key_values`` (no ``cache`` argument, no ``cache`` attribute)."""

    def __init__(self, model):
        super().__init__()
        self.inner = model

    def forward(self, input_ids, past_key_values=None, use_cache=True, attention_mask=None):
        from types import SimpleNamespace

        kw = selfsample._cache_keyword(self.inner)
        out = self.inner(input_ids=input_ids, use_cache=use_cache, attention_mask=attention_mask, **{kw: past_key_values})
        return SimpleNamespace(logits=out.logits, past_key_values=getattr(out, kw))


def test_sampling_follows_the_cache_argument_of_the_model(tiny_llama):
    """A model whose forward names the cache ``past_key_values`` samples the same sequences as the
    model itself.

    Catches: the sampler passing ``cache=`` and reading ``out.cache`` whatever the model's signature
    (an AttributeError on transformers releases before the rename)."""
    model, tok = tiny_llama
    cfg = SampleConfig(n=3, length=9, seed=2)
    want = sample_sequences(model, tok, cfg, cache=False, progress=False)
    older = _OlderSignature(model)
    assert selfsample._cache_keyword(older) == "past_key_values"
    assert torch.equal(sample_sequences(older, tok, cfg, cache=False, progress=False), want)
