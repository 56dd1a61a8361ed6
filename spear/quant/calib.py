"""Layer-by-layer calibration for GPTQ and AWQ, architecture-generic.

The decoder is processed one layer at a time so that memory stays bounded by one
layer's activations: the inputs of layer 0 are captured once (a forward pre-hook
records the hidden states and every keyword argument the model passes — attention
mask, position embeddings... — then stops the forward), each layer is quantized
from its own inputs, and the *quantized* layer's outputs become the next layer's
inputs, so later layers see (and compensate) the error of earlier ones.

Statistics of a linear's input are the mean of ``x xᵀ`` (the GPTQ Hessian up to a
factor 2, and the exact quadratic form of AWQ's output-error objective) and the
mean of ``|x|`` per channel. Linears fed the very same tensor (q/k/v, gate/up)
share one set of statistics.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from spear.errors import SpearError
from spear.models.modules import quantizable_linears
from spear.quant.linear import QuantLinear

log = logging.getLogger(__name__)


class _StopForward(Exception):
    """Raised from a hook to end a forward pass once what it needs is recorded."""


@dataclass
class LayerBatch:
    """One batch of a decoder layer's inputs: hidden states and the keyword arguments."""

    hidden: torch.Tensor
    kwargs: dict


@dataclass
class InputStats:
    """Mean ``x xᵀ`` (in, in) and mean ``|x|`` (in,) over the tokens one linear saw (fp32)."""

    hessian: torch.Tensor
    mean_abs: torch.Tensor
    tokens: int


