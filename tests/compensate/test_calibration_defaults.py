"""Calibration settings that follow the model: the teacher's form by vocabulary."""

from dataclasses import replace

import pytest

from spear.compensate.calibrate import AUTO_TOP_K, FULL_TEACHER_MAX_BYTES, CalibrationConfig, TopKTeacher
from spear.compensate.workflow import prepare_calibration
from spear.errors import SpearError
from spear.models.loading import load_model


def test_teacher_bytes_by_hand():
    cfg = CalibrationConfig(n_samples=64, val_samples=16, sample_len=128, teacher_top_k=0)
    assert cfg.teacher_bytes(49_152) == 80 * 128 * 49_152 * 2  # fp16 log-probabilities
    top = CalibrationConfig(n_samples=64, val_samples=16, sample_len=128, teacher_top_k=64)
    assert top.teacher_bytes(262_144) == 80 * 128 * (64 * 6 + 4)  # fp16 values, int32 ids, fp32 tail


def test_the_teacher_follows_the_vocabulary():
    d = CalibrationConfig()
    assert d.teacher_top_k is None
    assert (d.n_samples, d.val_samples, d.sample_len) == (512, 16, 128)
    # the default 528 x 128 self-samples of the default model (49,152 tokens): the full teacher would take
    # 6.6 GB, its top 4,096 take 1.66 GB
    assert CalibrationConfig(teacher_top_k=0).teacher_bytes(49_152) == 528 * 128 * 49_152 * 2
    assert d.for_vocab(49_152).teacher_top_k == AUTO_TOP_K == 4096
    assert d.for_vocab(49_152).teacher_bytes(49_152) == 528 * 128 * (4096 * 6 + 4)
    # 64 + 16 of them keep the full teacher: 0.94 GiB
    assert CalibrationConfig(n_samples=64).for_vocab(49_152).teacher_top_k == 0
    assert CalibrationConfig(n_samples=64).for_vocab(49_152).teacher_bytes(49_152) <= FULL_TEACHER_MAX_BYTES
    # a 262k vocabulary crosses the bound at 64 + 16 already (5.4 GB)
    assert CalibrationConfig(n_samples=64).for_vocab(262_144).teacher_top_k == AUTO_TOP_K
    assert CalibrationConfig(n_samples=64, teacher_top_k=0).teacher_bytes(262_144) > FULL_TEACHER_MAX_BYTES
    # an explicit choice is kept whatever the vocabulary
    assert CalibrationConfig(teacher_top_k=0).for_vocab(262_144).teacher_top_k == 0
    assert CalibrationConfig(teacher_top_k=64).for_vocab(1000).teacher_top_k == 64
    # a vocabulary smaller than AUTO_TOP_K: k is the whole vocabulary
    big = CalibrationConfig(n_samples=10_000_000)
    assert big.for_vocab(500).teacher_top_k == 500
    with pytest.raises(SpearError, match="teacher_top_k"):
        CalibrationConfig(teacher_top_k=-2)


def test_prepare_resolves_the_teacher_for_the_model(tiny_llama_path, tmp_path, monkeypatch):
    """Catches: prepare_calibration ignoring the config's limit (the full teacher at any vocabulary)."""
    monkeypatch.setenv("SPEAR_CACHE", str(tmp_path))
    model, tok = load_model(tiny_llama_path)
    cfg = CalibrationConfig(n_samples=4, val_samples=2, sample_len=12)
    full = prepare_calibration(model, tok, cfg, progress=False)
    assert not isinstance(full.train_teacher, TopKTeacher)
    assert full.train_teacher.shape == (4, 12, model.config.vocab_size)
    # as if the vocabulary were huge: a limit below the full teacher's bytes
    top = prepare_calibration(model, tok, replace(cfg, full_teacher_max_bytes=1000), progress=False)
    assert isinstance(top.train_teacher, TopKTeacher)
    assert top.train_teacher.shape == (4, 12, AUTO_TOP_K)
