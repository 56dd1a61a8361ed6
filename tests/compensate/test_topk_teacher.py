"""The sparse (top-k) teacher: its KL against the dense one, and calibration with it."""

import math

import pytest
import torch
import torch.nn.functional as F

from spear.compensate.calib_config import CalibrationConfig
from spear.compensate.calibrate import kl_loss
from spear.compensate.teacher import TopKTeacher, teacher_logprobs
from spear.compensate.workflow import attach_ecs, calibrate, prepare_calibration, uniform_plan
from spear.config import QuantConfig
from spear.errors import SpearError
from spear.models.loading import load_model
from spear.quant import quantize_model_rtn


def _sparse(teacher_logits: torch.Tensor, k: int) -> TopKTeacher:
    lp = F.log_softmax(teacher_logits.float(), -1)
    top, idx = lp.topk(k, -1)
    return TopKTeacher(top.half(), idx.int(), torch.log1p(-top.exp().sum(-1).clamp(max=1 - 1e-7)))


def test_full_k_equals_the_dense_kl_and_small_k_is_the_coarsened_kl():
    g = torch.Generator().manual_seed(0)
    t_logits = torch.randn(3, 5, 40, generator=g) * 3
    s_logits = torch.randn(3, 5, 40, generator=g) * 3
    dense = kl_loss(s_logits, F.log_softmax(t_logits, -1).half())
    assert torch.allclose(kl_loss(s_logits, _sparse(t_logits, 40)), dense, rtol=2e-3)
    # k = 4: the KL of both distributions coarsened to (the teacher's 4 tokens, the rest)
    sp = _sparse(t_logits, 4)
    p, q = F.softmax(t_logits, -1), F.softmax(s_logits, -1)
    idx = sp.idx.long()
    p4, q4 = p.gather(-1, idx), q.gather(-1, idx)
    pc = torch.cat([p4, 1 - p4.sum(-1, keepdim=True)], -1)
    qc = torch.cat([q4, 1 - q4.sum(-1, keepdim=True)], -1)
    expect = (pc * (pc.log() - qc.log())).sum(-1).mean()
    got = kl_loss(s_logits, sp)
    assert torch.allclose(got, expect, rtol=5e-3), (got, expect)
    # coarsening never increases a KL (data processing), and it is zero for identical models
    assert got <= dense + 1e-4
    assert abs(float(kl_loss(t_logits, sp))) < 1e-3


def test_sparse_kl_has_the_dense_gradient_on_a_peaked_teacher():
    g = torch.Generator().manual_seed(1)
    t_logits = torch.randn(2, 6, 64, generator=g)
    t_logits[..., :3] += 12.0  # almost all mass on three tokens
    s = (torch.randn(2, 6, 64, generator=g)).requires_grad_(True)
    kl_loss(s, F.log_softmax(t_logits, -1).half()).backward()
    dense_grad = s.grad.clone()
    s.grad = None
    kl_loss(s, _sparse(t_logits, 8)).backward()
    cos = F.cosine_similarity(dense_grad.flatten(), s.grad.flatten(), dim=0)
    assert cos > 0.999, float(cos)


def test_teacher_logprobs_top_k_matches_the_dense_teacher(sharp_tiny_llama_path):
    model, _ = load_model(sharp_tiny_llama_path)
    ids = torch.randint(0, 100, (3, 12), generator=torch.Generator().manual_seed(2))
    dense = teacher_logprobs(model, ids, batch_size=2, progress=False)
    sp = teacher_logprobs(model, ids, batch_size=2, progress=False, top_k=16)
    assert sp.logp.shape == (3, 12, 16) and sp.idx.dtype == torch.int32 and sp.tail.shape == (3, 12)
    assert torch.equal(sp.logp, dense.topk(16, -1).values)
    mass = sp.logp.float().exp().sum(-1) + sp.tail.exp()
    assert torch.allclose(mass, torch.ones_like(mass), atol=2e-3)
    assert len(sp[1:]) == 2 and sp[torch.tensor([0, 2])].idx.shape == (2, 12, 16)


def test_calibration_with_a_top_k_teacher_lowers_the_full_kl(sharp_tiny_llama_path, tmp_path, monkeypatch):
    monkeypatch.setenv("SPEAR_CACHE", str(tmp_path / "cache"))
    model, tok = load_model(sharp_tiny_llama_path)
    cfg = CalibrationConfig(n_samples=8, val_samples=4, sample_len=24, steps=20, batch_size=4, eval_every=5,
                            patience=5, lr=5e-3, teacher_top_k=8, tune_scales=False, tune_norms=False)
    data = prepare_calibration(model, tok, cfg, progress=False)
    assert isinstance(data.train_teacher, TopKTeacher) and data.train_teacher.logp.shape[-1] == 8
    dense_val = teacher_logprobs(model, data.val_ids, progress=False)
    mods = quantize_model_rtn(model, QuantConfig(bits=3), progress=False)
    attach_ecs(mods, data.fp_weights, uniform_plan(mods, 2), cfg, data.stats)

    def full_kl():
        with torch.no_grad():
            return float(kl_loss(model(input_ids=data.val_ids).logits, dense_val))

    before = full_kl()
    report = calibrate(model, data, cfg, progress=False)
    assert report.best_val_kl < report.initial_val_kl
    assert full_kl() < 0.95 * before  # trained on 8 tokens + rest, the full KL falls too


def test_top_k_must_be_non_negative():
    with pytest.raises(SpearError, match="teacher_top_k"):
        CalibrationConfig(teacher_top_k=-1)
    assert math.isfinite(CalibrationConfig(teacher_top_k=0).lr)
