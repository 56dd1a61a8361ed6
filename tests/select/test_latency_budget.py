"""The latency budget of the selection: exact plans on crafted damage and a synthetic EC cost
table, both budgets never exceeded, a loose latency budget changing nothing, the analytic
model, the cost table's validation, and the plan that records both budgets."""

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spear.errors import SpearError
from spear.select.allocate import cka_entropy_allocation, random_allocation, uniform_allocation
from spear.select.budget import ec_bytes
from spear.select.ec_costs import AnalyticECCost, ECCostTable, load_ec_costs, parse_latency_budget

# four modules of different shapes, so a per-shape cost table prices each differently
SHAPES = {"layers.0.a": (64, 64), "layers.0.b": (64, 128), "layers.0.c": (128, 64), "layers.0.d": (128, 128)}
DAMAGE = {"layers.0.a": 0.4, "layers.0.b": 0.3, "layers.0.c": 0.2, "layers.0.d": 0.1}
# rank 1 costs 4, 1, 1, 2 us; each rank after it 1 us more (ranks 1 and 8 given, linear between, beyond)
COSTS = ECCostTable(1000.0, {(64, 64): ((1, 8), (4.0, 11.0)), (64, 128): ((1, 8), (1.0, 8.0)),
                             (128, 64): ((1, 8), (1.0, 8.0)), (128, 128): ((1, 8), (2.0, 9.0))})


def latency(name, rank):
    return COSTS.ec_us(*SHAPES[name], rank)


@pytest.mark.parametrize("budget_us,plan", [
    # damage per us of a rank-1 EC: b 0.3, c 0.2, a 0.1, d 0.05. Coverage goes in that order while
    # it fits: 6 us holds b, c and a (1 + 1 + 4) and drops d, the worst; nothing is left for ranks
    (6.0, {"layers.0.a": 1, "layers.0.b": 1, "layers.0.c": 1}),
    # 5 us: a (4 us) does not fit after b and c, d (2 us) does; the last 1 us buys the rank with
    # the largest gain, b's second (0.3 ln 1.5 against c's 0.2 ln 1.5 and d's 0.1 ln 1.5)
    (5.0, {"layers.0.b": 2, "layers.0.c": 1, "layers.0.d": 1}),
    (1.5, {"layers.0.b": 1}),
])
def test_a_tight_latency_budget_drops_the_worst_damage_per_latency(budget_us, plan):
    alloc = cka_entropy_allocation(DAMAGE, SHAPES, 10**9, latency=latency, latency_budget=budget_us)
    assert alloc.plan == plan
    assert alloc.details["latency_us"] == sum(latency(n, r) for n, r in plan.items()) <= budget_us
    assert alloc.details["latency_budget_us"] == budget_us


def test_both_budgets_binding_rank_by_the_larger_share():
    mem = ec_bytes(64, 128, 1) + ec_bytes(128, 64, 1)   # 772 bytes; rank-1 ECs take 258, 386, 386, 514
    # a rank's cost is its larger budget share: a max(258/772, 4/6) = 2/3, b max(386/772, 1/6) = 1/2,
    # c 1/2, d max(514/772, 2/6) = 0.666; damage per cost: a 0.6, b 0.6, c 0.4, d 0.15. a and b fit
    # (644 bytes, 5 us), c would take 1030 bytes; no second rank fits the 128 bytes left
    alloc = cka_entropy_allocation(DAMAGE, SHAPES, mem, latency=latency, latency_budget=6.0)
    assert alloc.plan == {"layers.0.a": 1, "layers.0.b": 1} and alloc.bytes == 644
    assert alloc.details["latency_us"] == 5.0


def test_uniform_under_a_latency_budget():
    # rank r everywhere costs (r + 3) + r + r + (r + 1) = 4r + 4 us: 32 us hold rank 7
    assert uniform_allocation(SHAPES, 10**9, latency=latency, latency_budget=32.0).plan == dict.fromkeys(SHAPES, 7)
    # rank 1 everywhere takes 8 us > 4.5: the fallback spreads int(4 x 4.5 / 8) = 2 modules evenly,
    # a (4 us) and c, which would take it to 5 us and is left out
    assert uniform_allocation(SHAPES, 10**9, latency=latency, latency_budget=4.5).plan == {"layers.0.a": 1}


