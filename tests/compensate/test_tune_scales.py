"""KL-tuned quantization scales (CalibrationConfig.tune_scales, spear/compensate/scales.py)."""

import json
from dataclasses import replace

import pytest
import torch

import spear.compensate.calibrate as calibrate_mod
from spear.compensate.calib_config import CalibrationConfig
from spear.compensate.calibrate import train_ecs
from spear.compensate.scales import tunable_scales
from spear.compensate.static import remove_compensators
from spear.compensate.workflow import attach_ecs, calibrate, calibrate_layerwise, prepare_calibration, uniform_plan
from spear.config import QuantConfig
from spear.errors import SpearError
from spear.models.loading import load_model
from spear.quant import quantize_model_rtn
from spear.quant.linear import QuantLinear
from spear.quant.primitives import dequantize
from tests.compensate._tuning import cli_calibrate, cli_refuses_blockwise, fail_kl_on_call

# the ECs alone unless a test turns the tuning on
CFG = CalibrationConfig(n_samples=32, val_samples=4, sample_len=24, steps=16, batch_size=4, eval_every=4,
                        patience=5, lr=5e-3, scale_lr=1e-2, tune_scales=False, tune_norms=False)


@pytest.fixture(scope="module")
def prepared(sharp_tiny_llama_path, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPEAR_CACHE", str(tmp_path_factory.mktemp("cache")))
        model, tok = load_model(sharp_tiny_llama_path)
        return prepare_calibration(model, tok, CFG, progress=False)


@pytest.fixture()
def quantized(sharp_tiny_llama_path, prepared):
    """A fresh W3 g32 RTN copy of the sharp tiny Llama and its QuantLinears."""
    model, _ = load_model(sharp_tiny_llama_path)
    mods = quantize_model_rtn(model, QuantConfig(bits=3, group_size=32), progress=False)
    return model, mods


def _scales(mods):
    return {n: m.scales.clone() for n, m in mods.items()}


def _plain(model):
    """No trace of the tuning machinery on any QuantLinear."""
    return all("base_forward" not in m.__dict__ and m._weight_cache is None
               for m in model.modules() if isinstance(m, QuantLinear))


def test_off_leaves_scales_bit_identical(quantized, prepared):
    model, mods = quantized
    assert CalibrationConfig().tune_scales is True  # on in the default job; off here
    attach_ecs(mods, prepared.fp_weights, uniform_plan(mods, 2), CFG, prepared.stats)
    before = _scales(mods)
    calibrate(model, prepared, CFG, progress=False)
    assert all(torch.equal(mods[n].scales, s) for n, s in before.items())


def test_tuned_scales_lower_the_kl_and_change_the_scales(quantized, prepared):
    model, mods = quantized
    plan = uniform_plan(mods, 2)
    attach_ecs(mods, prepared.fp_weights, plan, CFG, prepared.stats)
    plain = calibrate(model, prepared, CFG, progress=False)
    remove_compensators(model)
    before = _scales(mods)
    cfg = replace(CFG, tune_scales=True)
    attach_ecs(mods, prepared.fp_weights, plan, cfg, prepared.stats)
    keys = set(model.state_dict())
    tuned = calibrate(model, prepared, cfg, progress=False)
    assert tuned.initial_val_kl == pytest.approx(plain.initial_val_kl, rel=1e-6)  # same start
    assert tuned.best_val_kl < plain.best_val_kl
    assert all(mods[n].scales.dtype == torch.float16 for n in before)
    assert sum(not torch.equal(mods[n].scales, s) for n, s in before.items()) == len(before)  # every module tuned
    assert set(model.state_dict()) == keys and _plain(model)
    assert not any(p.requires_grad for p in model.parameters())
    # the reported best validation KL is the folded model's (up to fp16 rounding of the scales)
    assert calibrate_mod.val_kl(model, prepared.val_ids, prepared.val_teacher, CFG.batch_size) == \
        pytest.approx(tuned.best_val_kl, rel=2e-2)


@pytest.mark.parametrize("group_size", [0, 32])
def test_folding_is_exact_and_leaves_a_plain_quantlinear(sharp_tiny_llama_path, group_size):
    model, _ = load_model(sharp_tiny_llama_path)
    mods = quantize_model_rtn(model, QuantConfig(bits=4, group_size=group_size), progress=False)
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    keys = set(model.state_dict())
    names = {n for n, _ in model.named_parameters()}
    with torch.no_grad():
        base_logits = model(input_ids=ids).logits
    with tunable_scales(model) as sf:
        assert set(model.state_dict()) == keys and {n for n, _ in model.named_parameters()} == names
        assert set(sf.factors) == set(mods)
        assert all(sf.factors[n].shape == m.scales.shape and sf.factors[n].dtype == torch.float32
                   for n, m in mods.items())
        with torch.no_grad():  # t = 0: the plain model (per channel: scaled after the product, so up to rounding)
            start = model(input_ids=ids).logits
            if group_size:
                assert torch.equal(start, base_logits)
            else:
                torch.testing.assert_close(start, base_logits, rtol=1e-5, atol=1e-5)
        # the weight is recomputed from t: a gradient reaches every factor
        model(input_ids=ids).logits.logsumexp(-1).mean().backward()
        assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in sf.factors.values())
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for t in sf.factors.values():
                t.copy_(0.05 * torch.randn(t.shape, generator=g))
            tuned_logits = model(input_ids=ids).logits
        folded = {n: sf.folded_scales(n) for n in mods}
    for n, m in mods.items():
        assert torch.equal(m.scales, folded[n])
        assert m.scales.dtype == torch.float16
    assert set(model.state_dict()) == keys and {n for n, _ in model.named_parameters()} == names and _plain(model)
    # reference: plain QuantLinears that dequantize with the folded fp16 scales
    ref_model, _ = load_model(sharp_tiny_llama_path)
    ref_mods = quantize_model_rtn(ref_model, QuantConfig(bits=4, group_size=group_size), progress=False)
    for n, m in ref_mods.items():
        m.set_quantized(m.codes, folded[n], m.zeros)
        assert torch.equal(m.dequantized_weight(), dequantize(mods[n].codes, folded[n], mods[n].zeros, group_size))
    with torch.no_grad():
        folded_logits = model(input_ids=ids).logits
        assert torch.equal(folded_logits, ref_model(input_ids=ids).logits)
    # the tuned (fp32 scales) and folded (fp16 scales) models differ by fp16 rounding only
    rel = (folded_logits - tuned_logits).norm() / tuned_logits.norm()
    assert 0 < rel < 2e-3, float(rel)
    assert (folded_logits - base_logits).norm() / base_logits.norm() > 10 * rel


