"""The whole default job (``spear run``): FP, the quantized base, static baselines.

Every row is evaluated on the same text windows and, except LoftQ (which
re-quantizes by design), on the same quantized weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spear.compensate.static import attach_static, needs_stats, remove_compensators
from spear.compensate.stats import collect_activation_stats
from spear.config import EvalConfig, QuantConfig, StaticCompensationConfig
from spear.data import TokenSplit, load_text, make_split
from spear.eval.memory import compensator_bytes, quantized_model_bytes
from spear.eval.perplexity import perplexity
from spear.eval.report import Row, fill_gap
from spear.models.loading import load_model
from spear.models.modules import quantizable_linears
from spear.quant.api import quantize_model

STATIC_LABELS = {"identity": "ZeroQuant-V2 / LQER-plain", "loftq": "LoftQ", "lqer": "LQER (L²QER)",
                 "qera-approx": "QERA-approx", "qera-exact": "QERA-exact"}


@dataclass
class JobResult:
    rows: list[Row]
    header: dict


def load_split(tokenizer, cfg: EvalConfig) -> TokenSplit:
    return make_split(load_text(cfg.text), tokenizer, cfg.seq_len, cfg.eval_windows, cfg.calib_windows)


def _snapshot(modules):
    return {n: (m.codes.clone(), m.scales.clone(), m.zeros.clone()) for n, m in modules.items()}


def _restore(modules, snap):
    for n, m in modules.items():
        m.set_quantized(*snap[n])


def run_job(model_name: str, quant: QuantConfig, eval_cfg: EvalConfig, static_methods: list[str],
            rank: int = 4, plan: dict[str, int] | None = None, progress: bool = True, log=print) -> JobResult:
    model, tokenizer = load_model(model_name)
    split = load_split(tokenizer, eval_cfg)
    log(f"text: {split.describe()}")

    def ppl(desc):
        return perplexity(model, split.eval, eval_cfg.batch_size, progress, desc)

    fp = ppl("FP")
    log(f"FP ppl {fp.ppl:.3f} ({fp.tokens} tokens)")
    targets = quantizable_linears(model, quant.include_lm_head)
    fp_weights = {n: lin.weight.detach().clone() for n, lin in targets.items()}
    stats = None
    if any(needs_stats(m) for m in static_methods):
        if split.calib.shape[0] == 0:
            raise ValueError("static methods with activation statistics need --calib-windows >= 1")
        stats = collect_activation_stats(model, targets, split.calib, outer="qera-exact" in static_methods,
                                         progress=progress)
    channel_scales: dict = {}
    modules = quantize_model(model, quant, calib=split.calib if quant.calib.source == "text" else None,
                             progress=progress, tokenizer=tokenizer, channel_scales=channel_scales)
    if channel_scales:  # AWQ scaled the linears: compensate against the scaled weights
        from spear.quant.awq import rescale_reference
        fp_weights, stats = rescale_reference(fp_weights, stats, channel_scales)
    base = ppl(quant.label)
    log(f"{quant.label} ppl {base.ppl:.3f}")
    total = quantized_model_bytes(model)
    rows = [Row("FP", fp.ppl, details={"tokens": fp.tokens}), Row(quant.label, base.ppl)]
    snap = _snapshot(modules)
    for method in static_methods:
        cfg = StaticCompensationConfig(method=method, rank=rank, plan=plan)
        applied = attach_static(modules, fp_weights, cfg, stats, progress=progress)
        extra = compensator_bytes(model)
        label = f"{STATIC_LABELS[method]} " + (f"r{rank}" if plan is None else "plan")
        res = ppl(label)
        log(f"{label} ppl {res.ppl:.3f}, +{100 * extra / total:.2f}% memory")
        rows.append(Row(label, res.ppl, 100.0 * extra / total, extra,
                        details={"method": method, "modules": len(applied), "rank": rank if plan is None else "plan"}))
        remove_compensators(model)
        if method == "loftq":
            _restore(modules, snap)
    fill_gap(rows, fp.ppl, base.ppl)
    header = {"model": model_name, "text": split.text_name, "quant": quant.label, "seq_len": split.seq_len,
              "eval_windows": split.eval.shape[0], "tokens_scored": fp.tokens,
              "calib_windows": split.calib.shape[0], "quantized_model_bytes": total,
              "modules": len(modules), "torch": torch.__version__}
    return JobResult(rows, header)
