"""Arguments shared by several subcommands, and their conversion to configs."""

from __future__ import annotations

import argparse

from spear.config import EvalConfig, QuantConfig
from spear.errors import SpearError
from spear.models.loading import DEFAULT_MODEL


def _int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"expected a number >= {minimum}, got {v}")
        return v

    parse.__name__ = f"int>={minimum}"
    return parse


positive_int = _int_at_least(1)
nonneg_int = _int_at_least(0)

OVERWRITE_HELP = ("replace --out if it is a spear checkpoint holding nothing but its own files; a folder of anything "
                  "else, or one with other files beside the checkpoint's (notes.txt), is refused and nothing is "
                  "deleted")


def add_device_arg(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--device", default="auto",
                   help=f"torch device {what} on: cpu, cuda or cuda:N; auto = cuda when available, else cpu "
                        "(default: %(default)s)")


def device_from(args) -> str:
    """``--device`` resolved: ``auto`` is ``cuda`` where torch sees a GPU, else ``cpu``; a CUDA device that is
    not there, or a name torch does not know, is a SpearError (before any model loads)."""
    import torch

    if args.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(args.device)
    except (RuntimeError, ValueError):
        raise SpearError(f"--device {args.device!r} is not a torch device (cpu, cuda, cuda:N or auto)") from None
    if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
        raise SpearError(f"--device {args.device} asked for, but torch sees {torch.cuda.device_count()} CUDA "
                         "device(s)")
    if dev.type not in ("cpu", "cuda"):
        raise SpearError(f"--device {args.device}: spear runs on cpu or cuda")
    return str(dev)


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return v


def add_model_arg(p: argparse.ArgumentParser, default: str | None = DEFAULT_MODEL, verify: bool = False) -> None:
    p.add_argument("--model", default=default, required=default is None,
                   help=f"a local Hugging Face causal-LM folder, a spear checkpoint folder, or "
                        f"'{DEFAULT_MODEL}' (the embedded default){'' if default is None else ' (default: %(default)s)'}")
    if verify:
        p.add_argument("--verify", action="store_true",
                       help="check every tensor of a spear checkpoint against the SHA-256 recorded when it was "
                            "written (catches bit flips that leave values finite; reads the file once more)")


def add_text_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("text and evaluation protocol")
    g.add_argument("--text", default="wikipedia",
                   help="'wikipedia' (the embedded sample), 'wikitext2' (a cached datasets copy), "
                        "or a UTF-8 text file such as wiki.test.raw (default: %(default)s)")
    g.add_argument("--seq-len", type=positive_int, default=512, help="window length in tokens (default: %(default)s)")
    g.add_argument("--eval-windows", type=positive_int, default=24,
                   help="score the last N windows of the text (default: %(default)s)")
    g.add_argument("--calib-windows", type=nonneg_int, default=16,
                   help="activation statistics from the first N windows of the other articles (default: %(default)s)")
    g.add_argument("--batch-size", type=positive_int, default=1, help="windows per forward pass (default: %(default)s)")


def eval_config_from(args) -> EvalConfig:
    return EvalConfig(text=args.text, seq_len=args.seq_len, eval_windows=args.eval_windows,
                      calib_windows=args.calib_windows, batch_size=args.batch_size)