def test_an_exception_in_training_leaves_the_model_untouched(quantized, prepared, monkeypatch):
    model, mods = quantized
    attach_ecs(mods, prepared.fp_weights, uniform_plan(mods, 2), CFG, prepared.stats)
    before = _scales(mods)
    keys = set(model.state_dict())
    calls = fail_kl_on_call(monkeypatch, 4)  # the initial validation KL and two training steps run, then it fails
    with pytest.raises(RuntimeError, match="boom"):
        train_ecs(model, prepared.train_ids, prepared.train_teacher, prepared.val_ids, prepared.val_teacher,
                  replace(CFG, tune_scales=True), progress=False)
    assert len(calls) == 4
    assert all(torch.equal(mods[n].scales, s) for n, s in before.items())
    assert set(model.state_dict()) == keys and _plain(model)


def test_scales_only_calibration(quantized, prepared):
    model, mods = quantized
    with pytest.raises(SpearError, match="no error compensators"):
        calibrate(model, prepared, CFG, progress=False)
    before = _scales(mods)
    report = calibrate(model, prepared, replace(CFG, tune_scales=True), progress=False)
    assert report.best_val_kl < 0.98 * report.initial_val_kl and report.best_step > 0
    assert any(not torch.equal(mods[n].scales, s) for n, s in before.items())
    assert _plain(model)


