"""What compensators add to a decode step: a measured per-module table, or an analytic model.

    costs = load_ec_costs("ec_costs.json")   # spear profile --model W4_CKPT --ec-costs ec_costs.json
    costs.ec_us(in_features, out_features, rank)   # µs one rank-r EC adds to a one-token step
    costs.base_us(layers)                          # µs of the W4 decode step they add to

The measured table (``spear-ec-costs``, version 1) holds, per linear shape, the extra time of a
rank-r EC over the same W4 layer at one token at a few ranks: piecewise linear between them,
linear along the last segment beyond the largest, held at the smallest below it (an EC's fixed
cost per call does not shrink with its rank); rank 0 costs nothing. Its base is the engine's
one-sequence decode step of the W4 model it was measured on.

Without a table, :class:`AnalyticECCost`: a decode step streams weights, so an EC costs a fixed
part per call plus its factors' fp16 bytes at the weight stream's bandwidth,
``ec_us = call_us + 2 r (k + n) / bandwidth``, and the W4 step is each linear's launch plus its
W4 bytes at that bandwidth (the head's too). Defaults from one H200 (README, "Serving"): about
2.1 TB/s of W4 codes in the engine, 0.25-0.8 µs per compensated call inside the fused kernel
(0.5), 2.8-4.2 µs of launch, ramp and first K step per W4 GEMM (3.5). It leaves attention,
norms and launch gaps out, so its base step is short of the real one and a percentage budget
errs on the tight side.
"""

from __future__ import annotations

import bisect
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from spear.errors import SpearError
from spear.fileio import read_json

FORMAT = "spear-ec-costs"
VERSION = 1


@dataclass(frozen=True)
class AnalyticECCost:
    bandwidth_gb_s: float = 2100.0
    call_us: float = 0.5
    launch_us: float = 3.5

    def ec_us(self, in_features: int, out_features: int, rank: int) -> float:
        if rank == 0:
            return 0.0
        return self.call_us + 2 * rank * (in_features + out_features) / (self.bandwidth_gb_s * 1e3)

    def base_us(self, layer_bytes: list[int]) -> float:
        """The W4 step of linears (and head) that stream ``layer_bytes`` each."""
        return sum(self.launch_us + b / (self.bandwidth_gb_s * 1e3) for b in layer_bytes)

    def describe(self) -> str:
        return (f"analytic from bytes: {self.call_us:g} us per EC call + its fp16 factors at "
                f"{self.bandwidth_gb_s:g} GB/s; base = {self.launch_us:g} us + W4 bytes at that rate per linear")


