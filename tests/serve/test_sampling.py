"""Sampling masks against plain loops, seeded reproducibility, stop strings and incremental text."""

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from spear.serve.frontend.detokenizer import IncrementalDetokenizer
from spear.serve.core.sampling import apply_top_k, apply_top_p, make_generator, sample
from spear.serve.core.messages import SamplingParams


def ref_top_k(row: torch.Tensor, k: int) -> torch.Tensor:
    if k <= 0 or k >= row.numel():
        return torch.ones_like(row, dtype=torch.bool)
    kth = sorted(row.tolist(), reverse=True)[k - 1]
    return torch.tensor([v >= kth for v in row.tolist()])


def ref_top_p(row: torch.Tensor, p: float) -> torch.Tensor:
    probs = row.double().softmax(-1).tolist()
    keep = torch.zeros(len(probs), dtype=torch.bool)
    mass = 0.0
    for i in sorted(range(len(probs)), key=lambda i: -probs[i]):
        keep[i] = True
        mass += probs[i]
        if mass >= p:
            break
    return keep


@pytest.mark.parametrize("seed", range(5))
def test_top_k_mask_matches_reference(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, 50, generator=g)
    logits[0, :10] = 1.0  # ties at the cut are kept
    ks = torch.tensor([3, 0, 1, 50, 7, 60])
    kept = apply_top_k(logits, ks) > float("-inf")
    for i in range(6):
        assert torch.equal(kept[i], ref_top_k(logits[i], int(ks[i]))), i


@pytest.mark.parametrize("seed", range(5))
def test_top_p_mask_matches_reference(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(5, 40, generator=g) * 3
    ps = torch.tensor([0.1, 0.5, 0.9, 1.0, 0.999])
    kept = apply_top_p(logits.double(), ps) > float("-inf")
    for i in range(5):
        assert torch.equal(kept[i], ref_top_p(logits[i], float(ps[i]))), i
    assert (kept.sum(-1) >= 1).all()


def test_greedy_rows_take_the_argmax_and_seeds_reproduce():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 100, generator=g)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=3),
              SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=4), SamplingParams(temperature=0)]

    def draw():
        return sample(logits, params, [make_generator(p.seed) for p in params])

    first = draw()
    assert first[0] == int(logits[0].argmax()) and first[3] == int(logits[3].argmax())
    assert draw() == first
    # a seeded request draws the same tokens wherever it sits in the batch
    gens = [make_generator(3) for _ in range(2)]
    solo = [sample(logits[1:2], [params[1]], [gens[0]])[0] for _ in range(10)]
    mixed = [sample(logits[[0, 1]], [params[0], params[1]], [None, gens[1]])[1] for _ in range(10)]
    assert solo == mixed and len(set(solo)) > 1


def test_greedy_ties_take_the_first_index_as_argmax_does():
    logits = torch.zeros(3, 50000)
    logits[0, [7, 9000, 42000]] = 2.0      # ties far apart (across vectorized chunks)
    logits[1, [49999, 3]] = 1.0
    logits[2, 12345:12347] = 1e30
    greedy = [SamplingParams(temperature=0)] * 3
    assert sample(logits, greedy, [None] * 3) == logits.argmax(dim=-1).tolist() == [7, 3, 12345]


def test_sampling_respects_top_k():
    logits = torch.arange(50, dtype=torch.float32)[None]
    p = SamplingParams(temperature=5.0, top_k=3, seed=0)
    gen = make_generator(0)
    drawn = {sample(logits, [p], [gen])[0] for _ in range(200)}
    assert drawn <= {47, 48, 49} and len(drawn) > 1


@pytest.mark.parametrize("kw,message", [({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"),
                                        ({"top_p": 0}, "top_p"), ({"top_k": -2}, "top_k"), ({"stop": ("",)}, "stop")])
def test_bad_sampling_params(kw, message):
    from spear.serve.frontend.processor import InvalidRequest, check_params

    with pytest.raises(InvalidRequest, match=message) as e:
        check_params(SamplingParams(**kw))
    assert e.value.param == message


# ---------------------------------------------------------------------- text
def stream_text(tokenizer, text: str, stop=(), stream=True, prompt=(1, 2, 3)):
    ids = tokenizer(text, add_special_tokens=False).input_ids
    d = IncrementalDetokenizer(tokenizer, list(prompt), tuple(stop), stream=stream)
    # a prompt whose text (special tokens skipped, as the detokenizer decodes) ends inside a character
    cut = tokenizer.decode(list(prompt), skip_special_tokens=True,
                           clean_up_tokenization_spaces=False).endswith("\ufffd")
    assert (d._stream is not None) == (stream and not cut)  # the default tokenizer is a fast one
    deltas, stopped = [], False
    for t in ids:
        stopped = d.add(t)
        deltas.append(d.delta(final=stopped))
        if stopped:
            break
    deltas.append(d.delta(final=True))
    return d.text, deltas, stopped


@settings(max_examples=40, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=40))
def test_incremental_text_equals_whole_decode(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False).input_ids
    full, deltas, _ = stream_text(tokenizer, text)
    assert full == "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)


@settings(max_examples=40, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=40),
       st.lists(st.integers(0, 49151), max_size=8), st.sampled_from([(), ("e",), ("ab", "c d")]))
