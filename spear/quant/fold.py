"""Equivalent per-input-channel scaling of linears sharing an input: where a scale can be folded, and how.

For linears sharing an input x, ``W x = (W·diag(s)) (diag(s)⁻¹ x)``. ``diag(s)⁻¹`` is folded into the op that
produces x, so the model's function is unchanged before quantization:

- a norm (RMSNorm/LayerNorm) whose output *is* the group's input: weight and bias ÷ s;
- a linear whose output reaches the group through per-channel-linear ops only
  (v_proj → attention → o_proj, up_proj → ⊙ act(gate) → down_proj): its rows ÷ s. With grouped KV
  heads v_proj has fewer outputs than o_proj takes inputs (attention head h reads KV head h // G); such a
  fold is taken only when asked (``spread_kv_heads``): one scale per KV-head channel, repeated over the G
  attention heads that read it (:class:`Spread`).

AWQ (:mod:`spear.quant.awq`) searches the scales and OmniQuant's LET (:mod:`spear.quant.let`) trains them
on top; both fold through here, record each linear's scales (:class:`ChannelScales`) and map the original
weights to the ones rounded (:func:`rescale_reference`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from spear.quant.calib import InputStats, LayerBatch, first_sequence, layer_forward

# Producer linears whose output feeds a group through per-channel-linear ops only,
# by the module names of Llama-family blocks: consumer -> producer (a sibling).
LINEAR_FOLDS = {"o_proj": "v_proj", "down_proj": "up_proj"}


@dataclass(frozen=True)
class Spread:
    """How a producer's per-channel vector reaches its consumers' input channels: each of ``repeat`` attention
    heads of ``head_dim`` channels reads one KV head (``repeat`` 1: channel for channel)."""

    repeat: int = 1
    head_dim: int = 0

    def to_consumers(self, x: torch.Tensor) -> torch.Tensor:
        """(kv·head_dim,) -> (kv·repeat·head_dim,): KV head k's channels for attention heads k·G … k·G + G − 1,
        the order of transformers' ``repeat_kv``."""
        if self.repeat == 1:
            return x
        return x.reshape(-1, 1, self.head_dim).expand(-1, self.repeat, self.head_dim).reshape(-1)

    def to_producer(self, x: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`to_consumers` on a vector that repeats: each KV-head channel's value."""
        if self.repeat == 1:
            return x
        return x.reshape(-1, self.repeat, self.head_dim)[:, 0].reshape(-1)

    def pool(self, x: torch.Tensor) -> torch.Tensor:
        """A consumer-side statistic (mean |x| per input channel) averaged over the heads reading each KV channel."""
        if self.repeat == 1:
            return x
        return x.reshape(-1, self.repeat, self.head_dim).mean(1).reshape(-1)


SAME = Spread()


@dataclass
class ChannelScales:
    """How AWQ rescaled one linear: weight ``diag(output)⁻¹ · W · diag(input)``, input ``x / input``."""

    input: torch.Tensor | None = None
    output: torch.Tensor | None = None


@dataclass
class FoldResult:
    """What happened to one group of a layer: scaled (with α) or skipped (with why)."""

    layer: str
    producer: str | None
    consumers: list[str]
    alpha: float | None
    applied: bool
    reason: str = ""
    spread: Spread = SAME


def producers(layer: nn.Module, batch: LayerBatch) -> tuple[dict[int, str], Counter]:
    """For one traced forward: consumer linear -> the module whose output it takes as is,
    and how often each module ran."""
    outputs: dict[int, tuple[str, torch.Tensor]] = {}
    calls: Counter = Counter()

    def hook(name):
        def fn(_mod, _args, out):
            calls[name] += 1
            if isinstance(out, torch.Tensor):
                outputs[id(out)] = (name, out)  # holding out keeps its id unique
        return fn

    handles = [m.register_forward_hook(hook(n)) for n, m in layer.named_modules() if n]
    by_consumer: dict[str, str] = {}

    def pre_hook(name):
        # Matched at call time: the input must be the very tensor a module returned.
        # Returns None, since a pre-hook's return value would replace the input.
        def fn(_mod, args):
            made = outputs.get(id(args[0]))
            if name not in by_consumer and made is not None and made[1] is args[0]:
                by_consumer[name] = made[0]
        return fn

    pre = [m.register_forward_pre_hook(pre_hook(n)) for n, m in layer.named_modules() if type(m) is nn.Linear]
    try:
        layer_forward(layer, LayerBatch(batch.hidden[:1], first_sequence(batch.kwargs, batch.hidden.shape[0])))
    finally:
        for hd in handles + pre:
            hd.remove()
    return by_consumer, calls


def find_producer(layer: nn.Module, group: list[str], fed_by: dict[str, str], spread_kv_heads: bool
                   ) -> tuple[str | None, str, Spread]:
    """The module to fold a group's inverse scale into, or None and why; and how its channels reach the
    group's inputs."""
    in_f = layer.get_submodule(group[0]).in_features
    name = fed_by.get(group[0])
    if name is not None:
        mod = layer.get_submodule(name)
        w = getattr(mod, "weight", None)
        if type(mod) is not nn.Linear and isinstance(w, torch.Tensor) and tuple(w.shape) == (in_f,):
            return name, "", SAME
        return None, f"its input comes from {name} ({type(mod).__name__}), which has no per-channel weight to fold into", SAME
    parent, _, kind = group[0].rpartition(".")
    if len(group) == 1 and kind in LINEAR_FOLDS:
        sibling = f"{parent}.{LINEAR_FOLDS[kind]}" if parent else LINEAR_FOLDS[kind]
        try:
            mod = layer.get_submodule(sibling)
        except AttributeError:
            return None, f"no {sibling} to fold into", SAME
        out_f = getattr(mod, "out_features", None)
        if type(mod) is nn.Linear and out_f == in_f:
            return sibling, "", SAME
        why = f"{sibling} has {out_f} outputs, {group[0]} takes {in_f} inputs"
        if type(mod) is nn.Linear and kind == "o_proj":
            attn = layer.get_submodule(parent) if parent else layer
            head_dim, repeat = getattr(attn, "head_dim", None), getattr(attn, "num_key_value_groups", None)
            if isinstance(head_dim, int) and isinstance(repeat, int) and out_f * repeat == in_f \
                    and out_f % head_dim == 0:
                if spread_kv_heads:
                    return sibling, "", Spread(repeat, head_dim)
                why += f" (grouped KV heads, {repeat} attention heads each)"
        return None, why, SAME
    return None, "no producer with a per-channel weight was found", SAME


def fold(producer: nn.Module, consumers: list[nn.Linear], s: torch.Tensor, spread: Spread) -> None:
    for c in consumers:
        c.weight.data.mul_(s.to(c.weight.dtype))
    inv = 1.0 / spread.to_producer(s)
    if type(producer) is nn.Linear:
        producer.weight.data.mul_(inv.to(producer.weight.dtype).unsqueeze(1))
    else:
        producer.weight.data.mul_(inv.to(producer.weight.dtype))
    bias = getattr(producer, "bias", None)
    if isinstance(bias, torch.Tensor):
        bias.data.mul_(inv.to(bias.dtype))


def scaled_stats(st: InputStats, s: torch.Tensor) -> InputStats:
    """Statistics of x / s, the consumers' input after a fold."""
    inv = 1.0 / s
    return InputStats(st.hessian * inv.unsqueeze(0) * inv.unsqueeze(1), st.mean_abs * inv, st.tokens)


def record(channel_scales: dict, layer_name: str, consumers: list[str], producer: str, producer_is_linear: bool,
           s: torch.Tensor, spread: Spread) -> None:
    """Note in ``channel_scales`` (``layer_name.linear`` -> :class:`ChannelScales`) that ``consumers`` take
    inputs scaled by ``s`` and, when the producer is a linear, that its rows were divided by its share of it."""
    for n in consumers:
        channel_scales.setdefault(f"{layer_name}.{n}", ChannelScales()).input = s
    if producer_is_linear:
        channel_scales.setdefault(f"{layer_name}.{producer}", ChannelScales()).output = spread.to_producer(s)


def rescale_reference(fp_weights: dict[str, torch.Tensor], stats: dict | None,
                      channel_scales: dict[str, ChannelScales]):
    """The unquantized reference of an AWQ model: the weights AWQ rounded and the statistics of their inputs.

    ``fp_weights`` (name -> original weight) and ``stats`` (name ->
    :class:`spear.compensate.stats.ActivationStats`, taken on the unscaled model) are
    what error compensation needs; after AWQ a linear's weight is
    ``diag(output)⁻¹ · W · diag(input)`` and its input ``x / input``. Returns new
    dicts; statistics shared by several modules stay shared.
    """
    from dataclasses import replace

    weights = {}
    for n, w in fp_weights.items():
        cs = channel_scales.get(n)
        if cs is not None and cs.input is not None:
            w = w * cs.input.to(w.dtype)
        if cs is not None and cs.output is not None:
            w = w / cs.output.to(w.dtype).unsqueeze(1)
        weights[n] = w
    if stats is None:
        return weights, None
    done: dict[int, object] = {}
    out = {}
    for name, st in stats.items():
        cs = channel_scales.get(name)
        if cs is None or cs.input is None:
            out[name] = st
            continue
        if id(st) not in done:
            inv = 1.0 / cs.input.to(st.abs_sum.dtype)
            done[id(st)] = replace(st, abs_sum=st.abs_sum * inv, sq_sum=st.sq_sum * inv * inv,
                                   outer_sum=None if st.outer_sum is None else st.outer_sum * inv.unsqueeze(0) * inv.unsqueeze(1))
        out[name] = done[id(st)]
    return weights, out
