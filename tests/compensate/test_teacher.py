"""The teacher taken from the sampling pass, and its cache beside the self-samples."""

import pytest
import torch

from spear.compensate.teacher import sample_with_teacher, top_k_of
from spear.data.selfsample import SampleConfig, sample_sequences
from spear.models.loading import load_model


def test_the_sampling_pass_gives_the_forward_teacher_and_the_same_sequences(sharp_tiny_llama_path, tmp_path,
                                                                            monkeypatch):
    """The logits recorded while sampling (one generation step per position, KV cache) against one
    forward pass over the finished sequences; the sequences against plain sampling, which draws one
    token fewer. Batches of 3 over 5 sequences: a short last batch.

    Catches: recording the logits after the min-length or top-p processors (EOS at -inf, the nucleus
    only: the top-k values differ), an off-by-one position (the teacher of position t from step t+1),
    or the extra step changing the draws before it."""
    monkeypatch.setenv("SPEAR_CACHE", str(tmp_path / "cache"))
    model, tok = load_model(sharp_tiny_llama_path)
    cfg = SampleConfig(n=5, length=10, top_p=0.9, seed=3, batch_size=3)
    plain = sample_sequences(model, tok, cfg, cache=False, progress=False)
    ids, teacher = sample_with_teacher(model, tok, cfg, top_k=7, progress=False, cache=False)
    assert torch.equal(ids, plain)
    assert teacher.shape == (5, 10, 7) and teacher.tail.shape == (5, 10)
    with torch.no_grad():
        ref = torch.log_softmax(model(input_ids=ids).logits.float(), -1)  # one forward pass, fp32
    # the recorded tokens carry the forward's log-probabilities (to fp16's precision) and are its top 7
    assert torch.allclose(ref.gather(-1, teacher.idx.long()), teacher.logp.float(), rtol=1e-3, atol=1e-4)
    assert torch.allclose(teacher.logp.float(), ref.topk(7, -1).values, rtol=1e-3, atol=1e-4)
    assert torch.allclose(teacher.tail, top_k_of(ref, 7).tail, atol=1e-4)


def test_the_teacher_cache(sharp_tiny_llama_path, tmp_path, monkeypatch):
    """A second call loads sequences and teacher without running the model; with only the sequences
    cached (another k), the teacher comes from a forward pass over them and equals the sampled one.

    Catches: a cache keyed without k (the k = 4 call would get the k = 6 teacher back)."""
    monkeypatch.setenv("SPEAR_CACHE", str(tmp_path / "cache"))
    model, tok = load_model(sharp_tiny_llama_path)
    cfg = SampleConfig(n=4, length=8, seed=1, batch_size=4)
    ids, teacher = sample_with_teacher(model, tok, cfg, top_k=6, progress=False)
    assert torch.equal(sample_sequences(model, tok, cfg, progress=False), ids)  # the sequences were cached too

    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    again, cached = sample_with_teacher(model, tok, cfg, top_k=6, progress=False)
    assert not calls and torch.equal(again, ids) and torch.equal(cached.logp, teacher.logp)
    four_ids, four = sample_with_teacher(model, tok, cfg, top_k=4, progress=False)
    assert calls and torch.equal(four_ids, ids) and four.shape == (4, 8, 4)
    assert torch.allclose(four.logp.float(), teacher.logp[..., :4].float(), rtol=1e-3, atol=1e-4)
    with pytest.raises(ValueError, match="top_k"):
        sample_with_teacher(model, tok, cfg, top_k=0, progress=False)
