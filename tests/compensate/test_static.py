import pytest
import torch

from spear.compensate.static import attach_static, loftq, remove_compensators
from spear.compensate.stats import collect_activation_stats
from spear.config import QuantConfig, StaticCompensationConfig
from spear.errors import SpearError
from spear.eval.memory import compensator_bytes
from spear.models.modules import quantizable_linears
from spear.quant import quantize_model_rtn
from spear.quant.rtn import rtn_quantize_linear


def test_stats_match_direct_computation_and_share_inputs(tiny_llama):
    model, _ = tiny_llama
    targets = quantizable_linears(model)
    captured = {}
    hook = targets["model.layers.1.mlp.down_proj"].register_forward_pre_hook(
        lambda m, a: captured.setdefault("x", []).append(a[0].detach().reshape(-1, a[0].shape[-1])))
    windows = torch.randint(0, 1000, (3, 16), generator=torch.Generator().manual_seed(0))
    stats = collect_activation_stats(model, targets, windows, outer=True, progress=False)
    hook.remove()
    x = torch.cat(captured["x"]).double()
    st = stats["model.layers.1.mlp.down_proj"]
    assert st.count == 48
    assert torch.allclose(st.mean_abs, x.abs().mean(0))
    assert torch.allclose(st.mean_sq, (x * x).mean(0))
    assert torch.allclose(st.second_moment, x.T @ x / 48)
    # q/k/v read the same tensor: one shared statistics object.
    l0 = "model.layers.0.self_attn."
    assert stats[l0 + "q_proj"] is stats[l0 + "k_proj"] is stats[l0 + "v_proj"]
    assert stats[l0 + "q_proj"] is not stats[l0 + "o_proj"]


@pytest.mark.parametrize("method", ["identity", "lqer", "qera-approx", "qera-exact", "loftq"])
def test_static_compensation_reduces_output_error(tiny_llama, method):
    model, _ = tiny_llama
    windows = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(1))
    ref = model(input_ids=windows).logits
    targets = quantizable_linears(model)
    fp = {n: l.weight.detach().clone() for n, l in targets.items()}
    stats = collect_activation_stats(model, targets, windows, outer=True, progress=False)
    mods = quantize_model_rtn(model, QuantConfig(bits=3), progress=False)
    err_q = (model(input_ids=windows).logits - ref).norm()
    applied = attach_static(mods, fp, StaticCompensationConfig(method=method, rank=8), stats, progress=False)
    assert len(applied) == len(mods)
    err_c = (model(input_ids=windows).logits - ref).norm()
    assert err_c < 0.9 * err_q
    # r * (in + out) fp16 values per module
    assert compensator_bytes(model) == sum(2 * 8 * (m.in_features + m.out_features) for m in mods.values())
    remove_compensators(model)
    assert compensator_bytes(model) == 0


def test_plan_sets_rank_per_module(tiny_llama):
    model, _ = tiny_llama
    targets = quantizable_linears(model)
    fp = {n: l.weight.detach().clone() for n, l in targets.items()}
    mods = quantize_model_rtn(model, QuantConfig(), progress=False)
    plan = {"model.layers.0.mlp.down_proj": 3, "model.layers.1.self_attn.q_proj": 1}
    applied = attach_static(mods, fp, StaticCompensationConfig(method="identity", plan=plan), None, progress=False)
    assert applied == plan
    assert mods["model.layers.0.mlp.down_proj"].compensator.rank == 3
    assert mods["model.layers.0.mlp.up_proj"].compensator is None


def test_loftq_iterations_do_not_increase_error():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48, bias=False)
    w = lin.weight.detach().clone()
    errs = []
    for iters in (1, 4):
        q = rtn_quantize_linear(lin, QuantConfig(bits=3))
        a, b = loftq(w, q, 4, iters)
        errs.append(float((w.double() - q.dequantized_weight(torch.float64) - b @ a).norm()))
    assert errs[1] <= errs[0] + 1e-9


def test_static_config_validation():
    with pytest.raises(SpearError, match="static method"):
        StaticCompensationConfig(method="nope")
    with pytest.raises(SpearError, match="rank"):
        StaticCompensationConfig(rank=-1)
