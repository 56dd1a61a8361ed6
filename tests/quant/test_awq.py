from copy import deepcopy

import pytest
import torch

from spear.config import AWQConfig, CalibConfig, QuantConfig
from spear.errors import SpearError
from spear.quant.awq import (awq_quantize_weight, awq_search_clip, awq_search_scale, group_output_error,
                             quantize_model_awq)
from spear.quant.fold import rescale_reference
from spear.quant.primitives import dequantize

from .conftest import OnePlusNorm, make_tiny_llama

TEXT = CalibConfig(source="text", batch_size=4)


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("tie,kv_heads,fold_kv", [(False, 4, False), (True, 2, False), (True, 2, True)])
def test_scaling_leaves_the_unquantized_function_unchanged(rand_ids, tie, kv_heads, fold_kv):
    model = make_tiny_llama(tie=tie, kv_heads=kv_heads)
    ref = _logits(model, rand_ids)
    report = []
    cfg = QuantConfig(method="awq", calib=TEXT, awq=AWQConfig(fold_kv_heads=fold_kv))
    quantize_model_awq(model, cfg, rand_ids, progress=False, scale_only=True, report=report)
    torch.testing.assert_close(_logits(model, rand_ids), ref, rtol=1e-4, atol=1e-5)
    applied = {(r.producer, tuple(r.consumers)) for r in report if r.applied}
    assert ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")) in applied
    assert ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")) in applied
    assert ("mlp.up_proj", ("mlp.down_proj",)) in applied
    o_proj = [r for r in report if r.consumers == ["self_attn.o_proj"]]
    # v_proj -> o_proj folds when v has one output per o input, with grouped KV heads only when asked
    # (one scale per v_proj row, spread over the 2 attention heads that read it)
    assert o_proj and all(r.applied == (kv_heads == 4 or fold_kv) for r in o_proj)
    assert all(r.spread.repeat == (2 if fold_kv else 1) for r in o_proj)
    assert sum(r.alpha is not None and r.alpha > 0 for r in report) > 0  # scaling actually happened


def test_shared_norm_is_not_scaled(rand_ids):
    model = make_tiny_llama()
    layer = model.model.layers[0]
    model.model.layers[1].input_layernorm = layer.input_layernorm  # one norm used by two layers
    ref = _logits(model, rand_ids)
    report = []
    quantize_model_awq(model, QuantConfig(method="awq", calib=TEXT), rand_ids, progress=False,
                       scale_only=True, report=report)
    torch.testing.assert_close(_logits(model, rand_ids), ref, rtol=1e-4, atol=1e-5)
    skipped = [r for r in report if r.producer == "input_layernorm"]
    assert skipped and not any(r.applied for r in skipped)
    assert "shares its parameters" in skipped[0].reason


def test_non_linear_norm_fold_is_detected_and_reverted(rand_ids):
    torch.manual_seed(0)
    model = make_tiny_llama()
    for layer in model.model.layers:
        layer.post_attention_layernorm = OnePlusNorm(64)
    ref = _logits(model, rand_ids)
    report = []
    quantize_model_awq(model, QuantConfig(method="awq", calib=TEXT), rand_ids, progress=False,
                       scale_only=True, report=report)
    torch.testing.assert_close(_logits(model, rand_ids), ref, rtol=1e-4, atol=1e-5)
    mlp = [r for r in report if r.producer == "post_attention_layernorm"]
    assert len(mlp) == 2 and all(not r.applied and "changed the layer's output" in r.reason for r in mlp)


def _stats(seed=0, inp=64, tokens=512):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, inp, generator=g) * (torch.rand(inp, generator=g) * 4 + 0.1)
    x[:, :4] *= 20  # a few salient channels, the case AWQ is built for
    return x, x.T @ x / tokens, x.abs().mean(0)


