"""Numerical safety of the static family and of calibration: floored scalings, balanced factors,
finite fp16 storage, keep-best calibration and errors that name the module."""

import math

import pytest
import torch

from spear.compensate.calib_config import CalibrationConfig
from spear.compensate.calibrate import ec_modules, kl_loss, val_kl
from spear.compensate.ec import GatedCompensator
from spear.compensate.registry import STORAGE_DTYPE, stored_checked
from spear.compensate.static import attach_static
from spear.compensate.stats import ActivationStats, collect_activation_stats
from spear.compensate.svd_init import SCALE_FLOOR, balance, low_rank_factors, scaling_for
from spear.compensate.workflow import attach_ecs, calibrate, prepare_calibration, uniform_plan
from spear.config import QuantConfig, StaticCompensationConfig
from spear.errors import SpearError
from spear.eval.perplexity import perplexity
from spear.models.loading import load_model
from spear.models.modules import quantizable_linears
from spear.quant import quantize_model_rtn


def _stats(x: torch.Tensor) -> ActivationStats:
    x = x.double()
    return ActivationStats(x.shape[0], x.abs().sum(0), (x * x).sum(0), x.T @ x)


def _truncated(m: torch.Tensor, rank: int) -> torch.Tensor:
    """The best rank-``rank`` approximation of ``m`` by a full SVD (independent of top_singular)."""
    u, s, vh = torch.linalg.svd(m, full_matrices=False)
    return (u[:, :rank] * s[:rank]) @ vh[:rank]


def test_lqer_scaling_is_floored_relative_to_its_maximum():
    x = torch.tensor([[0.0, 2.0, -4.0, 1e-12], [0.0, -2.0, 4.0, -1e-12]])
    s = scaling_for("lqer", _stats(x))
    # by hand: mean |x| = [0, 2, 4, 1e-12], floor = 1e-5 * 4 = 4e-5
    m = torch.tensor([4e-5, 2.0, 4.0, 4e-5], dtype=torch.float64)
    assert torch.allclose(s, m / math.sqrt(4e-5 * 4.0), rtol=1e-12)
    assert s.max() / s.min() == pytest.approx(1 / SCALE_FLOOR)


def test_qera_scalings_are_floored():
    x = torch.tensor([[0.0, 3.0, -1.0], [0.0, -3.0, 1.0]])
    approx = scaling_for("qera-approx", _stats(x))
    assert torch.allclose(approx, torch.tensor([3e-5, 3.0, 1.0], dtype=torch.float64), rtol=1e-12)
    exact = scaling_for("qera-exact", _stats(x), damp=0.0)
    ev = torch.linalg.eigvalsh(exact)
    # R = E[xxᵀ] has eigenvalues 10 (direction (0, 3, -1)/√10) and 0 twice: S = R^½ floored
    assert ev.max().item() == pytest.approx(math.sqrt(10.0), rel=1e-9)
    assert ev.min().item() == pytest.approx(SCALE_FLOOR * math.sqrt(10.0), rel=1e-6)
    torch.linalg.cholesky(exact)  # positive definite: the solve in low_rank_factors is defined


def test_balanced_factors_keep_the_weighted_optimum_and_equal_norms():
    gen = torch.Generator().manual_seed(0)
    e = torch.randn(24, 16, generator=gen, dtype=torch.float64) * 1e-3
    d = torch.rand(16, generator=gen, dtype=torch.float64) * 1e3 + 1e-2
    a, b = low_rank_factors(e, 3, d)
    assert torch.allclose(a.norm(dim=1), b.norm(dim=0), rtol=1e-10)
    # B A is the best rank-3 fit of E in the d-weighted norm: (B A) diag(d) = SVD_3(E diag(d))
    assert torch.allclose((b @ a) * d, _truncated(e * d, 3), atol=1e-12)


def test_balance_is_exact_and_leaves_zero_components_alone():
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(3, 10, generator=gen, dtype=torch.float64) * torch.tensor([[1e4], [1e-3], [0.0]], dtype=torch.float64)
    b = torch.randn(7, 3, generator=gen, dtype=torch.float64) * torch.tensor([[1e-6, 1e2, 5.0]], dtype=torch.float64)
    a2, b2 = balance(a, b)
    assert torch.allclose(b2 @ a2, b @ a, rtol=1e-12, atol=1e-18)
    assert torch.allclose(a2.norm(dim=1)[:2], b2.norm(dim=0)[:2], rtol=1e-12)
    assert torch.equal(a2[2], a[2]) and torch.equal(b2[:, 2], b[:, 2])


@pytest.mark.parametrize("gated", [False, True])
def test_ec_balance_keeps_the_function(gated):
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(4, 32, generator=gen) * 50.0
    b = torch.randn(16, 4, generator=gen) * 1e-3
    ec = GatedCompensator(a, b, hidden=8, gated=gated, seed=3)
    x = torch.randn(5, 32, generator=gen)
    if gated:
        with torch.no_grad():
            ec.w2.normal_(generator=gen)
            ec.set_input_scale(torch.rand(4, generator=gen) + 0.5)
    before = ec(x)
    ec.balance_()
    assert torch.allclose(ec.A.norm(dim=1), ec.B.norm(dim=0), rtol=1e-5)
    assert torch.allclose(ec(x), before, rtol=1e-4, atol=1e-6)