def add_quant_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("quantization")
    from spear.config import OMNIQUANT_INITS, QUANT_METHODS, OmniQuantConfig

    g.add_argument("--method", choices=QUANT_METHODS, default="rtn", help="quantizer (default: %(default)s)")
    g.add_argument("--bits", type=int, choices=[2, 3, 4, 8], default=4, help="weight bits (default: %(default)s)")
    g.add_argument("--group-size", type=nonneg_int, default=0,
                   help="input columns per scale; 0 = per-channel (default: %(default)s)")
    g.add_argument("--asym", action="store_true", help="asymmetric (integer zero point) instead of symmetric")
    g.add_argument("--include-lm-head", action="store_true", help="also quantize the output head")
    g.add_argument("--lm-head-bits", type=int, choices=[2, 3, 4, 8],
                   help="quantize the output head at this many bits, RTN per-channel symmetric (implies "
                        "--include-lm-head; 8 keeps nearly all of its accuracy and halves its bytes)")
    c = p.add_argument_group("GPTQ / AWQ / OmniQuant calibration")
    c.add_argument("--calib-source", choices=["self", "text"], default="self",
                   help="'self': sequences sampled from the FP model (data-free, cached); 'text': the "
                        "--calib-windows windows of --text (default: %(default)s)")
    c.add_argument("--calib-samples", type=positive_int, default=64,
                   help="self-sampled sequences (default: %(default)s)")
    c.add_argument("--calib-seq-len", type=positive_int, default=128,
                   help="length of each self-sampled sequence in tokens (default: %(default)s)")
    c.add_argument("--gptq-damp", type=float, default=0.01,
                   help="GPTQ dampening, fraction of the mean Hessian diagonal (default: %(default)s)")
    c.add_argument("--act-order", action="store_true",
                   help="GPTQ: quantize columns by decreasing Hessian diagonal (static groups)")
    c.add_argument("--awq-no-clip", action="store_true", help="AWQ: skip the clipping search")
    c.add_argument("--awq-rounding", choices=["rtn", "gptq"], default="rtn",
                   help="AWQ: how the scaled weights are rounded: to the nearest level, or with GPTQ's error "
                        "feedback (uses --gptq-damp; a lower base per channel, but a higher perplexity once "
                        "compensators are calibrated on it, BENCHMARKS.md; default: %(default)s)")
    c.add_argument("--awq-fold-kv-heads", action="store_true",
                   help="AWQ: also scale o_proj where attention heads share KV heads (one scale per v_proj row, "
                        "repeated over the heads reading it): lower g64 perplexity, higher per channel on the "
                        "default model (BENCHMARKS.md)")
    o = p.add_argument_group("OmniQuant (learnable weight clipping and channel scales, trained one decoder layer "
                                  "at a time)")
    d = OmniQuantConfig()
    o.add_argument("--omniquant-epochs", type=nonneg_int, default=d.epochs,
                   help="passes over the calibration sequences per layer; 0 rounds the start as it is "
                        "(default: %(default)s)")
    o.add_argument("--omniquant-lr", type=positive_float, default=d.lr,
                   help="learning rate of the clipping logits (default: %(default)s)")
    o.add_argument("--omniquant-samples", type=positive_int, default=d.samples,
                   help="at most this many calibration sequences train the clipping (default: %(default)s)")
    o.add_argument("--omniquant-init", choices=OMNIQUANT_INITS, default=d.init,
                   help="where the clip factors start: each row's/group's best grid ratio, or OmniQuant's 0.982 "
                        "(default: %(default)s)")
    o.add_argument("--omniquant-let", choices=["on", "off"],
                   help="'on': also learn a scale per input channel of each group of linears sharing an input, "
                        "folded into the op that produces it (OmniQuant's learnable equivalent transformation, "
                        "from AWQ's scales; default: on with --group-size, off per channel, where it raised the "
                        "perplexity)")
    o.add_argument("--omniquant-let-lr", type=positive_float, default=d.let_lr,
                   help="learning rate of the channel scales' logarithms (default: %(default)s)")


def quant_config_from(args) -> QuantConfig:
    from spear.config import AWQConfig, CalibConfig, GPTQConfig, OmniQuantConfig

    return QuantConfig(bits=args.bits, group_size=args.group_size, symmetric=not args.asym,
                       method=args.method, include_lm_head=args.include_lm_head or bool(args.lm_head_bits),
                       head_bits=args.lm_head_bits or 0,
                       calib=CalibConfig(source=args.calib_source, n_samples=args.calib_samples,
                                         seq_len=args.calib_seq_len),
                       gptq=GPTQConfig(damp=args.gptq_damp, act_order=args.act_order),
                       awq=AWQConfig(clip=not args.awq_no_clip, rounding=args.awq_rounding,
                                     fold_kv_heads=args.awq_fold_kv_heads),
                       omniquant=OmniQuantConfig(epochs=args.omniquant_epochs, lr=args.omniquant_lr,
                                                 samples=args.omniquant_samples, init=args.omniquant_init,
                                                 let=None if args.omniquant_let is None else args.omniquant_let == "on",
                                                 let_lr=args.omniquant_let_lr))