def test_scale_search_never_loses_to_plain_rounding():
    x, h, mean_abs = _stats()
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    cfg = QuantConfig(method="awq", group_size=16)
    s, alpha = awq_search_scale([w], h, mean_abs, cfg)
    assert 0.0 <= alpha <= 1.0 and s.shape == (64,) and (s > 0).all()
    from spear.quant.awq import _fake_quant

    scaled = ((w - _fake_quant(w * s, cfg) / s) @ x.T).pow(2).mean()
    plain = ((w - _fake_quant(w, cfg)) @ x.T).pow(2).mean()
    assert scaled <= plain


def test_clip_search_lowers_each_groups_output_error():
    _, h, _ = _stats(seed=2)
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(3))
    w[0, 0] = 12.0  # an outlier weight that clipping should trade off
    cfg = QuantConfig(method="awq", group_size=16, symmetric=False)
    ratios = awq_search_clip(w, h, cfg)
    assert ratios.shape == (32, 4) and ((ratios >= 0.5) & (ratios <= 1.0)).all()
    codes, scales, zeros = awq_quantize_weight(w, h, cfg)
    clipped = group_output_error(w - dequantize(codes, scales, zeros, 16), h, 16)
    codes, scales, zeros = awq_quantize_weight(w, h, QuantConfig(method="awq", group_size=16, symmetric=False,
                                                                 awq=AWQConfig(clip=False)))
    plain = group_output_error(w - dequantize(codes, scales, zeros, 16), h, 16)
    assert (clipped <= plain * (1 + 1e-5) + 1e-6).all() and clipped.sum() < plain.sum()


@pytest.mark.parametrize("group_size", [0, 16])
def test_gptq_rounding_lowers_the_output_error_of_the_scaled_weight(group_size):
    """Catches: AWQ+GPTQ rounding that ignores the Hessian or the searched clipping. Against AWQ's own
    rounding of the same scaled weight and ranges, error feedback must lower tr(Δ H Δᵀ)."""
    x, _, _ = _stats(seed=6, tokens=1024)
    x = x @ (torch.eye(64) + 0.3 * torch.randn(64, 64, generator=torch.Generator().manual_seed(7)))  # correlated
    h = x.T @ x / x.shape[0]
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(8))
    errors = {}
    for rounding in ("rtn", "gptq"):
        cfg = QuantConfig(method="awq", group_size=group_size, awq=AWQConfig(rounding=rounding))
        codes, scales, zeros = awq_quantize_weight(w, h, cfg)
        assert codes.dtype == torch.uint8 and scales.dtype == torch.float16 and codes.shape == w.shape
        delta = w - dequantize(codes, scales, zeros, group_size)
        errors[rounding] = float(((delta @ h) * delta).sum())
    assert errors["gptq"] < 0.8 * errors["rtn"]
    assert QuantConfig(method="awq", awq=AWQConfig(rounding="gptq")).label.startswith("AWQ+GPTQ W4")
    cfg = QuantConfig(method="awq", awq=AWQConfig(rounding="gptq"))
    assert QuantConfig.from_dict(cfg.to_dict()) == cfg
    assert QuantConfig.from_dict({"method": "awq", "awq": {"grid": 20}}).awq.rounding == "rtn"  # older checkpoints


def test_group_output_error_matches_the_definition():
    x, h, _ = _stats(seed=4, inp=32, tokens=64)
    delta = torch.randn(8, 32, generator=torch.Generator().manual_seed(5))
    per_group = group_output_error(delta, h, 8)
    direct = torch.stack([((x[:, g * 8:(g + 1) * 8] @ delta[:, g * 8:(g + 1) * 8].T) ** 2).mean(0) for g in range(4)], 1)
    torch.testing.assert_close(per_group, direct, rtol=1e-4, atol=1e-4)


def test_bad_statistics_raise():
    torch.manual_seed(0)
    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match="statistics must be"):
        awq_search_scale([w], torch.eye(16), torch.ones(15), QuantConfig(method="awq"))
    with pytest.raises(ValueError, match="weights must be"):
        awq_search_scale([torch.randn(8, 12)], torch.eye(16), torch.ones(16), QuantConfig(method="awq"))
    with pytest.raises(SpearError, match="clip_min"):
        AWQConfig(clip_min=0.0)
    with pytest.raises(SpearError, match="rounding must be rtn or gptq"):
        AWQConfig(rounding="nearest")


