"""KL-tuned norm weights (CalibrationConfig.tune_norms, spear/compensate/scales.py)."""

import json
from dataclasses import replace

import pytest
import torch

import spear.compensate.calibrate as calibrate_mod
from spear.compensate.calib_config import CalibrationConfig
from spear.compensate.calibrate import train_ecs
from spear.compensate.scales import norm_modules, tunable_norms
from spear.compensate.static import remove_compensators
from spear.compensate.workflow import attach_ecs, calibrate, calibrate_layerwise, prepare_calibration, uniform_plan
from spear.config import QuantConfig
from spear.errors import SpearError
from spear.models.loading import load_model
from spear.quant import quantize_model_rtn
from tests.compensate._tuning import cli_calibrate, cli_refuses_blockwise, fail_kl_on_call

# the ECs alone unless a test turns the tuning on
CFG = CalibrationConfig(n_samples=32, val_samples=4, sample_len=24, steps=16, batch_size=4, eval_every=4,
                        patience=5, lr=5e-3, norm_lr=1e-2, tune_scales=False, tune_norms=False)


@pytest.fixture(scope="module")
def prepared(sharp_tiny_llama_path, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPEAR_CACHE", str(tmp_path_factory.mktemp("cache")))
        model, tok = load_model(sharp_tiny_llama_path)
        return prepare_calibration(model, tok, CFG, progress=False)


@pytest.fixture()
def quantized(sharp_tiny_llama_path):
    model, _ = load_model(sharp_tiny_llama_path)
    mods = quantize_model_rtn(model, QuantConfig(bits=3, group_size=32), progress=False)
    return model, mods


def _norms(model):
    return {n: m.weight.detach().clone() for n, m in norm_modules(model).items()}


def test_norm_modules_are_every_rmsnorm(quantized):
    model, _ = quantized
    names = set(norm_modules(model))
    layers = len(model.model.layers)
    assert len(names) == 2 * layers + 1  # input, post-attention per layer, final
    assert "model.norm" in names and "model.layers.0.input_layernorm" in names


def test_off_leaves_norms_bit_identical(quantized, prepared):
    model, mods = quantized
    assert CalibrationConfig().tune_norms is True  # on in the default job; off here
    attach_ecs(mods, prepared.fp_weights, uniform_plan(mods, 2), CFG, prepared.stats)
    before = _norms(model)
    calibrate(model, prepared, CFG, progress=False)
    assert all(torch.equal(w, before[n]) for n, w in _norms(model).items())


def test_tuned_norms_lower_the_kl_and_change_every_norm(quantized, prepared):
    model, mods = quantized
    plan = uniform_plan(mods, 2)
    attach_ecs(mods, prepared.fp_weights, plan, CFG, prepared.stats)
    plain = calibrate(model, prepared, CFG, progress=False)
    remove_compensators(model)
    before = _norms(model)
    cfg = replace(CFG, tune_norms=True)
    attach_ecs(mods, prepared.fp_weights, plan, cfg, prepared.stats)
    keys = set(model.state_dict())
    tuned = calibrate(model, prepared, cfg, progress=False)
    assert tuned.initial_val_kl == pytest.approx(plain.initial_val_kl, rel=1e-6)
    assert tuned.best_val_kl < plain.best_val_kl
    after = _norms(model)
    assert all(not torch.equal(after[n], w) for n, w in before.items())
    assert set(model.state_dict()) == keys
    assert not any(p.requires_grad for p in model.parameters())
    # the best state is what stays loaded
    assert calibrate_mod.val_kl(model, prepared.val_ids, prepared.val_teacher, CFG.batch_size) == \
        pytest.approx(tuned.best_val_kl, rel=1e-4)


def test_an_exception_restores_the_norms(quantized, prepared, monkeypatch):
    model, mods = quantized
    attach_ecs(mods, prepared.fp_weights, uniform_plan(mods, 2), CFG, prepared.stats)
    before = _norms(model)
    calls = fail_kl_on_call(monkeypatch, 4)  # the initial validation KL and two training steps run, then it fails
    with pytest.raises(RuntimeError, match="boom"):
        train_ecs(model, prepared.train_ids, prepared.train_teacher, prepared.val_ids, prepared.val_teacher,
                  replace(CFG, tune_norms=True, tune_scales=True), progress=False)
    assert len(calls) == 4
    assert all(torch.equal(w, before[n]) for n, w in _norms(model).items())
    assert not any(p.requires_grad for p in model.parameters())


def test_context_manager_without_norms_and_config():
    with pytest.raises(ValueError, match="no RMSNorm"):
        with tunable_norms(torch.nn.Linear(2, 2)):
            pass
    with pytest.raises(SpearError, match="norm_lr"):
        CalibrationConfig(norm_lr=0.0)
    d = CalibrationConfig(tune_norms=True, norm_lr=3e-4).to_dict()
    assert d["tune_norms"] is True and json.loads(json.dumps(d)) == d


def test_blockwise_refuses(quantized, prepared):
    model, mods = quantized
    attach_ecs(mods, prepared.fp_weights, uniform_plan(mods, 2), CFG, prepared.stats)
    with pytest.raises(SpearError, match="tune_norms"):
        calibrate_layerwise(model, prepared, replace(CFG, tune_norms=True), progress=False)


def test_cli_tune_norms_checkpoint_keeps_the_tuned_norms(sharp_tiny_llama_path, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPEAR_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "ck"
    rc = cli_calibrate(sharp_tiny_llama_path, out, "--tune-norms", "--norm-lr", "1e-2")
    assert rc == 0
    assert "KL-tuned norms" in capsys.readouterr().out
    cal = json.loads((out / "spear_config.json").read_text())["meta"]["calibration"]
    assert cal["tune_norms"] is True and cal["norm_lr"] == 1e-2
    fp, _ = load_model(sharp_tiny_llama_path)
    tuned, _ = load_model(out)
    diff = [not torch.equal(_norms(fp)[n], w) for n, w in _norms(tuned).items()]
    assert any(diff)
    cli_refuses_blockwise(sharp_tiny_llama_path, tmp_path / "bw", "--tune-norms", capsys)


def test_pipeline_variants_start_from_the_same_norms(sharp_tiny_llama_path, article_text, tmp_path, monkeypatch):
    """run_job trains one variant after another on the same model: each must start from the
    original norm weights (and scales), not from the previous variant's tuned ones."""
    import spear.pipeline as pipeline
    from spear.config import EvalConfig

    monkeypatch.setenv("SPEAR_CACHE", str(tmp_path / "cache"))
    text = tmp_path / "wiki.test.raw"
    text.write_text(article_text)
    seen, real = [], pipeline.calibrate

    def recording(model, data, cfg, progress=True):
        seen.append(_norms(model))
        return real(model, data, cfg, progress=progress)

    monkeypatch.setattr(pipeline, "calibrate", recording)
    cfg = replace(CFG, n_samples=8, val_samples=2, sample_len=16, steps=4, tune_norms=True)
    result = pipeline.run_job(str(sharp_tiny_llama_path), QuantConfig(bits=3, group_size=32),
                              EvalConfig(text=str(text), seq_len=32, eval_windows=2, calib_windows=2), [], rank=1,
                              progress=False, log=lambda *_: None, spear_variants=("nogate", "gate"),
                              calib_cfg=cfg)
    assert len(seen) == 2 and all(torch.equal(seen[0][n], w) for n, w in seen[1].items())
    assert [r.details.get("tune_norms") for r in result.rows[2:]] == [True, True]
    assert all("tuned norms" in r.method for r in result.rows[2:])
