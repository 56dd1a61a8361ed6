"""One entry point for every quantizer: ``quantize_model(model, cfg, calib, tokenizer=...)``."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from spear.config import QuantConfig
from spear.errors import SpearError
from spear.quant.linear import QuantLinear
from spear.quant.rtn import quantize_model_rtn


def calibration_ids(model: nn.Module, cfg: QuantConfig, calib: torch.Tensor | None = None, tokenizer=None,
                    progress: bool = True) -> torch.Tensor:
    """The (n, L) token ids GPTQ/AWQ/OmniQuant calibrate on.

    Ids passed as ``calib`` are used as given (text windows, or self-samples a caller
    already drew, e.g. for the compensator calibration). Otherwise ``cfg.calib.source``
    decides: ``"self"`` samples sequences from ``model`` itself (cached on disk, shared
    with the compensator calibration; needs ``tokenizer``), ``"text"`` is an error
    because the windows are missing.
    """
    if calib is not None:
        if calib.dim() != 2 or calib.shape[0] == 0 or calib.shape[1] < 1:
            raise SpearError(f"calibration ids must be a non-empty (n, seq_len) tensor, got shape {tuple(calib.shape)}")
        return calib
    if cfg.calib.source == "text":
        raise SpearError("calibration source 'text' needs (n, seq_len) token windows passed as calib; none were given")
    if tokenizer is None:
        raise SpearError("calibration source 'self' needs the model's tokenizer to sample from the model")
    from spear.data.selfsample import sample_sequences

    c = cfg.calib
    sample = c.self_samples(c.n_samples, c.seq_len)
    return sample_sequences(model, tokenizer, sample, cache=True, progress=progress)


@dataclass
class Reference:
    """What compensators are fitted against: the FP weights (name -> weight) and the statistics of
    their inputs (None when the method needs none)."""

    fp_weights: dict
    stats: dict | None = None


def quantize_for_compensation(model: nn.Module, cfg: QuantConfig, references: list, calib: torch.Tensor | None = None,
                              progress: bool = True, tokenizer=None) -> dict[str, QuantLinear]:
    """``quantize_model``, then each of ``references`` (anything with ``fp_weights`` and ``stats``:
    a Reference, a CalibrationData) moved to the weights the method rounded: AWQ, and OmniQuant with
    its learnable equivalent transformation (``OmniQuantConfig.let``), scale each linear's input
    channels before rounding, so their compensators make up for the error against the scaled weights
    (spear/quant/fold.py, ``rescale_reference``). The other methods (RTN, GPTQ, OmniQuant's clipping
    alone) round the FP weights themselves and leave them as they are."""
    channel_scales: dict = {}
    modules = quantize_model(model, cfg, calib, progress, tokenizer, channel_scales)
    if channel_scales:
        from spear.quant.fold import rescale_reference

        for ref in references:
            ref.fp_weights, ref.stats = rescale_reference(ref.fp_weights, ref.stats, channel_scales)
    return modules


def quantize_model(model: nn.Module, cfg: QuantConfig, calib: torch.Tensor | None = None,
                   progress: bool = True, tokenizer=None, channel_scales: dict | None = None) -> dict[str, QuantLinear]:
    """Quantize ``model`` in place with ``cfg.method``; returns ``{name: QuantLinear}``.

    RTN needs no data. GPTQ, AWQ and OmniQuant calibrate layer by layer on the ids chosen by
    :func:`calibration_ids`: ``calib`` (n, L) when given, else sequences sampled
    from the model with ``tokenizer`` (``cfg.calib.source == "self"``).
    AWQ and OmniQuant with LET fill ``channel_scales`` with how they rescaled each linear (see
    :func:`spear.quant.fold.rescale_reference`); other methods leave it empty.
    """
    if cfg.separate_head:
        # the body with its own method, then the head alone: RTN per-channel symmetric at head_bits
        out = quantize_model(model, replace(cfg, include_lm_head=False, head_bits=0), calib, progress, tokenizer,
                             channel_scales)
        head = QuantConfig(bits=cfg.head_bits, group_size=0, symmetric=True, include_lm_head=True)
        return {**out, **quantize_model_rtn(model, head, progress=False)}
    if cfg.method == "rtn":
        return quantize_model_rtn(model, cfg, progress=progress)
    if cfg.method not in ("gptq", "awq", "omniquant"):
        raise SpearError(f"quantization method {cfg.method!r} is not available in this build")
    ids = calibration_ids(model, cfg, calib, tokenizer, progress)
    if cfg.method == "gptq":
        from spear.quant.gptq import quantize_model_gptq

        return quantize_model_gptq(model, cfg, ids, progress=progress)
    if cfg.method == "omniquant":
        from spear.quant.omniquant import quantize_model_omniquant

        return quantize_model_omniquant(model, cfg, ids, progress=progress, channel_scales=channel_scales)
    from spear.quant.awq import quantize_model_awq

    return quantize_model_awq(model, cfg, ids, progress=progress, channel_scales=channel_scales)