def test_config_and_blockwise_refusal(quantized, prepared):
    with pytest.raises(SpearError, match="scale_lr"):
        CalibrationConfig(scale_lr=0.0)
    d = CalibrationConfig(tune_scales=True, scale_lr=3e-3).to_dict()
    assert d["tune_scales"] is True and d["scale_lr"] == 3e-3 and json.loads(json.dumps(d)) == d
    model, mods = quantized
    attach_ecs(mods, prepared.fp_weights, uniform_plan(mods, 2), CFG, prepared.stats)
    with pytest.raises(SpearError, match="tune_scales"):
        calibrate_layerwise(model, prepared, replace(CFG, tune_scales=True), progress=False)


def test_cli_tune_scales_writes_a_plain_checkpoint(sharp_tiny_llama_path, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPEAR_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "ck"
    rc = cli_calibrate(sharp_tiny_llama_path, out, "--tune-scales", "--scale-lr", "1e-2")
    assert rc == 0
    assert "0 ECs" in capsys.readouterr().out
    cal = json.loads((out / "spear_config.json").read_text())["meta"]["calibration"]
    assert cal["tune_scales"] is True and cal["scale_lr"] == 1e-2
    model, _ = load_model(out)
    assert isinstance(model.model.layers[0].mlp.down_proj, QuantLinear)
    cli_refuses_blockwise(sharp_tiny_llama_path, tmp_path / "bw", "--tune-scales", capsys)


@pytest.mark.parametrize("symmetric", [True, False])
def test_per_channel_scales_scale_the_output_as_the_dequantized_weight_would(sharp_tiny_llama_path, symmetric):
    """Per-channel scales take the output-scaling form: the same outputs and the same scale
    gradients as ``x · dequantize(codes, scales · exp(t), zeros)ᵀ`` (+ bias), in fp32 and bf16.
    Catches: a scale applied to the wrong axis, the zero point dropped, the bias scaled, the
    factor's gradient lost."""
    model, _ = load_model(sharp_tiny_llama_path)
    mods = quantize_model_rtn(model, QuantConfig(bits=4, group_size=0, symmetric=symmetric), progress=False)
    name, mod = next((n, m) for n, m in mods.items() if m.out_features != m.in_features)
    mod.bias = torch.nn.Parameter(torch.randn(mod.out_features, generator=torch.Generator().manual_seed(2)),
                                  requires_grad=False)
    x = torch.randn(3, 5, mod.in_features, generator=torch.Generator().manual_seed(0))
    t0 = 0.1 * torch.randn(mod.scales.shape, generator=torch.Generator().manual_seed(1))
    grad_out = torch.randn(3, 5, mod.out_features, generator=torch.Generator().manual_seed(3))
    with tunable_scales(model) as tuner:
        t = tuner.factors[name]
        with torch.no_grad():
            t.copy_(t0)
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
            t.grad = None
            got = mod.base_forward(x.to(dtype))
            assert got.dtype == dtype
            (got.float() * grad_out).sum().backward()
            got_grad = t.grad.clone()
            ref_t = t0.clone().requires_grad_(True)
            w = dequantize(mod.codes, mod.scales.float() * ref_t.exp(), mod.zeros, 0, torch.float32)
            want = torch.nn.functional.linear(x.to(dtype).float(), w.to(dtype).float(), mod.bias.to(dtype).float())
            (want * grad_out).sum().backward()
            torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * want.abs().max().item())
            torch.testing.assert_close(got_grad, ref_t.grad, rtol=tol * 10, atol=tol * 10 * ref_t.grad.abs().max().item())