def test_stored_checked_names_what_overflows():
    with pytest.raises(SpearError, match=r"layer\.q: factor B is not finite in float16"):
        stored_checked(torch.tensor([1.0, 1e6]), torch.float32, "layer.q: factor B")
    t = torch.tensor([1.0, 3.14159])
    assert torch.equal(stored_checked(t, torch.float32, "x"), t.to(STORAGE_DTYPE).float())


def _zero_channels(model, channels):
    """Norm weight 0 on ``channels`` before every MLP: those channels of the MLP inputs are exactly 0."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.post_attention_layernorm.weight[channels] = 0.0


def test_zero_input_channels_give_finite_static_factors(sharp_tiny_llama_path, tokenizer):
    model, _ = load_model(sharp_tiny_llama_path)
    _zero_channels(model, [3, 17, 40])
    gen = torch.Generator().manual_seed(0)
    windows = torch.randint(0, len(tokenizer), (2, 64), generator=gen)
    targets = quantizable_linears(model)
    fp = {n: m.weight.detach().clone() for n, m in targets.items()}
    stats = collect_activation_stats(model, targets, windows, outer=True, progress=False)
    st = stats["model.layers.0.mlp.up_proj"]
    assert (st.mean_abs[[3, 17, 40]] == 0).all()
    with torch.no_grad():
        fp_lp = torch.log_softmax(model(input_ids=windows).logits, -1)
    mods = quantize_model_rtn(model, QuantConfig(bits=3), progress=False)
    # the scaling without a floor (mean|x| clamped at eps, as before) puts B = V Σ out of fp16's range
    m = st.mean_abs.clamp(min=torch.finfo(torch.float64).eps)
    unfloored = m / torch.sqrt(m.min() * m.max())
    e = fp["model.layers.0.mlp.up_proj"].double() - mods["model.layers.0.mlp.up_proj"].dequantized_weight(torch.float64)
    _, s_old, _ = torch.linalg.svd(e * unfloored)
    assert s_old[0] > torch.finfo(torch.float16).max
    def kl():
        with torch.no_grad():
            return kl_loss(model(input_ids=windows).logits, fp_lp).item()

    base = kl()
    for method in ("identity", "lqer", "qera-approx", "qera-exact", "loftq"):  # LoftQ re-quantizes: last
        attach_static(mods, fp, StaticCompensationConfig(method=method, rank=2), stats, progress=False)
        for name, mod in mods.items():
            assert torch.isfinite(mod.compensator.A).all() and torch.isfinite(mod.compensator.B).all(), (method, name)
        assert math.isfinite(perplexity(model, windows, progress=False).ppl), method
        assert kl() < base, method
        for mod in mods.values():
            mod.compensator = None


def test_nonfinite_perplexity_names_the_module(tiny_llama):
    model, tok = tiny_llama
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
    windows = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    with pytest.raises(SpearError, match=r"not finite; the first non-finite output is model\.layers\.1\.mlp\.down_proj"):
        perplexity(model, windows, progress=False, desc="FP")


CFG = CalibrationConfig(n_samples=8, val_samples=4, sample_len=24, steps=12, batch_size=4, eval_every=4,
                        patience=5, lr=5e-3, tune_scales=False, tune_norms=False)  # the ECs alone


@pytest.fixture()
def setup(sharp_tiny_llama_path, tmp_path, monkeypatch):
    monkeypatch.setenv("SPEAR_CACHE", str(tmp_path / "cache"))
    model, tok = load_model(sharp_tiny_llama_path)
    data = prepare_calibration(model, tok, CFG, progress=False)
    mods = quantize_model_rtn(model, QuantConfig(bits=3), progress=False)
    attach_ecs(mods, data.fp_weights, uniform_plan(mods, 2), CFG, data.stats)
    return model, data, mods


def test_calibration_hands_back_the_start_when_training_only_hurts(setup):
    model, data, _ = setup
    start = {n: {k: t.clone() for k, t in ec.state_dict().items()} for n, ec in ec_modules(model).items()}
    # a learning rate of 3 per element throws A and B far off in one evaluation period
    cfg = CalibrationConfig(**{**CFG.to_dict(), "lr": 3.0, "alpha_lr": 3.0, "eval_every": 12})
    report = calibrate(model, data, cfg, progress=False)
    trained_kl = [h["val_kl"] for h in report.history if h["step"] > 0 and "val_kl" in h]
    assert trained_kl and min(trained_kl) > report.initial_val_kl  # training really was worse
    assert report.kept == "init" and report.best_step == 0 and report.best_val_kl == report.initial_val_kl
    for n, ec in ec_modules(model).items():
        assert all(torch.equal(t, start[n][k]) for k, t in ec.state_dict().items())
    assert val_kl(model, data.val_ids, data.val_teacher, CFG.batch_size) == pytest.approx(report.initial_val_kl,
                                                                                           rel=1e-6)


def test_calibration_returns_its_state_rounded_to_storage(setup):
    model, data, _ = setup
    report = calibrate(model, data, CFG, progress=False)
    assert report.kept == "trained" and report.best_val_kl < report.initial_val_kl
    for ec in ec_modules(model).values():
        for t in (ec.A, ec.B, ec.alpha):
            assert torch.equal(t, t.to(STORAGE_DTYPE).to(t.dtype))  # what a checkpoint will hold
        assert torch.allclose(ec.A.norm(dim=1), ec.B.norm(dim=0), rtol=2e-3)
    # the reported KL is that of the rounded state that stays loaded
    assert val_kl(model, data.val_ids, data.val_teacher, CFG.batch_size) == pytest.approx(report.best_val_kl,
                                                                                           rel=1e-6)
