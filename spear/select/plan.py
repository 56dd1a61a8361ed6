"""Plans (module -> rank): building them from a budget, and the JSON file that carries them.

    sel = select(model, tokenizer, quant, budget="1%")      # damage + CKA-entropy-cost rule
    save_plan(sel, folder)                                 # folder/plan.json
    plan = load_plan(folder)                               # {module: rank}
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from spear.config import QuantConfig
from spear.errors import SpearError
from spear.fileio import read_json, write_text_atomic
from spear.models.modules import quantizable_linears
from spear.select.allocate import Allocation, cka_entropy_allocation, random_allocation, uniform_allocation
from spear.select.budget import estimate_quantized_bytes, parse_budget
from spear.select.damage import DamageReport, module_damage

PLAN_FILE = "plan.json"
PLACEMENTS = ("uniform", "random", "cka", "cka-full", "cka-sqrt")


@dataclass
class Selection:
    allocation: Allocation
    model_bytes: int  # the quantized model the budget is a share of
    damage: DamageReport | None = None
    info: dict = field(default_factory=dict)

    @property
    def plan(self) -> dict[str, int]:
        return self.allocation.plan

    def to_dict(self) -> dict:
        a = self.allocation
        out = {"placement": a.method, "plan": a.plan, "bytes": a.bytes, "budget_bytes": a.budget,
               "model_bytes": self.model_bytes, "memory_pct": 100 * a.bytes / self.model_bytes,
               "budget_pct": 100 * a.budget / self.model_bytes, "modules": a.modules, **a.details, **self.info}
        if self.damage is not None:
            out.update(damage=self.damage.damage, damage_seconds=self.damage.seconds,
                       damage_tokens=self.damage.tokens)
        return out


def damage_ids(model: nn.Module, tokenizer, n: int, calib=None, progress: bool = True) -> torch.Tensor:
    """Self-samples for damage scoring. With ``calib`` (a CalibrationConfig), the first ``n`` of
    its self-samples (the same cached set the calibration then trains on); else ``n`` fresh
    samples of 128 tokens (seed 0)."""
    from spear.data.selfsample import SampleConfig, sample_sequences

    if calib is not None:
        cfg = calib.self_samples(max(n, calib.n_samples + calib.val_samples), calib.sample_len)
    else:
        cfg = SampleConfig(n=n, length=128, seed=0)
    return sample_sequences(model, tokenizer, cfg, progress=progress)[:n]


def latency_costs(model: nn.Module, quant: QuantConfig, targets: dict, latency_budget: str,
                  ec_costs: str | None = None):
    """(latency(name, rank) in µs, the budget in µs, what the plan records) for ``latency_budget``
    ("3%" of the W4 decode step, or "50us"), from the table ``ec_costs`` or the analytic model."""
    from spear.quant.primitives import n_groups, packed_nbytes
    from spear.select.ec_costs import AnalyticECCost, load_ec_costs, parse_latency_budget

    model_costs = AnalyticECCost() if ec_costs is None else load_ec_costs(ec_costs)
    layer_bytes = []
    for lin in targets.values():
        g = n_groups(lin.in_features, quant.group_size)
        b = packed_nbytes(lin.out_features, lin.in_features, quant.bits) + lin.out_features * g * 2
        layer_bytes.append(b + (0 if quant.symmetric else (lin.out_features * g * quant.bits + 7) // 8))
    head = model.get_output_embeddings()
    if head is not None and not any(lin is head for lin in targets.values()):
        layer_bytes.append(2 * head.weight.numel())  # the fp16 head streams whole at every step
    base = model_costs.base_us(layer_bytes)
    budget_us = parse_latency_budget(latency_budget, base)
    shapes = {n: (lin.in_features, lin.out_features) for n, lin in targets.items()}

    def latency(name, rank):
        return model_costs.ec_us(*shapes[name], rank)

    info = {"latency_budget": str(latency_budget), "base_step_us": base, "latency_model": model_costs.describe()}
    return latency, budget_us, info


def select(model: nn.Module, tokenizer, quant: QuantConfig, budget: str | int, placement: str = "cka",
           hidden: int = 8, gated: bool = False, per_rank: bool = True, tp: int = 1, comm_penalty: float = 0.5,
           damage_samples: int = 16, seed: int = 0, progress: bool = True,
           damage: DamageReport | None = None, ids: torch.Tensor | None = None, calib=None,
           latency_budget: str | None = None, ec_costs: str | None = None) -> Selection:
    """A plan for ``model`` (in full precision) within ``budget`` ("1%" of the quantized model, or bytes)
    and, with ``latency_budget`` ("3%" of the W4 decode step, or "50us"), within that much extra
    decode latency too, priced by the EC cost table ``ec_costs`` or the analytic model
    (:mod:`spear.select.ec_costs`).

    Damage is scored on ``ids`` when given, else on ``damage_samples`` self-samples (from the
    calibration set of ``calib``, a CalibrationConfig, when given)."""
    if placement not in PLACEMENTS:
        raise SpearError(f"placement must be one of {', '.join(PLACEMENTS)}; got {placement!r}")
    if ec_costs is not None and latency_budget is None:
        raise SpearError("an EC cost table prices a latency budget: give --latency-budget with --ec-costs")
    targets = quantizable_linears(model, quant.include_lm_head)
    shapes = {n: (lin.in_features, lin.out_features) for n, lin in targets.items()}
    total = estimate_quantized_bytes(model, quant)
    try:
        budget_bytes = parse_budget(budget, total)
    except ValueError as exc:
        raise SpearError(str(exc)) from exc
    kw = {"hidden": hidden, "gated": gated, "per_rank": per_rank}
    info = {}
    if latency_budget is not None:
        latency, budget_us, info = latency_costs(model, quant, targets, latency_budget, ec_costs)
        kw.update(latency=latency, latency_budget=budget_us)
    if placement == "uniform":
        return _with_latency(Selection(uniform_allocation(shapes, budget_bytes, **kw), total, info=info))
    if placement == "random":
        return _with_latency(Selection(random_allocation(shapes, budget_bytes, seed=seed, **kw), total, info=info))
    if damage is None:
        if ids is None:
            ids = damage_ids(model, tokenizer, damage_samples, calib, progress=progress)
        damage = module_damage(model, quant, ids, modules=targets, progress=progress)
    coverage = {"cka": "entropy", "cka-full": "full", "cka-sqrt": "sqrt"}[placement]
    alloc = cka_entropy_allocation(damage.damage, shapes, budget_bytes, tp=tp, comm_penalty=comm_penalty,
                                   coverage=coverage, **kw)
    return _with_latency(Selection(alloc, total, damage, info))


def _with_latency(sel: Selection) -> Selection:
    """The predicted extra decode latency as a share of the base step, next to the memory share."""
    if "base_step_us" in sel.info:
        d = sel.allocation.details
        sel.info.update(latency_pct=100 * d["latency_us"] / sel.info["base_step_us"],
                        latency_budget_pct=100 * d["latency_budget_us"] / sel.info["base_step_us"])
    return sel


def damage_key(quant: QuantConfig, damage_samples: int) -> tuple:
    """What the damage scores depend on: the RTN proxy's bits/group/symmetry, the samples and
    whether the output head is scored too (GPTQ/AWQ share their RTN proxy's scores)."""
    head = ("head",) if quant.include_lm_head else ()
    return (quant.bits, quant.group_size, quant.symmetric, damage_samples) + head


def make_plan(spec: str, model: nn.Module, tokenizer, quant: QuantConfig, damage_samples: int = 16,
              progress: bool = False, damage_cache: dict[tuple, DamageReport] | None = None) -> dict[str, int]:
    """A plan from a short spec: ``r<k>`` (rank k everywhere) or ``<placement>@<percent>``.
    ``damage_cache`` (the caller's dict, keyed by :func:`damage_key`) lends damage scores to
    later calls and takes the ones computed here; without it every CKA plan scores afresh."""
    m = re.fullmatch(r"r(\d+)", spec)
    if m:
        return dict.fromkeys(quantizable_linears(model, quant.include_lm_head), int(m.group(1)))
    placement, _, pct = spec.partition("@")
    if not pct:
        raise SpearError(f"plan spec must be r<k> or <placement>@<percent>; got {spec!r}")
    key = damage_key(quant, damage_samples)
    damage = None if damage_cache is None else damage_cache.get(key)
    if placement.startswith("cka") and damage is None:
        from spear.compensate.calib_config import CalibrationConfig

        # the first damage_samples of an 80-sequence draw (cached): a plan made alone need not draw the
        # calibration's whole set
        ids = damage_ids(model, tokenizer, damage_samples, CalibrationConfig(n_samples=64), progress=progress)
        damage = module_damage(model, quant, ids, progress=progress)
        if damage_cache is not None:
            damage_cache[key] = damage
    return select(model, tokenizer, quant, f"{pct}%", placement, damage=damage, progress=progress).plan


def save_plan(selection: Selection, folder: str | Path) -> Path:
    """Write ``folder/plan.json`` atomically."""
    return write_text_atomic(Path(folder) / PLAN_FILE, json.dumps(selection.to_dict(), indent=1))


def load_plan(path: str | Path, modules=None) -> dict[str, int]:
    """The plan in ``path`` (a plan.json or a folder holding one), checked against ``modules`` if given."""
    path = Path(path)
    if path.is_dir():
        path = path / PLAN_FILE
    if not path.is_file():
        raise SpearError(f"no plan at {path} (write one with `spear select`)")
    data = read_json(path)
    plan = data.get("plan") if isinstance(data, dict) and "plan" in data else data
    if not isinstance(plan, dict) or not all(isinstance(k, str) and isinstance(v, int) and v >= 0
                                             for k, v in plan.items()):
        raise SpearError(f"{path}: a plan must map module names to non-negative integer ranks")
    if modules is not None:
        unknown = sorted(set(plan) - set(modules))
        if unknown:
            raise SpearError(f"{path}: the plan names modules this model does not have: {', '.join(unknown[:5])}"
                             + (" …" if len(unknown) > 5 else ""))
    return {k: v for k, v in plan.items() if v > 0}
