"""Turning per-module damage into a plan {module: rank} within a byte budget.

Three placements, all counted with :func:`spear.select.budget.ec_bytes` (the bytes the
ECs are stored and measured in), none ever above the budget:

* :func:`uniform_allocation`: the same rank on every module, the largest that fits; when
  not even rank 1 fits everywhere, rank 1 on evenly spaced modules (in model order).
* :func:`random_allocation`: ranks added one at a time to uniformly drawn modules
  (seeded) until nothing more fits.
* :func:`cka_entropy_allocation`: SPEAR's rule, below.

SPEAR's rule (``cka-entropy-cost``)
-----------------------------------
Let d_i ≥ 0 be the damage of module i (1 − CKA, :mod:`spear.select.damage`) and
p_i = d_i / Σ d its share. H = −Σ p_i ln p_i is the entropy of the damage and
N_eff = exp(H) ∈ [1, N] the effective number of damaged modules; e = N_eff / N is its
evenness.

1. *Coverage (how many modules).* Concentrated damage (small e) is worth spending on
   few modules; diffuse damage must be spread over all of them. The modules that get an
   EC are the top n_cov by damage per byte of a rank-1 EC, with
       n_cov = min(N, max(1, round(N · min(1, e / e₀)))),   e₀ = ``diffuse_evenness`` (0.5),
   further capped by how many rank-1 ECs the budget holds: damage at least as even as
   e₀ covers every module. Measured on SmolLM2-135M at W4 (e = 0.59; BENCHMARKS.md,
   "Module selection"): covering every module beat covering the top N·√e = 162 of 210 by
   1.2–1.8 points of the gap at 0.5, 1 and 2% memory, with the same rank rule.
2. *Rank (how much each).* Every covered module starts at rank 1. The rest of the
   budget goes, one rank at a time, to the covered module with the largest marginal gain
   per unit cost under the concave utility Σ_i p_i ln(1 + r_i):
       gain_i(k) = p_i · ln((k + 1) / k)   for its k-th rank,
   so the ranks of a module grow roughly in proportion to its damage share
   (concentrated damage → higher ranks on few modules, diffuse → low ranks on many).
3. *Cost.* The cost of a rank is its bytes; for row-parallel modules (o_proj,
   down_proj, …) under tensor parallelism ``tp > 1`` it is multiplied by
   1 + comm_penalty · (tp − 1) / tp, because their A·x is a partial sum that must be
   reduced across ranks (r extra values per token). The budget itself always counts
   true bytes.

A latency budget (optional, every placement)
--------------------------------------------
``latency(name, r)`` is the time a rank-r EC on module ``name`` adds to a decode step
(:mod:`spear.select.ec_costs`) and ``latency_budget`` what all of them may add together. No rank
is placed that would take either sum over its budget. In SPEAR's rule a rank's cost becomes the
larger of its two budget shares, max(Δbytes / memory budget, Δlatency / latency budget): while
latency is loose it ranks by bytes exactly as above; once latency binds, by damage per unit of
latency, so the modules whose ECs cost the most time for their damage are the ones left out.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field

from spear.parallel import split_of
from spear.select.budget import ec_bytes



@dataclass
class Allocation:
    method: str
    plan: dict[str, int]  # module -> rank (modules without an EC are absent)
    bytes: int
    budget: int
    details: dict = field(default_factory=dict)

    @property
    def modules(self) -> int:
        return len(self.plan)


def _cap(shapes, max_rank):
    return {n: min(max_rank, *shapes[n]) for n in shapes}  # never above the module's own rank


def _latency_check(latency, latency_budget):
    if (latency is None) != (latency_budget is None):
        raise ValueError("give latency and latency_budget together")
    if latency_budget is not None and not latency_budget > 0:
        raise ValueError(f"latency_budget must be > 0, got {latency_budget}")
    return latency or (lambda name, rank: 0.0), math.inf if latency_budget is None else latency_budget


def _latency_details(plan, latency, latency_budget) -> dict:
    if latency is None:
        return {}
    return {"latency_us": sum(latency(n, r) for n, r in plan.items()), "latency_budget_us": latency_budget}


def _bytes_fn(shapes, hidden, gated, per_rank):
    def cost(name, rank):
        i, o = shapes[name]
        return ec_bytes(i, o, rank, hidden, gated, per_rank)
    return cost


def damage_entropy(damage: dict[str, float]) -> tuple[float, float]:
    """(H, evenness) of the normalised damage distribution; uniform when every damage is 0."""
    vals = [max(0.0, d) for d in damage.values()]
    total = sum(vals)
    n = len(vals)
    if n == 0:
        raise ValueError("no modules")
    if total <= 0:
        return math.log(n), 1.0
    shares = [v / total for v in vals]
    h = -sum(p * math.log(p) for p in shares if p > 0)
    return h, math.exp(h) / n


def uniform_allocation(shapes: dict[str, tuple[int, int]], budget: int, hidden: int = 8, gated: bool = False,
                       per_rank: bool = True, max_rank: int = 1024, latency=None,
                       latency_budget: float | None = None) -> Allocation:
    cost = _bytes_fn(shapes, hidden, gated, per_rank)
    lat, lat_budget = _latency_check(latency, latency_budget)
    names = list(shapes)
    rank = 0
    while rank < min(max_rank, *(min(s) for s in shapes.values())) and \
            sum(cost(n, rank + 1) for n in names) <= budget and sum(lat(n, rank + 1) for n in names) <= lat_budget:
        rank += 1
    if rank > 0:
        plan = dict.fromkeys(names, rank)
    else:  # rank 1 on evenly spaced modules
        total = sum(cost(n, 1) for n in names)
        total_lat = sum(lat(n, 1) for n in names)
        k = int(len(names) * budget / total) if total else 0
        if latency is not None and total_lat:
            k = min(k, int(len(names) * lat_budget / total_lat))
        plan = {}
        used = used_lat = 0
        for j in range(k):
            n = names[(j * len(names)) // max(k, 1)]
            if used + cost(n, 1) <= budget and used_lat + lat(n, 1) <= lat_budget:
                plan[n] = 1
                used += cost(n, 1)
                used_lat += lat(n, 1)
    return Allocation("uniform", plan, sum(cost(n, r) for n, r in plan.items()), budget,
                      {"rank": rank, **_latency_details(plan, latency, latency_budget)})


def random_allocation(shapes: dict[str, tuple[int, int]], budget: int, seed: int = 0, hidden: int = 8,
                      gated: bool = False, per_rank: bool = True, max_rank: int = 1024, latency=None,
                      latency_budget: float | None = None) -> Allocation:
    cost = _bytes_fn(shapes, hidden, gated, per_rank)
    lat, lat_budget = _latency_check(latency, latency_budget)
    cap = _cap(shapes, max_rank)
    rng = random.Random(seed)
    plan: dict[str, int] = {}
    used = used_lat = 0
    open_ = list(shapes)
    while open_:
        n = rng.choice(open_)
        r = plan.get(n, 0)
        step = cost(n, r + 1) - cost(n, r)
        step_lat = lat(n, r + 1) - lat(n, r) if r < cap[n] else 0.0
        if r >= cap[n] or used + step > budget or used_lat + step_lat > lat_budget:
            open_.remove(n)
            continue
        plan[n] = r + 1
        used += step
        used_lat += step_lat
    return Allocation("random", plan, used, budget, {"seed": seed, **_latency_details(plan, latency, latency_budget)})


def cka_entropy_allocation(damage: dict[str, float], shapes: dict[str, tuple[int, int]], budget: int,
                           hidden: int = 8, gated: bool = False, per_rank: bool = True, tp: int = 1,
                           comm_penalty: float = 0.5, max_rank: int = 1024, coverage: str = "entropy",
                           diffuse_evenness: float = 0.5, latency=None, latency_budget: float | None = None) -> Allocation:
    """SPEAR's placement (module docstring). ``damage`` and ``shapes`` share their keys.

    ``coverage``: ``"entropy"`` (the rule above), ``"full"`` (every module, budget
    permitting) or ``"sqrt"`` (n_cov = N·√e, kept for comparison)."""
    if set(damage) != set(shapes):
        raise ValueError("damage and shapes must name the same modules")
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    cost = _bytes_fn(shapes, hidden, gated, per_rank)
    lat, lat_budget = _latency_check(latency, latency_budget)
    cap = _cap(shapes, max_rank)
    h, even = damage_entropy(damage)
    total = sum(max(0.0, d) for d in damage.values())
    n = len(damage)
    share = {k: (max(0.0, d) / total if total > 0 else 1.0 / n) for k, d in damage.items()}

    def penalty(name):  # the engine's split of this module (spear.parallel): row-parallel sums u across ranks
        return 1 + comm_penalty * (tp - 1) / tp if tp > 1 and split_of(name) == "row" else 1.0

    def unit_cost(name, r):  # ranking cost of going from rank r-1 to r
        c = (cost(name, r) - cost(name, r - 1)) * penalty(name)
        if latency is None:
            return c
        return max(c / budget, (lat(name, r) - lat(name, r - 1)) / lat_budget)

    if coverage == "entropy":
        if not 0 < diffuse_evenness <= 1:
            raise ValueError(f"diffuse_evenness must be in (0, 1], got {diffuse_evenness}")
        frac = min(1.0, even / diffuse_evenness)
    elif coverage == "full":
        frac = 1.0
    elif coverage == "sqrt":
        frac = math.sqrt(even)
    else:
        raise ValueError(f"coverage must be entropy, full or sqrt; got {coverage!r}")
    n_cov = min(n, max(1, round(n * frac)))
    order = sorted(damage, key=lambda k: (-share[k] / unit_cost(k, 1), k))
    plan: dict[str, int] = {}
    used = used_lat = 0
    for name in order:
        if len(plan) >= n_cov:
            break
        c = cost(name, 1)
        if used + c <= budget and used_lat + lat(name, 1) <= lat_budget:
            plan[name] = 1
            used += c
            used_lat += lat(name, 1)
    def gain(name, k):  # utility gained by the k-th rank of a module
        return share[name] * math.log((k + 1) / k)

    heap = [(-gain(k, 2) / unit_cost(k, 2), k) for k in plan if cap[k] > 1]
    heapq.heapify(heap)
    while heap:
        _, name = heapq.heappop(heap)
        r = plan[name] + 1
        step = cost(name, r) - cost(name, r - 1)
        step_lat = lat(name, r) - lat(name, r - 1)
        if used + step > budget or used_lat + step_lat > lat_budget:
            continue  # does not fit; smaller steps of other modules still may
        plan[name] = r
        used += step
        used_lat += step_lat
        if r < cap[name]:
            heapq.heappush(heap, (-gain(name, r + 1) / unit_cost(name, r + 1), name))
    return Allocation("cka-entropy-cost", plan, used, budget,
                      {"entropy": h, "effective_modules": math.exp(h), "evenness": even, "covered_target": n_cov,
                       "coverage": coverage, "tp": tp, "comm_penalty": comm_penalty,
                       **_latency_details(plan, latency, latency_budget)})