def read_plan(path: str | None) -> dict[str, int] | None:
    """A plan file (``{module: rank}``, ``{"plan": {...}}``, or a folder holding plan.json)."""
    if path is None:
        return None
    from spear.select.plan import load_plan

    return load_plan(path)


def add_plan_args(p: argparse.ArgumentParser, budget: str = "1%", overrides: bool = True,
                  latency: bool = False) -> None:
    from spear.select.plan import PLACEMENTS

    g = p.add_argument_group("where the ECs go (one of --budget, --rank, --plan)" if overrides else "where the ECs go")
    g.add_argument("--budget", default=budget,
                   help="extra memory for the ECs: a %% of the quantized model or bytes ('2MB'); the "
                        "selection places them (default: %(default)s)")
    g.add_argument("--placement", choices=PLACEMENTS, default="cka",
                   help="cka: SPEAR's CKA-entropy-cost rule; uniform/random for comparison (default: %(default)s)")
    g.add_argument("--damage-samples", type=positive_int, default=8,
                   help="self-samples (x128 tokens) for the CKA damage scores (default: %(default)s)")
    g.add_argument("--tp", type=positive_int, default=1,
                   help="tensor-parallel degree the ranking accounts for (default: %(default)s)")
    if latency:
        g.add_argument("--latency-budget", metavar="PCT_OR_TIME",
                       help="also keep the ECs' extra decode latency within this: a %% of the W4 decode step "
                            "('3%%') or a time ('50us'); priced by --ec-costs, else by an analytic model from bytes")
        g.add_argument("--ec-costs", metavar="JSON",
                       help="per-module EC cost table (`spear profile --model W4_CKPT --ec-costs FILE`) for "
                            "--latency-budget")
    else:
        p.set_defaults(latency_budget=None, ec_costs=None)
    if overrides:
        g.add_argument("--rank", type=nonneg_int, help="the same rank on every module instead of --budget")
        g.add_argument("--plan", help="plan.json (or a folder holding one, from `spear select`) instead of --budget")
    else:
        p.set_defaults(rank=None, plan=None)


def plan_from_args(args, model, tokenizer, quant, calib_cfg=None, progress: bool = True, ids=None):
    """``(plan, selection)`` from --plan / --rank / --budget, for ``model`` still in full precision;
    ``ids``: the sequences the selection scores damage on (else self-samples it draws)."""
    from spear.models.modules import quantizable_linears
    from spear.select.plan import load_plan, select

    modules = quantizable_linears(model, quant.include_lm_head)
    if args.plan is not None and args.rank is not None:
        raise SpearError("give --plan or --rank, not both")
    if args.latency_budget is not None and (args.plan is not None or args.rank is not None):
        raise SpearError("--latency-budget steers the selection (--budget); it does not apply to --plan or --rank")
    if args.plan is not None:
        return load_plan(args.plan, modules), None
    if args.rank is not None:
        return dict.fromkeys(modules, args.rank), None
    kw = {}
    if calib_cfg is not None:
        kw.update(hidden=calib_cfg.hidden, gated=calib_cfg.gated, per_rank=calib_cfg.gate_per_rank)
        if hasattr(calib_cfg, "n_samples"):  # score damage on the samples calibration will use
            kw["calib"] = calib_cfg
    sel = select(model, tokenizer, quant, args.budget, args.placement, tp=args.tp,
                 damage_samples=args.damage_samples, progress=progress, latency_budget=args.latency_budget,
                 ec_costs=args.ec_costs, ids=ids, **kw)
    return sel.plan, sel
