import pytest
import torch

from spear.config import QuantConfig
from spear.models.modules import quantizable_linears
from spear.select.damage import module_damage
from spear.select.plan import load_plan, save_plan, select


@pytest.fixture()
def ids():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 1000, (6, 24), generator=g)


def test_replay_gives_the_same_damage_as_full_forwards(sharp_tiny_llama_path, ids):
    from spear.models.loading import load_model

    model, _ = load_model(sharp_tiny_llama_path)
    before = {n: m.weight.clone() for n, m in quantizable_linears(model).items()}
    fast = module_damage(model, QuantConfig(bits=3), ids, batch_size=4, progress=False)
    slow = module_damage(model, QuantConfig(bits=3), ids, batch_size=4, progress=False, replay=False)
    assert fast.replay and not slow.replay
    assert fast.tokens == ids.numel()
    assert set(fast.damage) == set(before)
    for n in before:
        assert fast.damage[n] == pytest.approx(slow.damage[n], rel=1e-3, abs=1e-9)
    assert all(v > 0 for v in fast.damage.values())
    # the weights are restored exactly
    for n, m in quantizable_linears(model).items():
        assert torch.equal(m.weight, before[n])


def test_lower_bits_do_more_damage(sharp_tiny_llama_path, ids):
    from spear.models.loading import load_model

    model, _ = load_model(sharp_tiny_llama_path)
    d8 = module_damage(model, QuantConfig(bits=8), ids, progress=False).damage
    d3 = module_damage(model, QuantConfig(bits=3), ids, progress=False).damage
    assert sum(d3.values()) > 50 * sum(d8.values())


def test_select_writes_a_plan_within_budget(sharp_tiny_llama_path, tmp_path, ids):
    from spear.eval.memory import compensator_bytes, quantized_model_bytes
    from spear.compensate.calibrate import CalibrationConfig
    from spear.compensate.workflow import attach_ecs
    from spear.models.loading import load_model
    from spear.quant import quantize_model_rtn

    model, tok = load_model(sharp_tiny_llama_path)
    q = QuantConfig(bits=3)
    sel = select(model, tok, q, "3%", ids=ids, progress=False)
    assert sel.damage.tokens == ids.numel()
    assert 0 < sel.allocation.bytes <= sel.allocation.budget
    path = save_plan(sel, tmp_path / "ckpt")
    plan = load_plan(tmp_path / "ckpt", modules=quantizable_linears(model))
    assert plan == sel.plan and path.name == "plan.json"
    fp_w = {n: m.weight.detach().clone() for n, m in quantizable_linears(model).items()}
    mods = quantize_model_rtn(model, q, progress=False)
    assert quantized_model_bytes(model) == sel.model_bytes  # the budget's base is the real quantized size
    attach_ecs(mods, fp_w, plan, CalibrationConfig(init="identity"), None)
    assert compensator_bytes(model) == sel.allocation.bytes


def test_load_plan_rejects_bad_files(tmp_path):
    from spear.errors import SpearError

    (tmp_path / "plan.json").write_text('{"plan": {"a": -1}}')
    with pytest.raises(SpearError, match="non-negative"):
        load_plan(tmp_path)
    (tmp_path / "plan.json").write_text('{"plan": {"a": 2}}')
    with pytest.raises(SpearError, match="does not have"):
        load_plan(tmp_path, modules={"b": None})
    with pytest.raises(SpearError, match="no plan"):
        load_plan(tmp_path / "missing")


def test_plans_with_and_without_the_head_score_separately(sharp_tiny_llama_path, monkeypatch):
    """make_plan caches damage per quantization setting: a setting that quantizes the output head
    must not reuse the scores of one that does not (they lack the head)."""
    from spear.models.loading import load_model
    from spear.select import plan as plan_mod

    monkeypatch.setattr(plan_mod, "_damage_cache", {})
    model, tok = load_model(sharp_tiny_llama_path)
    plan_mod.make_plan("cka@1", model, tok, QuantConfig(bits=4), damage_samples=2)
    plan_mod.make_plan("cka@1", model, tok, QuantConfig(bits=4, include_lm_head=True), damage_samples=2)
    reports = {k: v.damage for k, v in plan_mod._damage_cache.items()}
    assert set(reports) == {(4, 0, True, 2), (4, 0, True, 2, "head")}
    assert "lm_head" not in reports[(4, 0, True, 2)] and "lm_head" in reports[(4, 0, True, 2, "head")]