MANY = {f"layers.{i}.{k}": s for i in range(3) for k, s in
        (("q_proj", (64, 64)), ("k_proj", (64, 16)), ("up_proj", (64, 160)), ("down_proj", (160, 64)))}


def _lat(name, rank):
    k, n = MANY[name]
    return 0.0 if rank == 0 else 0.5 + rank * (k + n) / 100


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0, 1), min_size=len(MANY), max_size=len(MANY)), st.integers(1, 60_000),
       st.floats(0.1, 200))
def test_no_placement_exceeds_either_budget(d, budget, budget_us):
    damage = dict(zip(MANY, d))
    kw = dict(latency=_lat, latency_budget=budget_us)
    for alloc in (cka_entropy_allocation(damage, MANY, budget, **kw), uniform_allocation(MANY, budget, **kw),
                  random_allocation(MANY, budget, seed=1, **kw)):
        used = sum(_lat(n, r) for n, r in alloc.plan.items())
        assert alloc.bytes <= budget and used <= budget_us + 1e-9
        assert alloc.details["latency_us"] == pytest.approx(used)


@pytest.mark.parametrize("seed", range(3))
def test_a_loose_latency_budget_gives_the_memory_only_plan(seed):
    import random

    rng = random.Random(seed)
    damage = {n: rng.random() for n in MANY}
    for budget in (3_000, 20_000, 80_000):
        kw = dict(latency=_lat, latency_budget=1e12)
        assert cka_entropy_allocation(damage, MANY, budget, **kw).plan == cka_entropy_allocation(damage, MANY,
                                                                                                  budget).plan
        assert uniform_allocation(MANY, budget, **kw).plan == uniform_allocation(MANY, budget).plan
        assert random_allocation(MANY, budget, seed=seed, **kw).plan == random_allocation(MANY, budget,
                                                                                          seed=seed).plan


def test_cost_table_interpolation_and_analytic_model():
    t = ECCostTable(1000.0, {(64, 64): ((2, 4, 16), (1.0, 2.0, 5.0))})
    assert [t.ec_us(64, 64, r) for r in (0, 1, 2, 3, 4, 10, 16, 20)] == [0.0, 1.0, 1.0, 1.5, 2.0, 3.5, 5.0, 6.0]
    with pytest.raises(SpearError, match="no entry for a 64 -> 128 linear"):
        t.ec_us(64, 128, 1)
    a = AnalyticECCost(bandwidth_gb_s=1000.0, call_us=0.5, launch_us=3.0)
    # rank 4 on 4096 x 4096: 0.5 us + 2 bytes x 4 x 8192 at 1 GB/ms = 0.5 + 0.065536 us
    assert a.ec_us(4096, 4096, 4) == pytest.approx(0.5 + 2 * 4 * 8192 / 1e6)
    assert a.ec_us(4096, 4096, 0) == 0.0
    assert a.base_us([10**6, 2 * 10**6]) == pytest.approx(3 + 1 + 3 + 2)
    assert parse_latency_budget("3%", 2000.0) == pytest.approx(60.0)
    assert parse_latency_budget("50us", 1.0) == 50.0 and parse_latency_budget("0.05ms", 1.0) == pytest.approx(50.0)
    for bad in ("3", "-1%", "0%", "fast"):
        with pytest.raises(SpearError, match="latency budget"):
            parse_latency_budget(bad, 1000.0)


