import pytest
import torch

from spear.config import CalibConfig, GPTQConfig, QuantConfig
from spear.errors import SpearError
from spear.quant.gptq import gptq_quantize_weight
from spear.quant.primitives import dequantize
from spear.quant.rtn import rtn_quantize_linear


def _problem(seed=0, out=48, inp=64, tokens=1024):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g)
    # Correlated inputs with uneven channel scales: where error feedback pays off.
    x = torch.randn(tokens, inp, generator=g) @ torch.randn(inp, inp, generator=g) * 0.3
    x = x * torch.rand(inp, generator=g) * 3
    return w, x, x.T @ x / tokens


def _output_error(w, w_hat, x):
    return ((x @ (w - w_hat).T) ** 2).mean().item()


def _rtn_weight(w, cfg):
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight.data.copy_(w)
    return rtn_quantize_linear(lin, cfg).dequantized_weight()


@pytest.mark.parametrize("group_size", [0, 16])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_beats_rtn_on_its_calibration_inputs(group_size, symmetric, act_order):
    w, x, h = _problem()
    cfg = QuantConfig(bits=4, group_size=group_size, symmetric=symmetric, method="gptq",
                      gptq=GPTQConfig(act_order=act_order, block_size=24))
    codes, scales, zeros = gptq_quantize_weight(w, h, cfg)
    assert codes.dtype == torch.uint8 and scales.dtype == torch.float16 and zeros.dtype == torch.uint8
    assert codes.shape == w.shape and scales.shape == (48, 1 if group_size == 0 else 64 // group_size)
    assert int(codes.max()) <= 15
    if symmetric:
        assert (zeros == 8).all()
    gptq_err = _output_error(w, dequantize(codes, scales, zeros, group_size), x)
    rtn_err = _output_error(w, _rtn_weight(w, cfg), x)
    assert gptq_err < 0.7 * rtn_err


def test_act_order_static_groups_use_the_original_group_ranges():
    w, _, h = _problem(seed=3)
    cfg = QuantConfig(group_size=16, method="gptq", gptq=GPTQConfig(act_order=True))
    _, scales, _ = gptq_quantize_weight(w, h, cfg)
    expected = w.reshape(48, 4, 16).abs().amax(-1) / 7  # static groups: from the unmodified weights
    torch.testing.assert_close(scales.float(), expected.half().float())


@pytest.mark.parametrize("group_size", [0, 16])
def test_clip_ratios_shrink_the_ranges_gptq_sets(group_size):
    """Catches: a clip that does not reach the group parameters, or reaches the wrong group. The identity
    Hessian gives rounding without feedback, so every range is the weight's own, times its ratio."""
    w, _, _ = _problem(seed=4)
    groups = 1 if group_size == 0 else 64 // group_size
    clip = 0.5 + 0.5 * torch.rand(48, groups, generator=torch.Generator().manual_seed(5))
    cfg = QuantConfig(group_size=group_size, method="gptq", gptq=GPTQConfig(damp=0.0))
    codes, scales, zeros = gptq_quantize_weight(w, torch.eye(64), cfg, clip)
    expected = w.reshape(48, groups, -1).abs().amax(-1) * clip / 7
    torch.testing.assert_close(scales.float(), expected.half().float())
    want = torch.clamp(torch.round(w.reshape(48, groups, -1) / scales.float().unsqueeze(-1)), -8, 7)
    torch.testing.assert_close(dequantize(codes, scales, zeros, group_size),
                               (want * scales.float().unsqueeze(-1)).reshape(48, 64))
    with pytest.raises(ValueError, match="clip must be"):
        gptq_quantize_weight(w, torch.eye(64), cfg, clip[:, :1].repeat(1, groups + 1))


def test_identity_hessian_gives_rtn():
    # With H = I there is no correlation to exploit: GPTQ reduces to rounding.
    w, _, _ = _problem(seed=1)
    cfg = QuantConfig(group_size=0, method="gptq", gptq=GPTQConfig(damp=0.0))
    codes, scales, zeros = gptq_quantize_weight(w, torch.eye(64), cfg)
    torch.testing.assert_close(dequantize(codes, scales, zeros, 0), _rtn_weight(w, cfg))


def test_dead_input_columns_are_zeroed():
    w, x, h = _problem(seed=2)
    h[5, :] = 0
    h[:, 5] = 0
    codes, scales, zeros = gptq_quantize_weight(w, h, QuantConfig(method="gptq"))
    assert (dequantize(codes, scales, zeros, 0)[:, 5] == 0).all()


def test_bad_inputs_raise():
    w, _, h = _problem()
    cfg = QuantConfig(method="gptq")
    with pytest.raises(ValueError, match="Hessian must be"):
        gptq_quantize_weight(w, h[:10, :10], cfg)
    with pytest.raises(ValueError, match="2-D"):
        gptq_quantize_weight(w[0], h, cfg)
    with pytest.raises(ValueError, match="finite"):
        gptq_quantize_weight(w, h * float("nan"), cfg)
    with pytest.raises(SpearError, match="does not divide"):
        gptq_quantize_weight(w, h, QuantConfig(group_size=24, method="gptq"))
    not_pd = -torch.eye(64)
    not_pd[0, 0] = 1.0
    with pytest.raises(ValueError, match="positive definite"):
        gptq_quantize_weight(w, not_pd, QuantConfig(method="gptq", gptq=GPTQConfig(damp=0.0)))


def test_gptq_config_validation_and_round_trip():
    with pytest.raises(SpearError, match="damp"):
        GPTQConfig(damp=-0.1)
    with pytest.raises(SpearError, match="block_size"):
        GPTQConfig(block_size=0)
    with pytest.raises(SpearError, match="calibration source"):
        CalibConfig(source="wiki")
    cfg = QuantConfig(method="gptq", group_size=64, gptq=GPTQConfig(act_order=True, damp=0.05),
                      calib=CalibConfig(source="text", n_samples=8))
    assert QuantConfig.from_dict(cfg.to_dict()) == cfg
    assert QuantConfig.from_dict({"bits": 4, "method": "rtn"}) == QuantConfig()  # older checkpoints


def test_gptq_model_layer_by_layer(rand_llama, rand_ids):
    from copy import deepcopy

    from spear.quant import QuantLinear
    from spear.quant.api import quantize_model

    rtn_model = deepcopy(rand_llama)
    with torch.no_grad():
        ref = rand_llama(rand_ids).logits
    cfg = QuantConfig(method="gptq", group_size=16, calib=CalibConfig(source="text", batch_size=4))
    modules = quantize_model(rand_llama, cfg, calib=rand_ids, progress=False)
    assert len(modules) == 14 and all(isinstance(m, QuantLinear) for m in modules.values())
    assert type(rand_llama.lm_head) is torch.nn.Linear
    quantize_model(rtn_model, QuantConfig(group_size=16), progress=False)
    with torch.no_grad():
        err_gptq = (rand_llama(rand_ids).logits - ref).pow(2).mean()
        err_rtn = (rtn_model(rand_ids).logits - ref).pow(2).mean()
    assert err_gptq < err_rtn
