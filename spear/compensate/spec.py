"""What a compensator is, as one record shared by the selection's cost, attaching, checkpoints
and the kernels' packing; and its factors in the form every runtime computes.

``CompensatorSpec`` is what a checkpoint records for a module (``spear_config.json``'s
``compensator`` entry) and what the selection prices; ``ECFactors`` is the compensator as
the serving engine and the kernels compute it:

    y += alpha · B (gamma(u) ⊙ u),   u = A x,
    gamma = 1 + bound · tanh(W2 silu(W1 u + b1) + b2)      (gamma = 1 without a gate)

with the gate's input scale folded into W1 and a whole-module gate repeated per rank, so a
static low-rank term is the case without a gate and alpha = 1.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

import torch
from torch import nn

from spear.errors import SpearError

log = logging.getLogger(__name__)

KINDS = ("lowrank", "spear-ec")


@dataclass(frozen=True)
class CompensatorSpec:
    kind: str = "spear-ec"
    rank: int = 1
    hidden: int = 0          # gate MLP width (0 without a gate)
    gated: bool = False
    bound: float = 1.0       # gamma stays in (1 - bound, 1 + bound)
    per_rank: bool = True    # one gate per rank component (else one per module)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise SpearError(f"unknown compensator kind {self.kind!r}; known: {', '.join(KINDS)}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise SpearError(f"compensator rank must be a whole number >= 1, got {self.rank!r}")
        if self.gated and (self.kind != "spear-ec" or not isinstance(self.hidden, int) or self.hidden < 1):
            raise SpearError(f"a gated compensator is a 'spear-ec' with hidden >= 1; got kind {self.kind!r}, "
                             f"hidden {self.hidden!r}")
        if not 0 < float(self.bound) <= 1:
            raise SpearError(f"the gate bound must be in (0, 1], got {self.bound!r}")

    @classmethod
    def from_dict(cls, d: dict) -> "CompensatorSpec":
        """A checkpoint's record ({"kind", "rank", ...}; the kinds' own ``spec()`` writes it)."""
        if not isinstance(d, dict):
            raise SpearError(f"a compensator spec is an object, got {d!r}")
        known = {"kind", "rank", "hidden", "gated", "bound", "per_rank"}
        unknown = set(d) - known
        if unknown:
            raise SpearError(f"compensator spec has unknown field(s) {sorted(unknown)}")
        kind = d.get("kind")
        if kind == "lowrank":
            return cls(kind, d.get("rank"))
        return cls(kind, d.get("rank"), d.get("hidden", 0) if d.get("gated", True) else 0, bool(d.get("gated", True)),
                   float(d.get("bound", 1.0)), bool(d.get("per_rank", True)))

    def to_dict(self) -> dict:
        return asdict(self)

    def params(self, in_features: int, out_features: int) -> int:
        """Parameters and buffers stored for a module of this shape."""
        n = self.rank * (in_features + out_features)
        if self.kind == "spear-ec":
            n += 1  # alpha
        if self.gated:
            g = self.rank if self.per_rank else 1
            n += self.hidden * self.rank + self.hidden + g * self.hidden + g + self.rank  # w1 b1 w2 b2 u_scale
        return n

    def kernel_limits(self, max_rank: int) -> str | None:
        """Why the fused kernels cannot take this compensator (None when they can)."""
        if self.rank > max_rank:
            return f"rank {self.rank} exceeds the kernels' {max_rank}"
        if self.gated and self.hidden > max_rank:
            return f"gate width {self.hidden} exceeds the kernels' {max_rank}"
        return None


def check_rank(name: str, rank: int, in_features: int, out_features: int) -> None:
    """Raise a SpearError when ``rank`` exceeds the module's own rank min(in, out): the factors
    could add memory but no accuracy there, so a larger request is a mistake, not a cap to apply."""
    limit = min(in_features, out_features)
    if rank > limit:
        raise SpearError(f"{name}: compensator rank {rank} exceeds the module's limit min(in_features, "
                         f"out_features) = {limit}")


def check_plan_ranks(plan: dict[str, int], modules: dict[str, nn.Module]) -> None:
    """:func:`check_rank` for every module of ``modules`` at its planned rank (0 where the plan names none)."""
    for name, mod in modules.items():
        check_rank(name, plan.get(name, 0), mod.in_features, mod.out_features)


def warn_off_kernel(name: str, comp: nn.Module) -> str | None:
    """Log a warning when the attached compensator ``comp`` does not fit the fused kernels (the
    module then runs off the fused path when served); returns the reason, or None."""
    from spear.compensate.registry import compensator_spec
    from spear.kernels.layout import MAX_RANK  # layout imports torch only, no Triton kernel

    reason = CompensatorSpec.from_dict(compensator_spec(comp)).kernel_limits(MAX_RANK)
    if reason is not None:
        log.warning("%s: %s; the module will run off the fused kernel path when served", name, reason)
    return reason


@dataclass
class ECFactors:
    """A compensator in the runtime form of the module docstring; fp32 tensors."""

    a: torch.Tensor                  # (r, in)
    b: torch.Tensor                  # (out, r)
    alpha: float = 1.0
    w1: torch.Tensor | None = None   # (h, r), the gate's input scale folded in
    b1: torch.Tensor | None = None   # (h,)
    w2: torch.Tensor | None = None   # (r, h)
    b2: torch.Tensor | None = None   # (r,)
    bound: float = 1.0

    @property
    def rank(self) -> int:
        return self.a.shape[0]

    @property
    def gated(self) -> bool:
        return self.w1 is not None

    @property
    def hidden(self) -> int:
        return 0 if self.w1 is None else self.w1.shape[0]

    def check(self, in_features: int, out_features: int, where: str) -> None:
        r = self.rank
        if self.a.shape != (r, in_features) or self.b.shape != (out_features, r):
            raise SpearError(f"{where}: compensator A {tuple(self.a.shape)} and B {tuple(self.b.shape)} do not fit "
                             f"a {in_features} -> {out_features} layer")
        tensors = [self.a, self.b] + ([self.w1, self.b1, self.w2, self.b2] if self.gated else [])
        if not all(bool(torch.isfinite(t).all()) for t in tensors) or not all(
                map(lambda v: v == v and abs(v) != float("inf"), (self.alpha, self.bound))):
            raise SpearError(f"{where}: the compensator holds non-finite values")


def factors(comp: nn.Module) -> ECFactors:
    """The runtime factors of an attached compensator (LowRankCompensator or GatedCompensator)."""
    from spear.compensate.ec import GatedCompensator
    from spear.compensate.lowrank import LowRankCompensator

    with torch.no_grad():
        if isinstance(comp, LowRankCompensator):
            return ECFactors(comp.A.detach().float(), comp.B.detach().float())
        if isinstance(comp, GatedCompensator):
            g = comp.export_gate()
            gate = {k: g[k].float() for k in ("w1", "b1", "w2", "b2")} if comp.gated else {}
            return ECFactors(g["A"].float(), g["B"].float(), float(g["alpha"]), bound=float(g["bound"]), **gate)
    raise SpearError(f"no runtime form for a compensator of type {type(comp).__name__}")
