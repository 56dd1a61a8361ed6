import pytest
import torch

from spear.config import QuantConfig
from spear.models.modules import quantizable_linears
from spear.select.cka import linear_cka
from spear.select.damage import module_damage
from spear.select.plan import load_plan, save_plan, select


@pytest.fixture()
def ids():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 1000, (6, 24), generator=g)


def _cka_from_gram(x: torch.Tensor, y: torch.Tensor) -> float:
    """Linear CKA from centred Gram matrices in float64 (Kornblith et al., 2019):
    HSIC(K, L) / sqrt(HSIC(K, K) · HSIC(L, L)) with K = H X Xᵀ H, L = H Y Yᵀ H, H = I − 11ᵀ/n;
    the n × n form, not the d × d cross products spear.select.cka uses."""
    x, y = x.double(), y.double()
    n = x.shape[0]
    h = torch.eye(n, dtype=torch.float64) - 1.0 / n
    k, l = h @ x @ x.T @ h, h @ y @ y.T @ h
    return float((k * l).sum() / torch.sqrt((k * k).sum() * (l * l).sum()))


def _rtn_sym_per_channel(w: torch.Tensor, bits: int) -> torch.Tensor:
    """Symmetric per-output-channel round-to-nearest: step max|w_row| / (2^(bits-1) − 1)."""
    step = w.abs().amax(dim=1, keepdim=True) / (2 ** (bits - 1) - 1)
    return torch.round(w / step) * step


def _damage_by_hand(model, ids, bits):
    """d_i = 1 − CKA(H_FP, H_i): final hidden states (all tokens) with module i alone quantized."""
    def final_hidden():
        with torch.no_grad():
            hs = model(input_ids=ids, use_cache=False, output_hidden_states=True).hidden_states[-1]
        return hs.reshape(-1, hs.shape[-1])

    h_fp = final_hidden()
    out = {}
    for name, lin in quantizable_linears(model).items():
        orig = lin.weight.data.clone()
        lin.weight.data.copy_(_rtn_sym_per_channel(orig, bits))
        out[name] = 1.0 - _cka_from_gram(h_fp, final_hidden())
        lin.weight.data.copy_(orig)
    return out


def test_cka_from_gram_is_linear_cka_on_random_matrices():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(60, 7, generator=g, dtype=torch.float64) * 3 + 1  # uncentred, other widths
    y = x[:, :5] @ torch.randn(5, 11, generator=g, dtype=torch.float64) + torch.randn(60, 11, generator=g,
                                                                                      dtype=torch.float64)
    assert _cka_from_gram(x, y) == pytest.approx(linear_cka(x, y), rel=1e-10)
    assert _cka_from_gram(x, x) == pytest.approx(1.0, abs=1e-12)


def test_damage_is_one_minus_cka_of_final_hidden_states(sharp_tiny_llama_path, ids):
    """module_damage (with the layer replay and with full forwards) against d = 1 − CKA computed
    here from a hand RTN proxy, the model's final hidden states and the Gram-matrix CKA.

    Catches: ``damage[name] = max(0.0, 1.0 - linear_cka(fp_all, h) ** 2)`` in
    spear/select/damage.py: the replay and the full forwards still agree with each other, which is
    all the old test compared."""
    from spear.models.loading import load_model

    model, _ = load_model(sharp_tiny_llama_path)
    before = {n: m.weight.clone() for n, m in quantizable_linears(model).items()}
    expect = _damage_by_hand(model, ids, bits=3)
    fast = module_damage(model, QuantConfig(bits=3), ids, batch_size=4, progress=False)
    slow = module_damage(model, QuantConfig(bits=3), ids, batch_size=4, progress=False, replay=False)
    assert fast.replay and not slow.replay
    assert fast.tokens == ids.numel()
    assert set(fast.damage) == set(slow.damage) == set(expect) == set(before)
    assert min(expect.values()) > 1e-4  # every module's error shows in the final states
    for n, d in expect.items():
        assert fast.damage[n] == pytest.approx(d, rel=1e-3, abs=1e-7), n
        assert slow.damage[n] == pytest.approx(d, rel=1e-3, abs=1e-7), n
    # the weights are restored exactly
    for n, m in quantizable_linears(model).items():
        assert torch.equal(m.weight, before[n])


