"""KL-tuned quantization scales: a trainable log-factor per stored scale (PEQA / EfficientQAT-style).

While :func:`tunable_scales` is active, every :class:`QuantLinear` of the model computes
with ``dequantize(codes, scales · exp(t), zeros)``, where ``t`` (same shape as ``scales``,
fp32, initialised at 0) is a trainable tensor held by the :class:`ScaleFactors` it yields;
the codes and zero points stay fixed. The weight is recomputed from ``t`` on every call
(the module's dequantized-weight cache is bypassed); per-channel scales multiply the output of
the integer weight instead. On a normal exit the factors are
folded into the fp16 scale buffers, ``scales = (scales.float() · exp(t)).half()``; on an
exception the scales are left untouched. Either way every trace of the tuning is removed
and the weight caches are dropped, so the modules are plain QuantLinears again (same
state-dict keys, nothing extra for checkpoints, kernel packing or serving). Costs no
memory at deployment: the scales are stored anyway.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from spear.quant.linear import QuantLinear
from spear.quant.primitives import dequantize


class ScaleFactors:
    """The trainable log-factors ``t`` of one model's QuantLinears, keyed by module name."""

    def __init__(self, modules: dict[str, QuantLinear]):
        self.modules = modules
        self.factors: dict[str, nn.Parameter] = {
            n: nn.Parameter(torch.zeros(m.scales.shape, dtype=torch.float32, device=m.scales.device))
            for n, m in modules.items()}

    def parameters(self) -> list[nn.Parameter]:
        return list(self.factors.values())

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        for n, t in self.factors.items():
            yield f"{n}.scale_log_factor", t

    def effective_scales(self, name: str) -> torch.Tensor:
        """fp32 ``scales · exp(t)`` of one module (differentiable in ``t``)."""
        return self.modules[name].scales.float() * self.factors[name].exp()

    def folded_scales(self, name: str) -> torch.Tensor:
        """The fp16 scales the module will store after folding."""
        with torch.no_grad():
            return self.effective_scales(name).to(torch.float16)

    def state(self) -> dict[str, torch.Tensor]:
        return {n: t.detach().clone() for n, t in self.factors.items()}

    @torch.no_grad()
    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        for n, t in self.factors.items():
            t.copy_(state[n])


def _tuned_base_forward(mod: QuantLinear, t: torch.Tensor):
    if mod.group_size == 0:
        return _tuned_channel_forward(mod, t)

    def base_forward(x: torch.Tensor) -> torch.Tensor:
        scales = mod.scales.float() * t.exp()
        w = dequantize(mod.codes, scales, mod.zeros, mod.group_size, x.dtype)
        return F.linear(x, w.to(x.device), None if mod.bias is None else mod.bias.to(x.dtype))
    return base_forward


def _tuned_channel_forward(mod: QuantLinear, t: torch.Tensor):
    """Per-channel scales: ``x (codes - zeros)ᵀ`` times each row's scale. The scales' gradient is then
    elementwise, where the dequantized weight's form needs a weight-gradient matmul per step (a third
    more of a training step's work); the integer weight is exact in any float dtype and cached."""
    unit: dict[torch.dtype, torch.Tensor] = {}

    def base_forward(x: torch.Tensor) -> torch.Tensor:
        q = unit.get(x.dtype)
        if q is None:
            ones = torch.ones(mod.scales.shape, dtype=torch.float32, device=mod.scales.device)
            q = unit[x.dtype] = dequantize(mod.codes, ones, mod.zeros, 0, x.dtype).to(x.device)
        y = F.linear(x, q)
        y = (y.float() * (mod.scales.float() * t.exp()).reshape(-1).to(y.device)).to(y.dtype)
        return y if mod.bias is None else y + mod.bias.to(y.dtype)
    return base_forward


@contextlib.contextmanager
def tunable_scales(model: nn.Module) -> Iterator[ScaleFactors]:
    """Make the scales of every QuantLinear of ``model`` trainable (see the module docstring)."""
    modules = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    tuner = ScaleFactors(modules)
    patched: list[QuantLinear] = []
    ok = False
    try:
        for n, mod in modules.items():
            mod.base_forward = _tuned_base_forward(mod, tuner.factors[n])
            patched.append(mod)
            mod.drop_cache()
        yield tuner
        ok = True
    finally:
        for mod in patched:
            del mod.base_forward
        if ok:
            folded = {n: tuner.folded_scales(n) for n in modules}
            with torch.no_grad():
                for n, mod in modules.items():
                    mod.scales.copy_(folded[n])
        for mod in modules.values():
            mod.drop_cache()


def norm_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The normalisation layers of ``model`` with an elementwise weight (RMSNorm, LayerNorm)."""
    out = {}
    for n, m in model.named_modules():
        w = getattr(m, "weight", None)
        if (isinstance(m, nn.LayerNorm) or type(m).__name__.endswith("RMSNorm")) and \
                isinstance(w, nn.Parameter) and w.dim() == 1:
            out[n] = m
    return out


class NormWeights:
    """The elementwise weights of a model's norm layers, trained in place (norm tweaking)."""

    def __init__(self, modules: dict[str, nn.Module]):
        self.modules = modules

    def parameters(self) -> list[nn.Parameter]:
        return [m.weight for m in self.modules.values()]

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        for n, m in self.modules.items():
            yield f"{n}.weight", m.weight

    def state(self) -> dict[str, torch.Tensor]:
        return {n: m.weight.detach().clone() for n, m in self.modules.items()}

    @torch.no_grad()
    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        for n, m in self.modules.items():
            m.weight.copy_(state[n])


@contextlib.contextmanager
def tunable_norms(model: nn.Module) -> Iterator[NormWeights]:
    """Make the norm weights of ``model`` trainable in place.

    They are stored in every checkpoint anyway (no extra memory). On a normal exit the trained
    weights stay; on an exception the original weights are restored. ``requires_grad`` is off again
    on exit either way.
    """
    modules = norm_modules(model)
    if not modules:
        raise ValueError("the model has no RMSNorm/LayerNorm weights to tune")
    tuner = NormWeights(modules)
    original = tuner.state()
    ok = False
    try:
        for m in modules.values():
            m.weight.requires_grad_(True)
        yield tuner
        ok = True
    finally:
        if not ok:
            tuner.load_state(original)
        for m in modules.values():
            m.weight.requires_grad_(False)
