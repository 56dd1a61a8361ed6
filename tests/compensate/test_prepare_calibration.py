"""What prepare_calibration hands the training: the statistics of the first stats_samples
self-samples, the self-samples in the order the selection would draw them, and a validation
teacher that is the full distribution whenever it fits."""

import torch

from spear.compensate.calib_config import CalibrationConfig
from spear.compensate.stats import collect_activation_stats
from spear.compensate.teacher import TopKTeacher, teacher_logprobs
from spear.compensate.workflow import prepare_calibration
from spear.models.loading import load_model
from spear.models.modules import quantizable_linears
from spear.select.plan import damage_ids


def test_statistics_from_the_first_stats_samples_and_the_selection_sees_the_same_samples(tiny_llama_path, tmp_path,
                                                                                          monkeypatch):
    """The statistics against a separate pass over the first 3 training self-samples (and not all 6);
    ``sample_ids`` against the sequences damage scoring draws for the same settings.

    Catches: stats_samples ignored (statistics of every training sample), or sample_ids in another
    order than the sampling run's (validation first): the selection would score other sequences
    than it does when it draws them itself."""
    monkeypatch.setenv("SPEAR_CACHE", str(tmp_path))
    model, tok = load_model(tiny_llama_path)
    cfg = CalibrationConfig(n_samples=6, val_samples=2, sample_len=12, stats_samples=3, teacher_top_k=0)
    data = prepare_calibration(model, tok, cfg, progress=False)
    targets = quantizable_linears(model)
    first = collect_activation_stats(model, targets, data.train_ids[:3], progress=False)
    every = collect_activation_stats(model, targets, data.train_ids, progress=False)
    assert set(data.stats) == set(first)
    for name, st in data.stats.items():
        assert st.count == first[name].count == 3 * 12
        assert torch.allclose(st.sq_sum, first[name].sq_sum) and torch.allclose(st.abs_sum, first[name].abs_sum)
    assert any(not torch.allclose(data.stats[n].mean_sq, every[n].mean_sq) for n in data.stats)

    assert data.sample_ids.shape == (8, 12)
    assert torch.equal(data.sample_ids[:6], data.train_ids) and torch.equal(data.sample_ids[6:], data.val_ids)
    assert torch.equal(damage_ids(model, tok, 5, calib=cfg, progress=False), data.sample_ids[:5])


def test_top_k_training_teacher_with_a_full_validation_teacher_where_it_fits(tiny_llama_path, tmp_path, monkeypatch):
    """With a top-5 teacher: the training teacher is the top 5 of a forward pass over the training
    self-samples; the validation teacher is that forward pass's whole distribution while it fits
    full_teacher_max_bytes, and top 5 too when it does not.

    Catches: validation judged on the top-k bound although the full teacher fits, or the full
    validation teacher built whatever its size."""
    monkeypatch.setenv("SPEAR_CACHE", str(tmp_path))
    model, tok = load_model(tiny_llama_path)
    cfg = CalibrationConfig(n_samples=4, val_samples=2, sample_len=10, teacher_top_k=5)
    data = prepare_calibration(model, tok, cfg, progress=False)
    with torch.no_grad():
        ref = torch.log_softmax(model(input_ids=data.sample_ids).logits.float(), -1)
    assert isinstance(data.train_teacher, TopKTeacher) and data.train_teacher.shape == (4, 10, 5)
    assert torch.allclose(data.train_teacher.logp.float(), ref[:4].topk(5, -1).values, rtol=1e-3, atol=1e-4)
    assert not isinstance(data.val_teacher, TopKTeacher)
    assert data.val_teacher.shape == (2, 10, model.config.vocab_size)
    assert torch.allclose(data.val_teacher.float(), ref[4:], rtol=1e-3, atol=1e-3)
    assert torch.allclose(data.val_teacher.float(), teacher_logprobs(model, data.val_ids, progress=False).float())

    small = CalibrationConfig(n_samples=4, val_samples=2, sample_len=10, teacher_top_k=5, full_teacher_max_bytes=1000)
    tight = prepare_calibration(model, tok, small, progress=False)
    assert torch.equal(tight.sample_ids, data.sample_ids)
    assert isinstance(tight.val_teacher, TopKTeacher) and tight.val_teacher.shape == (2, 10, 5)
    assert torch.allclose(tight.val_teacher.logp.float(), ref[4:].topk(5, -1).values, rtol=1e-3, atol=1e-4)