def find_decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The ``nn.ModuleList`` holding the most linears, plain or quantized (the decoder layers)."""
    best: tuple[int, str, nn.ModuleList] | None = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 0:
            count = sum(type(m) is nn.Linear or isinstance(m, QuantLinear) for m in mod.modules())
            if count and (best is None or count > best[0]):
                best = (count, name, mod)
    if best is None:
        raise SpearError(f"found no list of layers holding linears in {type(model).__name__}; "
                         "layer-by-layer calibration needs a decoder made of an nn.ModuleList of blocks")
    return best[1], best[2]


@torch.no_grad()
def capture_layer_inputs(model: nn.Module, layer: nn.Module, ids: torch.Tensor, batch_size: int) -> list[LayerBatch]:
    """Run ``ids`` (n, L) through ``model`` up to ``layer`` and return what it is called with."""
    if ids.dim() != 2 or ids.shape[0] == 0:
        raise SpearError(f"calibration ids must be a non-empty (n, seq_len) tensor, got shape {tuple(ids.shape)}")
    device = next(model.parameters()).device
    batches: list[LayerBatch] = []

    def hook(_mod, args, kwargs):
        kwargs = dict(kwargs)
        hidden = args[0] if args else kwargs.pop("hidden_states")
        if len(args) > 1:
            raise SpearError(f"decoder layer {type(layer).__name__} takes {len(args)} positional inputs; "
                             "only the hidden states may be positional for layer-by-layer calibration")
        batches.append(LayerBatch(hidden.detach(), {k: _detach(v) for k, v in kwargs.items()}))
        raise _StopForward

    handle = layer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for start in range(0, ids.shape[0], batch_size):
            try:
                model(input_ids=ids[start:start + batch_size].to(device), use_cache=False)
            except _StopForward:
                continue
            raise SpearError(f"the forward pass never reached {type(layer).__name__}; cannot capture its inputs")
    finally:
        handle.remove()
    return batches


def _detach(v):
    if isinstance(v, torch.Tensor):
        return v.detach()
    if isinstance(v, tuple):
        return tuple(_detach(x) for x in v)
    return v


def layer_forward(layer: nn.Module, batch: LayerBatch) -> torch.Tensor:
    out = layer(batch.hidden, **batch.kwargs)
    # Older transformers return (hidden, ...) from a decoder layer, newer a tensor.
    return out[0] if isinstance(out, (tuple, list)) else out


def linear_groups(layer: nn.Module, batch: LayerBatch) -> list[list[str]]:
    """Quantizable linears of ``layer`` (names relative to it) grouped by shared input, in call order."""
    names = {id(m): n for n, m in layer.named_modules() if type(m) is nn.Linear}
    order: list[tuple[str, int]] = []
    seen: dict[int, torch.Tensor] = {}

    def hook(mod, args):
        x = args[0]
        seen.setdefault(id(x), x)  # keep the tensor alive so its id is not reused
        order.append((names[id(mod)], id(x)))

    handles = [m.register_forward_pre_hook(hook) for m in layer.modules() if id(m) in names]
    try:
        with torch.no_grad():
            layer_forward(layer, LayerBatch(batch.hidden[:1], first_sequence(batch.kwargs, batch.hidden.shape[0])))
    finally:
        for h in handles:
            h.remove()
    groups: list[list[str]] = []
    by_input: dict[int, list[str]] = {}
    placed: set[str] = set()
    for name, key in order:
        if name in placed:
            continue
        placed.add(name)
        if key not in by_input:
            by_input[key] = []
            groups.append(by_input[key])
        by_input[key].append(name)
    missing = set(names.values()) - placed
    if missing:
        log.warning("linears never called by %s are left unquantized here: %s", type(layer).__name__, sorted(missing))
    return groups


def first_sequence(kwargs: dict, batch: int) -> dict:
    """Keyword arguments sliced to the first sequence where they carry a batch dimension."""
    def cut(v):
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == batch:
            return v[:1]
        if isinstance(v, tuple):
            return tuple(cut(x) for x in v)
        return v
    return {k: cut(v) for k, v in kwargs.items()}


@torch.no_grad()
def collect_input_stats(layer: nn.Module, batches: list[LayerBatch], names: list[str],
                        stop_after: bool = True) -> dict[str, InputStats]:
    """Input statistics of the linears ``names`` of ``layer`` over all ``batches``.

    With ``stop_after`` each forward ends as soon as a linear outside ``names`` runs
    after them (the group's inputs are then known), saving the rest of the layer.
    """
    modules = {n: layer.get_submodule(n) for n in names}
    targets = {id(m) for m in modules.values()}
    sums: dict[str, list] = {}
    shared: dict[int, tuple[str, torch.Tensor]] = {}
    state = {"seen": False}

    def stat_hook(name):
        def hook(_mod, args):
            x = args[0]
            state["seen"] = True
            owner = shared.get(id(x))
            if owner is not None and owner[1] is x:  # a sibling's very input: reuse its sums
                sums.setdefault(name, sums[owner[0]])
                return
            shared[id(x)] = (name, x)  # holding x keeps its id from being reused
            flat = x.detach().reshape(-1, x.shape[-1]).float()
            entry = sums.setdefault(name, [torch.zeros(flat.shape[1], flat.shape[1], device=flat.device),
                                           torch.zeros(flat.shape[1], device=flat.device), 0])
            entry[0].addmm_(flat.T, flat)
            entry[1].add_(flat.abs().sum(0))
            entry[2] += flat.shape[0]
        return hook

    def stop_hook(_mod, _args):
        if state["seen"]:
            raise _StopForward

    handles = [m.register_forward_pre_hook(stat_hook(n)) for n, m in modules.items()]
    if stop_after:
        handles += [m.register_forward_pre_hook(stop_hook) for m in layer.modules()
                    if type(m) is nn.Linear and id(m) not in targets]
    try:
        for batch in batches:
            state["seen"] = False
            shared.clear()
            try:
                layer_forward(layer, batch)
            except _StopForward:
                pass
    finally:
        for h in handles:
            h.remove()
    out: dict[str, InputStats] = {}
    made: dict[int, InputStats] = {}
    for name in names:
        if name not in sums:
            raise SpearError(f"linear {name} of {type(layer).__name__} saw no calibration input")
        h, a, n = sums[name]
        if id(h) not in made:
            made[id(h)] = InputStats(h / n, a / n, n)
        out[name] = made[id(h)]
    return out


@torch.no_grad()
def run_layerwise(model: nn.Module, ids: torch.Tensor, batch_size: int, process, desc: str,
                  include_lm_head: bool = False, progress: bool = True) -> tuple[dict[str, nn.Module], list[str]]:
    """Call ``process(layer_name, layer, batches)`` on every decoder layer in order.

    ``process`` replaces the layer's linears in place and returns ``{relative name:
    new module}``; the layer's outputs with the new modules feed the next layer.
    Returns ``{qualified name: new module}`` for the whole model and the names of
    the quantizable linears outside the decoder layers (left to the caller).
    """
    prefix, layers = find_decoder_layers(model)
    batches = capture_layer_inputs(model, layers[0], ids, batch_size)
    done: dict[str, nn.Module] = {}
    for i, layer in enumerate(tqdm(layers, desc=desc, unit="layer", disable=not progress, leave=False)):
        layer_name = f"{prefix}.{i}" if prefix else str(i)
        for rel, mod in process(layer_name, layer, batches).items():
            done[f"{layer_name}.{rel}"] = mod
        if i + 1 < len(layers):
            batches = [LayerBatch(layer_forward(layer, b), b.kwargs) for b in batches]
    del batches
    rest = [n for n in quantizable_linears(model, include_lm_head) if n not in done]
    return done, rest
