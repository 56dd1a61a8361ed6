"""Calibration settings that follow the model: the sizes by device, the teacher's form by vocabulary."""

from dataclasses import replace

import pytest

import torch

from spear.compensate.calib_config import (ACCELERATOR_SIZES, AUTO_TOP_K, CPU_SIZES, FULL_TEACHER_MAX_BYTES,
                                           MIN_AUTO_TOP_K, TOP_K_TEACHER_MAX_BYTES, CalibrationConfig)
from spear.compensate.teacher import TopKTeacher
from spear.compensate.workflow import prepare_calibration
from spear.errors import SpearError
from spear.models.loading import load_model


def test_teacher_bytes_by_hand():
    cfg = CalibrationConfig(n_samples=64, val_samples=16, sample_len=128, teacher_top_k=0)
    assert cfg.teacher_bytes(49_152) == 80 * 128 * 49_152 * 2  # fp16 log-probabilities
    top = CalibrationConfig(n_samples=64, val_samples=16, sample_len=128, teacher_top_k=64)
    assert top.teacher_bytes(262_144) == 80 * 128 * (64 * 6 + 4)  # fp16 values, int32 ids, fp32 tail


def test_the_sizes_follow_the_device(tiny_llama_path):
    """Catches: a GPU default applied on the CPU (an hour-long default job), a given size overridden, an unresolved
    size reaching the teacher's bound."""
    d = CalibrationConfig()
    assert (d.n_samples, d.steps) == (None, None)
    cpu, gpu = d.for_device("cpu"), d.for_device(torch.device("cuda", 0))
    assert (cpu.n_samples, cpu.steps) == CPU_SIZES == (512, 240)
    assert (gpu.n_samples, gpu.steps) == ACCELERATOR_SIZES == (2048, 960)
    assert cpu.for_device("cuda") == cpu  # resolved once, kept
    given = CalibrationConfig(n_samples=64, steps=10)
    assert given.for_device("cuda") == given
    assert (CalibrationConfig(steps=7).for_device("cuda").n_samples, CalibrationConfig(n_samples=7).for_device("cpu").steps) \
        == (2048, 240)
    model, _ = load_model(tiny_llama_path)
    assert (d.for_model(model).n_samples, d.for_model(model).steps) == CPU_SIZES
    with pytest.raises(SpearError, match="for_device"):
        d.for_vocab(49_152)
    with pytest.raises(SpearError, match="steps"):
        CalibrationConfig(steps=0)


def test_the_teacher_follows_the_vocabulary():
    d = CalibrationConfig().for_device("cpu")
    assert d.teacher_top_k is None
    assert (d.n_samples, d.val_samples, d.sample_len) == (512, 16, 128)
    # the default 528 x 128 self-samples of the default model (49,152 tokens): the full teacher would take
    # 6.6 GB, its top 4,096 take 1.66 GB
    assert replace(d, teacher_top_k=0).teacher_bytes(49_152) == 528 * 128 * 49_152 * 2
    assert d.for_vocab(49_152).teacher_top_k == AUTO_TOP_K == 4096
    assert d.for_vocab(49_152).teacher_bytes(49_152) == 528 * 128 * (4096 * 6 + 4)
    # 64 + 16 of them keep the full teacher: 0.94 GiB
    assert CalibrationConfig(n_samples=64).for_vocab(49_152).teacher_top_k == 0
    assert CalibrationConfig(n_samples=64).for_vocab(49_152).teacher_bytes(49_152) <= FULL_TEACHER_MAX_BYTES
    # a 262k vocabulary crosses the bound at 64 + 16 already (5.4 GB)
    assert CalibrationConfig(n_samples=64).for_vocab(262_144).teacher_top_k == AUTO_TOP_K
    assert CalibrationConfig(n_samples=64, teacher_top_k=0).teacher_bytes(262_144) > FULL_TEACHER_MAX_BYTES
    # more samples halve k to stay within the top-k bound: 1,040 x 128 the top 2,048 (1.64 GB, the top 4,096
    # would take 3.3 GB), the GPU's 2,064 x 128 the top 1,024 (1.62 GB; the measured default's);
    # never below MIN_AUTO_TOP_K
    assert CalibrationConfig(n_samples=1024).for_vocab(49_152).teacher_top_k == 2048
    gpu = CalibrationConfig().for_device("cuda").for_vocab(49_152)
    assert gpu.teacher_top_k == 1024
    assert gpu.teacher_bytes(49_152) == 2064 * 128 * (1024 * 6 + 4) <= TOP_K_TEACHER_MAX_BYTES
    assert replace(gpu, teacher_top_k=2048).teacher_bytes(49_152) > TOP_K_TEACHER_MAX_BYTES
    assert CalibrationConfig(n_samples=10**6).for_vocab(49_152).teacher_top_k == MIN_AUTO_TOP_K == 256
    # an explicit choice is kept whatever the vocabulary
    assert CalibrationConfig(n_samples=512, teacher_top_k=0).for_vocab(262_144).teacher_top_k == 0
    assert CalibrationConfig(n_samples=512, teacher_top_k=64).for_vocab(1000).teacher_top_k == 64
    # a vocabulary smaller than AUTO_TOP_K: k is the whole vocabulary (and not halved below the floor)
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