def test_awq_model_and_reference_for_compensation(rand_ids):
    from spear.compensate.stats import collect_activation_stats
    from spear.models.modules import quantizable_linears, set_module
    from spear.quant.api import quantize_model

    model = make_tiny_llama()
    rtn = deepcopy(model)
    ref = _logits(model, rand_ids)
    targets = quantizable_linears(model)
    fp_weights = {n: m.weight.detach().clone() for n, m in targets.items()}
    stats = collect_activation_stats(model, targets, rand_ids, progress=False)
    scales: dict = {}
    modules = quantize_model(model, QuantConfig(method="awq", group_size=16, calib=TEXT), calib=rand_ids,
                             progress=False, channel_scales=scales)
    assert len(modules) == 14 and scales
    quantize_model(rtn, QuantConfig(group_size=16), progress=False)
    assert (_logits(model, rand_ids) - ref).pow(2).mean() < (_logits(rtn, rand_ids) - ref).pow(2).mean()
    # The compensation reference is what AWQ rounded: diag(s_out)⁻¹·W·diag(s_in), seeing x / s_in.
    weights, new_stats = rescale_reference(fp_weights, stats, scales)
    up = "model.layers.0.mlp.up_proj"  # a consumer (of the norm) and a producer (for down_proj)
    assert scales[up].input is not None and scales[up].output is not None
    want = fp_weights[up] * scales[up].input / scales[up].output.unsqueeze(1)
    torch.testing.assert_close(weights[up], want)
    torch.testing.assert_close(new_stats[up].abs_sum, stats[up].abs_sum / scales[up].input.double())
    for name, mod in modules.items():
        rel = (mod.dequantized_weight() - weights[name]).norm() / weights[name].norm()
        assert rel < 0.2, f"{name}: the reference is not the weight AWQ rounded (relative error {rel:.2f})"
    with torch.no_grad():  # the reference model computes the FP function
        for name, w in weights.items():
            lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
            lin.weight.copy_(w)
            set_module(model, name, lin)
    torch.testing.assert_close(_logits(model, rand_ids), ref, rtol=1e-4, atol=1e-5)


def test_quantizing_for_compensation_moves_every_reference_to_what_awq_rounded(rand_ids):
    """Catches: a caller (spear quantize, spear calibrate, spear run) that compensates an AWQ model
    against the unscaled FP weights: every reference handed over leaves at the weights AWQ rounded,
    statistics included; under RTN, which scales nothing, the references stay as they are."""
    from spear.compensate.stats import collect_activation_stats
    from spear.models.modules import quantizable_linears
    from spear.quant.api import Reference, quantize_for_compensation, quantize_model

    cfg = QuantConfig(method="awq", group_size=16, calib=TEXT)
    model = make_tiny_llama()
    twin = deepcopy(model)
    targets = quantizable_linears(model)
    fp_weights = {n: m.weight.detach().clone() for n, m in targets.items()}
    stats = collect_activation_stats(model, targets, rand_ids, progress=False)
    scales: dict = {}
    quantize_model(twin, cfg, calib=rand_ids, progress=False, channel_scales=scales)
    want_w, want_stats = rescale_reference(fp_weights, stats, scales)
    refs = [Reference(dict(fp_weights), stats), Reference(dict(fp_weights))]
    quantize_for_compensation(model, cfg, refs, calib=rand_ids, progress=False)
    for ref in refs:
        assert ref.fp_weights.keys() == want_w.keys()
        for name in want_w:
            torch.testing.assert_close(ref.fp_weights[name], want_w[name])
    assert refs[1].stats is None
    up = "model.layers.0.mlp.up_proj"
    torch.testing.assert_close(refs[0].stats[up].abs_sum, want_stats[up].abs_sum)
    plain = Reference(dict(fp_weights), stats)
    quantize_for_compensation(make_tiny_llama(), QuantConfig(group_size=16), [plain], progress=False)
    assert plain.stats is stats and all(plain.fp_weights[n] is fp_weights[n] for n in fp_weights)