def test_cost_table_file_round_trip_and_validation(tmp_path):
    path = COSTS.save(tmp_path / "c.json")
    back = load_ec_costs(path)
    assert back.costs == COSTS.costs and back.base_step_us == 1000.0
    good = json.loads(path.read_text())
    for change, message in [(lambda d: d.update(format="x"), "format"),
                            (lambda d: d.update(version=3), "version 3"),
                            (lambda d: d.update(base_step_us=0), "base_step_us must be a finite number > 0"),
                            (lambda d: d["costs"][0].update(ranks=[8, 1]), "increasing"),
                            (lambda d: d["costs"][0].update(us=[1.0]), "one finite number >= 0 per rank"),
                            (lambda d: d["costs"][1].update(us=[1.0, math.inf]), "one finite number"),
                            (lambda d: d["costs"].append(dict(d["costs"][0])), "appears twice"),
                            (lambda d: d.update(more=1), "unknown keys")]:
        data = json.loads(json.dumps(good))
        change(data)
        (tmp_path / "bad.json").write_text(json.dumps(data).replace("Infinity", "1e999"))
        with pytest.raises(SpearError, match=message):
            load_ec_costs(tmp_path / "bad.json")


TINY_SHAPES = {(64, 64), (64, 32), (64, 128), (128, 64)}   # the tiny Llama's q/o, k/v, gate/up, down


def test_select_records_both_budgets_and_the_predicted_latency(tiny_llama, tmp_path):
    from spear.config import QuantConfig
    from spear.select.plan import save_plan, select

    model, tok = tiny_llama
    # 1 us per rank on every shape, base step 1 ms: 4.3% = 43 us holds rank 3 on all 14 linears
    table = ECCostTable(1000.0, {s: ((1, 16), (1.0, 16.0)) for s in TINY_SHAPES}, device="test")
    path = table.save(tmp_path / "costs.json")
    sel = select(model, tok, QuantConfig(bits=4), "50%", "uniform", latency_budget="4.3%", ec_costs=str(path),
                 progress=False)
    assert set(sel.plan.values()) == {3} and len(sel.plan) == 14
    d = json.loads(save_plan(sel, tmp_path / "sel").read_text())
    assert d["budget_pct"] == pytest.approx(50, abs=0.01) and d["bytes"] <= d["budget_bytes"]
    assert d["latency_budget"] == "4.3%" and d["latency_budget_us"] == pytest.approx(43.0)
    assert d["latency_us"] == pytest.approx(42.0) and d["latency_pct"] == pytest.approx(4.2)
    assert d["base_step_us"] == 1000.0 and d["latency_model"].startswith("measured: EC cost table")
    # without a table: the analytic model, which says so
    sel = select(model, tok, QuantConfig(bits=4), "50%", "uniform", latency_budget="3%", progress=False)
    assert sel.to_dict()["latency_model"].startswith("analytic from bytes")
    assert sel.to_dict()["latency_us"] <= sel.to_dict()["latency_budget_us"]
    with pytest.raises(SpearError, match="give --latency-budget with --ec-costs"):
        select(model, tok, QuantConfig(bits=4), "1%", "uniform", ec_costs=str(path), progress=False)


def test_select_cli_latency_budget(tiny_llama_path, tmp_path, capsys):
    from spear.cli import main

    table = ECCostTable(1000.0, {s: ((1, 16), (1.0, 16.0)) for s in TINY_SHAPES})
    costs = table.save(tmp_path / "costs.json")
    assert main(["-q", "select", "--model", str(tiny_llama_path), "--out", str(tmp_path / "s"), "--placement",
                 "uniform", "--budget", "50%", "--latency-budget", "2.9%", "--ec-costs", str(costs)]) == 0
    assert "extra decode latency 28.0 us = 2.80% of the W4 step (1000 us; budget 2.90%)" in capsys.readouterr().out
    assert set(json.loads((tmp_path / "s" / "plan.json").read_text())["plan"].values()) == {2}
    assert main(["-q", "calibrate", "--model", str(tiny_llama_path), "--out", str(tmp_path / "c"), "--rank", "2",
                 "--latency-budget", "3%"]) == 2
    assert "does not apply to --plan or --rank" in capsys.readouterr().err