def test_scored_passes_skip_the_output_head(sharp_tiny_llama_path, ids):
    """Only the FP pass (2 batches of 4) runs the whole model; the 14 scored passes stop at the final
    norm, which is all the damage reads (the test above checks their values against the whole model's).

    Catches: the scored passes running the whole model again (2 + 14 x 2 head calls)."""
    from spear.models.loading import load_model

    model, _ = load_model(sharp_tiny_llama_path)
    calls = []
    model.lm_head.register_forward_hook(lambda *a: calls.append(1))
    module_damage(model, QuantConfig(bits=3), ids, batch_size=4, progress=False)
    assert len(calls) == 2


def test_lower_bits_do_more_damage(sharp_tiny_llama_path, ids):
    from spear.models.loading import load_model

    model, _ = load_model(sharp_tiny_llama_path)
    d8 = module_damage(model, QuantConfig(bits=8), ids, progress=False).damage
    d3 = module_damage(model, QuantConfig(bits=3), ids, progress=False).damage
    assert sum(d3.values()) > 50 * sum(d8.values())


def test_select_writes_a_plan_within_budget(sharp_tiny_llama_path, tmp_path, ids):
    from spear.eval.memory import compensator_bytes, quantized_model_bytes
    from spear.compensate.calib_config import CalibrationConfig
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


def test_plans_with_and_without_the_head_score_separately(sharp_tiny_llama_path):
    """make_plan caches damage in the caller's dict per quantization setting: a setting that
    quantizes the output head must not reuse the scores of one that does not (they lack the head)."""
    from spear.models.loading import load_model
    from spear.select import plan as plan_mod

    model, tok = load_model(sharp_tiny_llama_path)
    cache: dict = {}
    plan_mod.make_plan("cka@1", model, tok, QuantConfig(bits=4), damage_samples=2, damage_cache=cache)
    plan_mod.make_plan("cka@1", model, tok, QuantConfig(bits=4, include_lm_head=True), damage_samples=2,
                       damage_cache=cache)
    reports = {k: v.damage for k, v in cache.items()}
    assert set(reports) == {(4, 0, True, 2), (4, 0, True, 2, "head")}
    assert "lm_head" not in reports[(4, 0, True, 2)] and "lm_head" in reports[(4, 0, True, 2, "head")]


def test_make_plan_reuses_only_the_callers_damage_cache(tiny_llama, monkeypatch):
    """The scores live in the dict the caller passes, not in the package: with it a second plan of
    the same setting scores nothing, without it every call scores. Catches: a module-level cache
    brought back (the second uncached call would not score), or the cache ignored (the cached
    call would score again)."""
    from spear.select import plan as plan_mod
    from spear.select.damage import DamageReport

    model, tok = tiny_llama
    names = list(quantizable_linears(model))
    calls = []

    def scored(*a, **k):  # the scoring itself is tested above; here only how often it runs
        calls.append(1)
        return DamageReport({n: 1.0 + i for i, n in enumerate(names)}, 0.0, 16, False)

    monkeypatch.setattr(plan_mod, "damage_ids", lambda *a, **k: torch.zeros(2, 8, dtype=torch.long))
    monkeypatch.setattr(plan_mod, "module_damage", scored)
    q = QuantConfig(bits=4)
    cache: dict = {}
    first = plan_mod.make_plan("cka@1", model, tok, q, damage_samples=2, damage_cache=cache)
    assert plan_mod.make_plan("cka@2", model, tok, q, damage_samples=2, damage_cache=cache) != {}
    assert len(calls) == 1 and list(cache) == [plan_mod.damage_key(q, 2)]
    assert plan_mod.make_plan("cka@1", model, tok, q, damage_samples=2) == first
    plan_mod.make_plan("cka@1", model, tok, q, damage_samples=2)
    assert len(calls) == 3
