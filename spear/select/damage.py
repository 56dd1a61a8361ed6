"""Training-free damage of each linear under quantization (SPEAR.md §1, "Where to put ECs").

damage(m) = 1 − CKA(h_FP, h_m), where h are the model's final hidden states (after
the last norm: what the output head reads) on self-sampled sequences, and h_m is
computed with only module m quantized, every other module in full precision.

Speed: one FP pass caches each decoder layer's output. For a module in layer l the
layers before l are replaced by a replay of the cached output of layer l − 1, so
only layers l… run (about half the model on average). The replay is checked once
against a plain forward; a model whose layers do not allow it falls back to full
forwards. And the scored passes stop at the final norm: they run the model's body
(``base_model``) without the output head, whose logits nobody reads (on the default model the
head is half the work of an average replayed pass). Checked once too: where the body's last
hidden state is not the model's final hidden state, the whole model runs.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from spear.config import QuantConfig
from spear.errors import SpearError
from spear.models.modules import quantizable_linears
from spear.quant.calib import find_decoder_layers
from spear.quant.primitives import fake_quantize
from spear.select.cka import linear_cka

log = logging.getLogger(__name__)


@dataclass
class DamageReport:
    damage: dict[str, float]  # module name -> 1 - CKA
    seconds: float
    tokens: int
    replay: bool  # whether the layer-replay shortcut was used
    extra: dict = field(default_factory=dict)


class _Replay(nn.Module):
    """Stands in for the decoder layers before l: returns layer l-1's cached output."""

    def __init__(self):
        super().__init__()
        self.output = None

    def forward(self, *args, **kwargs):
        return self.output


def _decoder_layers(model: nn.Module, names) -> tuple[str, nn.ModuleList] | None:
    """The decoder layers (:func:`spear.quant.calib.find_decoder_layers`), if they hold every target."""
    try:
        prefix, layers = find_decoder_layers(model)
    except SpearError:
        return None
    if len(layers) < 2 or not all(n.startswith(prefix + ".") for n in names):
        return None
    return prefix, layers


def _layer_of(name: str, prefix: str) -> int:
    return int(name[len(prefix) + 1:].split(".", 1)[0])


@torch.no_grad()
def module_damage(model: nn.Module, quant: QuantConfig, ids: torch.Tensor, batch_size: int = 8,
                  modules: dict[str, nn.Linear] | None = None, progress: bool = True,
                  replay: bool = True) -> DamageReport:
    """1 − CKA of the final hidden states with one module at a time quantized by RTN at ``quant``'s
    bits/group/symmetry (GPTQ/AWQ bases are scored with this RTN proxy)."""
    targets = modules if modules is not None else quantizable_linears(model, quant.include_lm_head)
    if not targets:
        raise ValueError("no modules to score")
    device = next(model.parameters()).device
    batches = [ids[i:i + batch_size].to(device) for i in range(0, ids.shape[0], batch_size)]
    found = _decoder_layers(model, targets) if replay else None
    start = time.perf_counter()

    body = None  # the model without its output head, once checked against the whole model

    def final_hidden(batch):
        if body is not None:
            h = body(input_ids=batch, use_cache=False).last_hidden_state
        else:
            h = model(input_ids=batch, use_cache=False, output_hidden_states=True).hidden_states[-1]
        return h.reshape(-1, h.shape[-1]).float()

    cached: list[list] = []
    handles = []
    if found is not None:
        prefix, layers = found
        for i, layer in enumerate(layers):
            handles.append(layer.register_forward_hook(
                lambda mod, args, out, i=i: cached[-1].__setitem__(i, out)))

    fp = []
    try:
        for b in batches:
            if found is not None:
                cached.append([None] * len(found[1]))
            fp.append(final_hidden(b))
    finally:
        for h in handles:
            h.remove()
    fp_all = torch.cat(fp)
    base = getattr(model, "base_model", None)
    if isinstance(base, nn.Module) and base is not model:
        body = base
        try:
            same = torch.allclose(final_hidden(batches[0]), fp[0], rtol=1e-5, atol=1e-5 * fp[0].abs().max().item())
        except (TypeError, AttributeError):  # a body that takes other arguments or returns no last_hidden_state
            same = False
        if not same:
            log.warning("the model body's last hidden state is not the final hidden state; scoring with the "
                        "whole model")
            body = None

    def run(l: int | None):
        """Final hidden states of every batch, replaying layers < l when l is given."""
        outs = []
        if not l or found is None:
            return torch.cat([final_hidden(b) for b in batches])
        layers = found[1]
        saved = [layers[i] for i in range(l)]
        rep = _Replay()
        try:
            for i in range(l):
                layers[i] = rep
            for bi, b in enumerate(batches):
                rep.output = cached[bi][l - 1]
                outs.append(final_hidden(b))
        finally:
            for i in range(l):
                layers[i] = saved[i]
        return torch.cat(outs)

    if found is not None:  # the replay must reproduce the plain forward
        mid = len(found[1]) // 2
        err = (run(mid) - fp_all).abs().max().item()
        if err > 1e-3 * fp_all.abs().max().item():
            log.warning("layer replay does not reproduce the forward (max diff %.3g); using full forwards", err)
            found = None

    damage = {}
    for name, lin in tqdm(targets.items(), desc="module damage (1 - CKA)", unit="mod", disable=not progress,
                          leave=False):
        w = lin.weight
        orig = w.data.clone()
        try:
            w.data.copy_(fake_quantize(orig.float(), quant.bits, quant.group_size, quant.symmetric).to(w.dtype))
            h = run(_layer_of(name, found[0]) if found is not None else None)
        finally:
            w.data.copy_(orig)
        damage[name] = max(0.0, 1.0 - linear_cka(fp_all, h))
    return DamageReport(damage, time.perf_counter() - start, int(fp_all.shape[0]), found is not None)
