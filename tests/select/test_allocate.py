import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spear.compensate.ec import GatedCompensator
from spear.select.allocate import (cka_entropy_allocation, damage_entropy, random_allocation,
                                   uniform_allocation)
from spear.select.budget import ec_bytes, parse_budget

SHAPES = {f"layers.{i}.{k}": s for i in range(4) for k, s in
          (("q_proj", (64, 64)), ("k_proj", (64, 16)), ("o_proj", (64, 64)), ("up_proj", (64, 160)),
           ("down_proj", (160, 64)))}


def _bytes(plan, **kw):
    return sum(ec_bytes(*SHAPES[n], r, **kw) for n, r in plan.items())


@pytest.mark.parametrize("gated,per_rank", [(True, True), (True, False), (False, True)])
def test_ec_bytes_equal_what_the_module_holds(gated, per_rank):
    ec = GatedCompensator.empty(48, 80, 3, hidden=8, gated=gated, per_rank=per_rank)
    n = sum(p.numel() for p in ec.parameters()) + sum(b.numel() for b in ec.buffers())
    assert ec_bytes(48, 80, 3, 8, gated, per_rank) == 2 * n


def test_parse_budget():
    assert parse_budget("1%", 1000) == 10
    assert parse_budget("2MB", 0) == 2_000_000
    assert parse_budget("3KiB", 0) == 3072
    assert parse_budget(500, 0) == 500
    for bad in ("0%", "abc", "150%", "-1"):
        with pytest.raises(ValueError):
            parse_budget(bad, 1000)


def test_entropy_of_uniform_and_one_hot():
    h, e = damage_entropy(dict.fromkeys("abcd", 0.3))
    assert h == pytest.approx(math.log(4)) and e == pytest.approx(1.0)
    h, e = damage_entropy({"a": 1.0, "b": 0.0, "c": 0.0, "d": 0.0})
    assert h == 0 and e == pytest.approx(0.25)


damages = st.lists(st.floats(0, 1, allow_nan=False), min_size=len(SHAPES), max_size=len(SHAPES))


@settings(max_examples=60, deadline=None)
@given(damages, st.integers(1, 200_000), st.sampled_from([1, 2, 4]), st.booleans())
def test_no_placement_exceeds_the_budget(d, budget, tp, gated):
    damage = dict(zip(SHAPES, d))
    kw = {"hidden": 8, "gated": gated}
    for alloc in (cka_entropy_allocation(damage, SHAPES, budget, tp=tp, **kw),
                  cka_entropy_allocation(damage, SHAPES, budget, coverage="full", **kw),
                  uniform_allocation(SHAPES, budget, **kw), random_allocation(SHAPES, budget, seed=3, **kw)):
        assert alloc.bytes == _bytes(alloc.plan, **kw) <= budget
        assert all(r >= 1 for r in alloc.plan.values()) and set(alloc.plan) <= set(SHAPES)


def test_greedy_uses_the_budget_it_can():
    damage = {n: 1.0 + i for i, n in enumerate(SHAPES)}
    budget = 50_000
    alloc = cka_entropy_allocation(damage, SHAPES, budget, coverage="full")
    smallest = min(ec_bytes(*SHAPES[n], 2) - ec_bytes(*SHAPES[n], 1) for n in SHAPES)
    assert budget - alloc.bytes < smallest  # nothing more would fit
    assert len(alloc.plan) == len(SHAPES)


def test_concentrated_damage_covers_fewer_modules_with_higher_ranks():
    names = list(SHAPES)
    diffuse = {n: 1.0 + 0.05 * i for i, n in enumerate(names)}
    peaked = {n: (10.0 if i < 2 else 1e-4) for i, n in enumerate(names)}
    budget = 60_000
    a = cka_entropy_allocation(diffuse, SHAPES, budget)
    b = cka_entropy_allocation(peaked, SHAPES, budget)
    assert b.details["entropy"] < a.details["entropy"]
    assert b.modules < a.modules
    assert max(b.plan.values()) > max(a.plan.values())
    assert set(names[:2]) <= set(b.plan)


def test_rank_follows_damage_share():
    damage = {n: 1.0 for n in SHAPES}
    hot = "layers.2.q_proj"
    damage[hot] = 8.0
    alloc = cka_entropy_allocation(damage, SHAPES, 80_000, coverage="full")
    same = [r for n, r in alloc.plan.items() if SHAPES[n] == SHAPES[hot] and n != hot]
    assert alloc.plan[hot] > max(same)


def test_tensor_parallel_cost_demotes_row_parallel_modules():
    damage = {n: 1.0 for n in SHAPES}
    one = cka_entropy_allocation(damage, SHAPES, 60_000, tp=1, coverage="full")
    four = cka_entropy_allocation(damage, SHAPES, 60_000, tp=4, coverage="full", comm_penalty=2.0)

    def row_parallel_ranks(a):
        return sum(r for n, r in a.plan.items() if n.endswith(("o_proj", "down_proj")))
    assert row_parallel_ranks(four) < row_parallel_ranks(one)


def test_uniform_takes_the_largest_rank_that_fits_then_spreads_rank_one():
    all1 = _bytes(dict.fromkeys(SHAPES, 1))
    all3 = _bytes(dict.fromkeys(SHAPES, 3))
    a = uniform_allocation(SHAPES, all3 + 10)
    assert set(a.plan.values()) == {3} and len(a.plan) == len(SHAPES)
    b = uniform_allocation(SHAPES, all1 // 2)
    assert set(b.plan.values()) == {1} and 0 < len(b.plan) < len(SHAPES)
    idx = sorted(list(SHAPES).index(n) for n in b.plan)
    assert idx[-1] - idx[0] > len(SHAPES) // 2  # spread over the model, not its first modules


def test_random_is_seeded():
    assert random_allocation(SHAPES, 30_000, seed=1).plan == random_allocation(SHAPES, 30_000, seed=1).plan
    assert random_allocation(SHAPES, 30_000, seed=1).plan != random_allocation(SHAPES, 30_000, seed=2).plan


def test_mismatched_keys_raise():
    with pytest.raises(ValueError, match="same modules"):
        cka_entropy_allocation({"x": 1.0}, SHAPES, 1000)


def test_ranks_never_exceed_the_module_rank():
    damage = {n: 1.0 for n in SHAPES}
    huge = 10 ** 9
    for alloc in (cka_entropy_allocation(damage, SHAPES, huge), random_allocation(SHAPES, huge),
                  uniform_allocation(SHAPES, huge)):
        assert all(r <= min(SHAPES[n]) for n, r in alloc.plan.items())
    assert cka_entropy_allocation(damage, SHAPES, huge, coverage="full").plan == \
        {n: min(s) for n, s in SHAPES.items()}