@dataclass(frozen=True)
class ECCostTable:
    base_step_us: float
    costs: dict = field(compare=True)   # (in_features, out_features) -> (ranks, us)
    device: str = ""
    dtype: str = ""
    created: str = ""
    base: str = ""                      # what the base step is
    where: str = "the EC cost table"

    def ec_us(self, in_features: int, out_features: int, rank: int) -> float:
        if rank == 0:
            return 0.0
        entry = self.costs.get((in_features, out_features))
        if entry is None:
            raise SpearError(f"{self.where} has no entry for a {in_features} -> {out_features} linear (it has "
                             f"{sorted(self.costs)}); profile this model's shapes with `spear profile --ec-costs`")
        ranks, us = entry
        if len(ranks) == 1 or rank <= ranks[0]:
            return us[0]
        i = min(bisect.bisect_right(ranks, rank) - 1, len(ranks) - 2)
        t = (rank - ranks[i]) / (ranks[i + 1] - ranks[i])
        return us[i] * (1 - t) + us[i + 1] * t

    def base_us(self, layer_bytes=None) -> float:
        return self.base_step_us

    def describe(self) -> str:
        about = ", ".join(v for v in (self.device, self.dtype, self.created) if v)
        return f"measured: {self.where}" + (f" ({about})" if about else "")

    def to_dict(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "device": self.device, "dtype": self.dtype,
                "created": self.created, "base_step_us": self.base_step_us, "base": self.base,
                "costs": [{"in_features": k, "out_features": n, "ranks": list(r), "us": list(u)}
                          for (k, n), (r, u) in sorted(self.costs.items())]}

    def save(self, path: str | Path) -> Path:
        from spear.fileio import write_text_atomic

        return write_text_atomic(path, json.dumps(self.to_dict(), indent=1))

    @classmethod
    def from_dict(cls, data, where: str) -> "ECCostTable":
        def fail(msg):
            raise SpearError(f"{where}: {msg}")

        if not isinstance(data, dict):
            fail(f"an EC cost table is a JSON object, got {type(data).__name__}")
        if data.get("format") != FORMAT:
            fail(f"format must be {FORMAT!r}, got {data.get('format')!r}")
        if data.get("version") != VERSION:
            fail(f"version {data.get('version')!r} is not supported (this spear reads version {VERSION})")
        unknown = sorted(set(data) - {"format", "version", "device", "dtype", "created", "base_step_us", "base",
                                      "costs"})
        if unknown:
            fail(f"unknown keys {unknown}")
        base = data.get("base_step_us")
        if isinstance(base, bool) or not isinstance(base, (int, float)) or not (math.isfinite(base) and base > 0):
            fail(f"base_step_us must be a finite number > 0, got {base!r}")
        entries = data.get("costs")
        if not isinstance(entries, list) or not entries:
            fail("costs must be a non-empty list")
        costs = {}
        for e in entries:
            if not isinstance(e, dict) or set(e) != {"in_features", "out_features", "ranks", "us"}:
                fail(f"each cost needs exactly in_features, out_features, ranks and us; got {e!r}")
            shape = (e["in_features"], e["out_features"])
            ranks, us = e["ranks"], e["us"]
            if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in shape):
                fail(f"a cost's in_features and out_features must be whole numbers >= 1, got {list(shape)}")
            if shape in costs:
                fail(f"the {shape[0]} -> {shape[1]} shape appears twice")
            if not isinstance(ranks, list) or not ranks or any(
                    isinstance(r, bool) or not isinstance(r, int) or r < 1 for r in ranks) or \
                    any(b <= a for a, b in zip(ranks, ranks[1:])):
                fail(f"ranks of {shape[0]} -> {shape[1]} must be increasing whole numbers >= 1, got {ranks!r}")
            if not isinstance(us, list) or len(us) != len(ranks) or any(
                    isinstance(u, bool) or not isinstance(u, (int, float)) or not (math.isfinite(u) and u >= 0)
                    for u in us):
                fail(f"us of {shape[0]} -> {shape[1]} must be one finite number >= 0 per rank, got {us!r}")
            costs[shape] = (tuple(ranks), tuple(float(u) for u in us))
        return cls(float(base), costs, str(data.get("device", "")), str(data.get("dtype", "")),
                   str(data.get("created", "")), str(data.get("base", "")), where)


def load_ec_costs(path: str | Path) -> ECCostTable:
    path = Path(path)
    return ECCostTable.from_dict(read_json(path, "EC cost table"), f"EC cost table {path}")


_UNITS_US = {"us": 1.0, "µs": 1.0, "ms": 1e3}


def parse_latency_budget(text: str, base_us: float) -> float:
    """``"3%"`` of the W4 decode step ``base_us``, or an absolute ``"50us"`` / ``"0.05ms"``; in µs."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(%|us|µs|ms)\s*", str(text))
    if not m:
        raise SpearError(f"a latency budget looks like '3%' (of the W4 decode step), '50us' or '0.05ms'; got {text!r}")
    value, unit = float(m.group(1)), m.group(2)
    if value <= 0 or (unit == "%" and value > 1000):
        raise SpearError(f"a latency budget must be > 0 (and at most 1000%), got {text!r}")
    return value * base_us / 100 if unit == "%" else value * _UNITS_US[unit]
