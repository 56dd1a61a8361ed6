"""``spear quantize``: write a quantized checkpoint (optionally with static compensators)."""

from __future__ import annotations

from spear.cli.common import OVERWRITE_HELP, add_model_arg, add_quant_args, add_text_args, eval_config_from, nonneg_int, quant_config_from, read_plan
from spear.config import STATIC_METHODS


def register(sub) -> None:
    p = sub.add_parser("quantize", help="quantize a model and write a spear checkpoint folder",
                       description="Quantize every linear (lm_head excluded by default) and write a checkpoint: "
                                   "config + tokenizer of the source model, spear_config.json and packed "
                                   "safetensors. Calibration windows come from --text (see 'spear run').")
    add_model_arg(p)
    p.add_argument("--out", required=True, help="checkpoint folder to write")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    add_quant_args(p)
    g = p.add_argument_group("static compensation")
    g.add_argument("--compensator", choices=["none", *STATIC_METHODS], default="none",
                   help="static low-rank compensator to attach (default: %(default)s)")
    g.add_argument("--rank", type=nonneg_int, default=4, help="rank on every module (default: %(default)s)")
    g.add_argument("--plan", help="JSON {module: rank} overriding --rank")
    add_text_args(p)
    p.set_defaults(func=main)


def main(args) -> int:
    from spear.compensate.spec import check_plan_ranks
    from spear.compensate.static import attach_static, needs_stats
    from spear.compensate.stats import collect_activation_stats
    from spear.config import StaticCompensationConfig
    from spear.errors import SpearError
    from spear.eval.memory import compensator_bytes, quantized_model_bytes
    from spear.models.checkpoint import check_checkpoint_out, is_checkpoint, save_checkpoint
    from spear.models.loading import load_model, resolve_model_path
    from spear.models.modules import quantizable_linears
    from spear.pipeline import load_split
    from spear.quant.api import Reference, quantize_for_compensation

    quant = quant_config_from(args)
    if is_checkpoint(resolve_model_path(args.model)):
        raise SpearError(f"{args.model} is already a spear checkpoint; quantize its source model instead")
    check_checkpoint_out(args.out, args.overwrite)
    comp = None if args.compensator == "none" else StaticCompensationConfig(
        method=args.compensator, rank=args.rank, plan=read_plan(args.plan))
    progress = not args.quiet
    model, tokenizer = load_model(args.model)
    eval_cfg = eval_config_from(args)
    calib = None
    text_calib = quant.method != "rtn" and quant.calib.source == "text"
    if text_calib or (comp and needs_stats(comp.method)):
        calib = load_split(tokenizer, eval_cfg).calib
    targets = quantizable_linears(model, quant.include_lm_head)
    if comp:  # a rank no module can hold fails before the statistics and quantization
        check_plan_ranks({n: comp.rank_for(n) for n in targets}, targets)
    ref = Reference({n: lin.weight.detach().clone() for n, lin in targets.items()} if comp else {})
    if comp and needs_stats(comp.method):
        ref.stats = collect_activation_stats(model, targets, calib, outer=comp.method == "qera-exact", progress=progress)
    modules = quantize_for_compensation(model, quant, [ref], calib=calib if text_calib else None, progress=progress,
                                        tokenizer=tokenizer)
    meta = {"text": eval_cfg.text, "calib_windows": eval_cfg.calib_windows, "seq_len": eval_cfg.seq_len}
    if comp:
        attach_static(modules, ref.fp_weights, comp, ref.stats, progress=progress)
        meta["compensation"] = comp.to_dict()
    out = save_checkpoint(model, tokenizer, args.out, quant, args.model, meta=meta, overwrite=args.overwrite)
    total = quantized_model_bytes(model)
    extra = compensator_bytes(model)
    print(f"wrote {out}: {len(modules)} modules, {quant.label}, quantized model {total / 2**20:.1f} MiB"
          + (f", compensators +{extra / 2**20:.2f} MiB ({100 * extra / total:.2f}%)" if extra else ""))
    return 0
