import pytest
import torch

from spear.compensate.calib_config import CalibrationConfig
from spear.compensate.calibrate import CalibrationDiverged, kl_loss, train_ecs
from spear.compensate.ec import GatedCompensator
from spear.compensate.workflow import attach_ecs, calibrate, prepare_calibration, uniform_plan
from spear.config import QuantConfig
from spear.errors import SpearError
from spear.models.checkpoint import save_checkpoint
from spear.models.loading import load_model
from spear.quant import quantize_model_rtn


def _reference(ec, x):
    u = x @ ec.A.T
    if ec.gated:
        h = torch.nn.functional.silu((u * ec.u_scale) @ ec.w1.T + ec.b1)
        u = u * (1 + ec.bound * torch.tanh(h @ ec.w2.T + ec.b2))
    return ec.alpha * (u @ ec.B.T)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gate_starts_at_one_so_ec_equals_static_solution(dtype):
    torch.manual_seed(0)
    a, b = torch.randn(4, 32), torch.randn(16, 4)
    ec = GatedCompensator(a, b, hidden=8).to(dtype)
    x = torch.randn(7, 32, dtype=dtype)
    static = (x.float() @ a.T @ b.T)
    assert torch.allclose(ec(x).float(), static, rtol=2e-2, atol=2e-2 * static.abs().max().item())
    assert torch.equal(ec.gate(x @ ec.A.T), torch.ones(7, 4, dtype=dtype))


def test_gate_is_bounded_and_token_dependent():
    torch.manual_seed(1)
    ec = GatedCompensator(torch.randn(3, 16), torch.randn(8, 3), hidden=4, bound=0.5)
    with torch.no_grad():
        ec.w2.normal_(0, 3.0)
    x = torch.randn(50, 16) * 5
    g = ec.gate(x @ ec.A.T)
    assert (g >= 0.5).all() and (g <= 1.5).all()
    assert g.std(0).min() > 0.01  # differs across tokens
    assert torch.allclose(ec(x), _reference(ec, x), atol=1e-5)


def test_export_folds_input_scale():
    torch.manual_seed(2)
    ec = GatedCompensator(torch.randn(3, 16), torch.randn(8, 3), hidden=4)
    ec.set_input_scale(torch.tensor([2.0, 0.5, 4.0]))
    with torch.no_grad():
        ec.w2.normal_()
    e = ec.export_gate()
    u = torch.randn(5, 3)
    h = torch.nn.functional.silu(u @ e["w1"].T + e["b1"])
    assert torch.allclose(1 + e["bound"] * torch.tanh(h @ e["w2"].T + e["b2"]), ec.gate(u), atol=1e-6)


def test_per_module_gate_scales_every_rank_alike_and_exports_per_rank():
    torch.manual_seed(3)
    ec = GatedCompensator(torch.randn(3, 16), torch.randn(8, 3), hidden=4, per_rank=False)
    assert ec.w2.shape == (1, 4) and ec.b2.shape == (1,)
    with torch.no_grad():
        ec.w2.normal_(0, 2.0)
    u = torch.randn(6, 3)
    g = ec.gate(u)
    assert g.shape == (6, 1) and g.std() > 0.01
    x = torch.randn(6, 16)
    assert torch.allclose(ec(x), _reference(ec, x), atol=1e-5)
    e = ec.export_gate()
    assert e["w2"].shape == (3, 4) and e["b2"].shape == (3,)
    h = torch.nn.functional.silu(u @ e["w1"].T + e["b1"])
    assert torch.allclose(1 + e["bound"] * torch.tanh(h @ e["w2"].T + e["b2"]), g.expand(6, 3), atol=1e-6)
    again = GatedCompensator.empty(16, 8, **ec.spec())
    again.load_state_dict(ec.state_dict())
    assert torch.equal(again(x), ec(x))


def test_invalid_ec_shapes():
    torch.manual_seed(5)
    with pytest.raises(ValueError, match="share r"):
        GatedCompensator(torch.randn(3, 16), torch.randn(8, 2))
    with pytest.raises(ValueError, match="bound"):
        GatedCompensator(torch.randn(3, 16), torch.randn(8, 3), bound=1.5)
    with pytest.raises(SpearError, match="steps"):
        CalibrationConfig(steps=0)