@example(text="0", prompt=[111, 0], stop=())  # a partial character, then a special token the decode skips
def test_rust_stream_equals_the_python_scheme(tokenizer, text, prompt, stop):
    """The tokenizers DecodeStream path hands out the same deltas, token by token, as the Python
    prefix/read-offset scheme, after any prompt (special tokens included) and with stop strings."""
    assert stream_text(tokenizer, text, stop, True, prompt) == stream_text(tokenizer, text, stop, False, prompt)


def test_stop_string_cuts_the_output_and_is_never_streamed(tokenizer):
    text, deltas, stopped = stream_text(tokenizer, "Hello world. The end of the story is near.", stop=["end of", "zzz"])
    assert stopped and text == "Hello world. The " and "".join(deltas) == text
    assert not any("end" in d for d in deltas)


def test_earliest_stop_string_wins(tokenizer):
    text, _, stopped = stream_text(tokenizer, "one two three four", stop=["four", "two"])
    assert stopped and text == "one "

class _OldStream:  # a tokenizers release whose DecodeStream takes only skip_special_tokens
    def __init__(self, skip_special_tokens=False):
        pass


# without prompt ids in DecodeStream, or without the tokenizers stream at all (the import failed)
@pytest.mark.parametrize("patch", [{"DecodeStream": _OldStream}, {"DecodeStream": None, "_RustTokenizer": None}])
def test_without_a_usable_stream_the_python_scheme_runs(tokenizer, monkeypatch, patch):
    from spear.serve.frontend import detokenizer

    for name, value in patch.items():
        monkeypatch.setattr(detokenizer, name, value)
    d = IncrementalDetokenizer(tokenizer, [1, 2, 3])
    assert d._stream is None
    ids = tokenizer("Hello wörld", add_special_tokens=False).input_ids
    for t in ids:
        d.add(t)
    assert d.delta(final=True) == tokenizer.decode(ids, skip_special_tokens=True)


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum())


@pytest.mark.parametrize("kw", [dict(temperature=0.7), dict(temperature=1.6), dict(temperature=1.0, top_k=3),
                                dict(temperature=0.9, top_p=0.8)])
def test_samples_follow_softmax_of_logits_over_temperature(kw):
    """6,000 seeded draws of one row against softmax(logits / T) (masked by top-k / top-p, as the
    references above define the masks): Pearson's chi-square under the 0.999 quantile of its
    distribution (df <= 5: 20.5). Catches: the temperature ignored or applied twice (chi-square in
    the thousands), the top-k / top-p mask not applied, a generator that is not the request's."""
    logits = torch.tensor([[2.0, 1.5, 0.2, -0.5, 0.9, -1.2]])
    n = 6_000
    params = SamplingParams(seed=11, **kw)
    gen = make_generator(params.seed)
    draws = [sample(logits, [params], [gen])[0] for _ in range(n)]
    counts = torch.bincount(torch.tensor(draws), minlength=6).double()
    scaled = logits[0].double() / params.temperature
    keep = torch.ones(6, dtype=torch.bool)
    if params.top_k:
        keep &= ref_top_k(scaled, params.top_k)
    if params.top_p < 1:
        keep &= ref_top_p(scaled, params.top_p)
    probs = torch.where(keep, scaled, torch.tensor(float("-inf"), dtype=torch.float64)).softmax(-1)
    assert counts[~keep].sum() == 0
    assert _chi_square(counts, probs) < 20.5
    # and a wrong temperature is far outside the bound, so the test can tell
    wrong = (logits[0].double() / (params.temperature * 1.5)).masked_fill(~keep, float("-inf")).softmax(-1)
    assert _chi_square(counts, wrong) > 60
