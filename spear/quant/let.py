"""OmniQuant's learnable equivalent transformation (LET; Shao et al., ICLR 2024, §3.3), weight-only.

For linears sharing an input x, ``W x = (W·diag(s)) (diag(s)⁻¹ x)``; ``diag(s)⁻¹`` is folded into
the op that produces x (a norm's weight, or a linear producer's rows: v_proj for o_proj, up_proj for
down_proj; with grouped KV heads one factor per v_proj row, repeated over the attention heads that read
it), so the FP function is unchanged and only what is rounded moves: ``Q(W·diag(s))``. This is
the weight-only form OmniQuant uses for Llama-family models (a per-input-channel scale, no shift:
their norms and linears have no bias to absorb one). Here the scales start from AWQ's search, folded
by :func:`spear.quant.awq.scale_layer` (which also decides which groups can be folded at all and
checks each fold), where the paper starts from SmoothQuant's, and a per-channel factor ``e^t`` on
top of them, ``t = 0`` at the start, is trained with the clipping of :mod:`spear.quant.omniquant`
under the layer's output error. A log-scale keeps every factor positive whatever the optimiser does.

On a CPU's budget the start does the work: from AWQ's scales and the searched clip, a full-batch
straight-through gradient step on the scales or the clip lowers a layer's output error by at most
0.03%, and longer steps raise it (default model, W4 g64, layers 5 and 20; 2-core CPU, 2026-12-07),
so at g64 training is kept in 2 of 30 layers; what LET adds over the clipping alone is the folded
scales (g64 perplexity 28.78 from the start alone, 28.86 trained, 29.70 without LET).

While training, the factor is a :mod:`torch.nn.utils.parametrize` parametrization of the weights it
touches (consumers ``W·diag(e^t)``, a linear producer ``diag(e^t)⁻¹·W``, a norm ``w / e^t``), so the
fake-quantized consumers and the producer see the same ``t`` and the gradient reaches it through both.
:func:`bake` then writes the scaled weights in place and removes the parametrizations.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils import parametrize

from spear.config import QuantConfig
from spear.quant.awq import scale_layer
from spear.quant.fold import SAME, ChannelScales, Spread, record
from spear.quant.calib import InputStats, LayerBatch


class _ScaleColumns(nn.Module):
    """A consumer's weight times its input channels' factors: ``W·diag(e^t)`` (``t`` spread over the
    attention heads that read one KV head where the group has a :class:`Spread`)."""

    def __init__(self, t: nn.Parameter, spread: Spread):
        super().__init__()
        self.t, self.spread = t, spread

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w * self.spread.to_consumers(torch.exp(self.t)).to(w.dtype)


class _DivideOutputs(nn.Module):
    """A producer's weight divided by its output channels' factors: a linear's rows, or a norm's vector."""

    def __init__(self, t: nn.Parameter):
        super().__init__()
        self.t = t

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        inv = torch.exp(-self.t).to(w.dtype)
        return w * (inv.unsqueeze(1) if w.dim() == 2 else inv)


@dataclass
class LetGroup:
    """One folded group: its producer and consumers (names relative to the layer), the scale AWQ folded
    (``start``, the consumers' (in,)), the trained log-factor on top of it (``t``, one per producer
    channel, 0 at the start) and how the producer's channels reach the consumers' inputs."""

    producer: str
    consumers: list[str]
    start: torch.Tensor
    t: nn.Parameter
    spread: Spread = SAME

    def scales(self) -> torch.Tensor:
        """The whole scale of the consumers' input channels: AWQ's start times the learned factor."""
        return self.start * self.spread.to_consumers(torch.exp(self.t.detach())).to(self.start.dtype)


@dataclass
class LetStart:
    """LET's start for one layer: the groups folded with AWQ's scales, every linear's input statistics after
    the folds, and the layer's parameters as they were before them (for :meth:`undo`)."""

    groups: list[LetGroup]
    stats: dict[str, InputStats]
    before: list[tuple[nn.Parameter, torch.Tensor]]

    @torch.no_grad()
    def undo(self) -> None:
        """Put the layer's parameters back as they were before the folds and start every group from a scale
        of 1: the same groups then train from the unscaled weights."""
        for p, old in self.before:
            p.copy_(old)
        for g in self.groups:
            g.start = torch.ones_like(g.start)


@torch.no_grad()
def fold_start(layer_name: str, layer: nn.Module, batches: list[LayerBatch], cfg: QuantConfig,
               uses: Counter) -> LetStart:
    """AWQ's scales folded into ``layer`` in place (the function unchanged), as LET's start, each group with
    ``t = 0``. o_proj folds into v_proj with grouped KV heads too (one factor per KV-head channel). A group
    AWQ could not fold (shared parameters, a producer with no per-channel weight) has no LET either; with
    none the layer is left as it is."""
    before = [(p, p.detach().clone()) for p in layer.parameters()]
    report: list = []
    scales: dict[str, ChannelScales] = {}
    stats = scale_layer(layer_name, layer, batches, cfg, uses, report, scales, method="OmniQuant LET",
                        spread_kv_heads=True)
    groups = []
    for r in report:
        if r.applied:
            start = scales[f"{layer_name}.{r.consumers[0]}"].input
            t = torch.zeros(r.spread.to_producer(start).shape, dtype=torch.float32, device=start.device)
            groups.append(LetGroup(r.producer, list(r.consumers), start, nn.Parameter(t), r.spread))
    return LetStart(groups, stats, before)


def attach(groups: list[LetGroup], modules: dict[str, nn.Module]) -> None:
    """Parametrize the weights each group touches with its ``t``; ``modules``: name (relative to the layer)
    -> the module holding the weight (the plain ``nn.Linear`` for a wrapped linear, the norm)."""
    for g in groups:
        for n in g.consumers:
            parametrize.register_parametrization(modules[n], "weight", _ScaleColumns(g.t, g.spread))
        parametrize.register_parametrization(modules[g.producer], "weight", _DivideOutputs(g.t))


@torch.no_grad()
def reset(groups: list[LetGroup]) -> None:
    """Every factor back to 1 (the start)."""
    for g in groups:
        g.t.zero_()


@torch.no_grad()
def bake(groups: list[LetGroup], modules: dict[str, nn.Module], layer_name: str, channel_scales: dict) -> None:
    """Write the scaled weights in place, remove the parametrizations, and record each linear's whole scale
    (AWQ's start times the learned factor) in ``channel_scales`` (``layer_name.linear`` ->
    :class:`ChannelScales`, as :func:`spear.quant.fold.rescale_reference` reads it)."""
    touched = {n for g in groups for n in (*g.consumers, g.producer)}
    for n in touched:
        parametrize.remove_parametrizations(modules[n], "weight", leave_parametrized=True)
    for g in groups:
        record(channel_scales, layer_name, g.consumers, g.producer, isinstance(modules[g.producer], nn.Linear),
               g.scales(), g.spread)