def test_kl_loss_is_zero_for_identical_and_positive_otherwise():
    torch.manual_seed(4)
    logits = torch.randn(2, 5, 11)
    t = torch.log_softmax(logits, -1)
    assert kl_loss(logits, t).abs() < 1e-6
    assert kl_loss(logits + torch.randn_like(logits), t) > 0


@pytest.fixture()
def calibrated_setup(sharp_tiny_llama_path, tmp_path, monkeypatch):
    monkeypatch.setenv("SPEAR_CACHE", str(tmp_path / "cache"))
    model, tok = load_model(sharp_tiny_llama_path)
    cfg = CalibrationConfig(n_samples=8, val_samples=4, sample_len=24, steps=20, batch_size=4, eval_every=5,
                            patience=5, lr=5e-3, gated=True, tune_scales=False, tune_norms=False)  # the ECs alone
    data = prepare_calibration(model, tok, cfg, progress=False)
    mods = quantize_model_rtn(model, QuantConfig(bits=3), progress=False)
    attach_ecs(mods, data.fp_weights, uniform_plan(mods, 2), cfg, data.stats)
    return model, tok, data, cfg, mods


def test_kl_calibration_lowers_validation_kl_and_trains_only_ecs(calibrated_setup):
    """Catches: a trainable EC tensor left frozen (``p.requires_grad_(p is not ec.alpha)`` in
    ``train_ecs``): the old check wanted a gradient on *any* compensator tensor."""
    model, tok, data, cfg, mods = calibrated_setup
    frozen = {n: t.clone() for n, t in model.state_dict().items() if ".compensator." not in n}
    report = calibrate(model, data, cfg, progress=False)
    assert report.best_val_kl < 0.95 * report.initial_val_kl
    assert report.best_step > 0
    after = model.state_dict()
    assert all(torch.equal(after[n], t) for n, t in frozen.items())  # base never changes
    assert not any(p.requires_grad for p in model.parameters())
    # gradients (the last step's are left in .grad) reached every trainable tensor of every EC (A, B,
    # alpha and the gate MLP) and nothing else: not the base, the embeddings or the norms
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is None for n, g in grads.items() if ".compensator." not in n)
    ec_grads = {n: g for n, g in grads.items() if ".compensator." in n}
    kinds = {n.rsplit(".", 1)[1] for n in ec_grads}
    assert kinds == {"A", "B", "alpha", "w1", "b1", "w2", "b2"} and len(ec_grads) == 7 * len(mods)
    missing = [n for n, g in ec_grads.items() if g is None or not g.abs().sum() > 0]
    assert not missing, missing


def test_calibrated_checkpoint_roundtrip(calibrated_setup, tmp_path):
    model, tok, data, cfg, mods = calibrated_setup
    calibrate(model, data, cfg, progress=False)
    out = save_checkpoint(model, tok, tmp_path / "ck", QuantConfig(bits=3), "tiny", meta={"calibration": cfg.to_dict()})
    loaded, _ = load_model(out)
    ids = data.val_ids[:2]
    # fp16 storage of EC tensors: close, not bit-identical.
    ref, got = model(input_ids=ids).logits, loaded(input_ids=ids).logits
    assert (ref - got).norm() / ref.norm() < 1e-2
    ec = loaded.model.layers[0].mlp.down_proj.compensator
    assert isinstance(ec, GatedCompensator) and ec.gated and ec.rank == 2


def test_divergence_names_module_and_step(calibrated_setup):
    model, tok, data, cfg, mods = calibrated_setup
    name = "model.layers.1.mlp.up_proj"
    with torch.no_grad():
        mods[name].compensator.B[0, 0] = float("inf")
    with pytest.raises(CalibrationDiverged, match=rf"step 1: .*{name}\.compensator|step 1: {name}"):
        train_ecs(model, data.train_ids, data.train_teacher, data.val_ids, data.val_teacher, cfg, progress=False)
