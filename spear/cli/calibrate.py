"""``spear calibrate``: quantize, attach SPEAR ECs, KL-calibrate them data-free, save."""

from __future__ import annotations

import argparse
import json


def add_calibration_args(p, with_gate_flag: bool = True) -> None:
    from spear.cli.common import nonneg_int, positive_int
    from spear.compensate.calib_config import CalibrationConfig

    d = CalibrationConfig()
    g = p.add_argument_group("SPEAR calibration (data-free: the FP model samples its own text)")
    if with_gate_flag:
        g.add_argument("--gate", action="store_true",
                       help="token-gated ECs (γ(Ax) ⊙ Ax); default: the ungated low-rank term, which "
                            "calibrated as well or better in every measured setting")
    g.add_argument("--hidden", type=positive_int, default=d.hidden, help="gate MLP width h (default: %(default)s)")
    g.add_argument("--bound", type=float, default=d.bound, help="γ ∈ (1-bound, 1+bound) (default: %(default)s)")
    g.add_argument("--gate-per-module", action="store_true",
                   help="one γ per token for the whole module instead of one per rank component")
    from spear.compensate.calib_config import ACCELERATOR_SIZES, CPU_SIZES

    why = "a GPU affords more self-sampled text and longer training, which recover more of the gap"
    g.add_argument("--steps", type=positive_int, default=d.steps,
                   help=f"optimizer steps (default: {CPU_SIZES[1]} on a CPU, {ACCELERATOR_SIZES[1]} on a GPU: {why})")
    g.add_argument("--samples", type=positive_int, default=d.n_samples,
                   help=f"training self-samples (default: {CPU_SIZES[0]} on a CPU, {ACCELERATOR_SIZES[0]} on a GPU)")
    g.add_argument("--val-samples", type=positive_int, default=d.val_samples, help="held-out self-samples (default: %(default)s)")
    g.add_argument("--sample-len", type=positive_int, default=d.sample_len, help="tokens per self-sample (default: %(default)s)")
    g.add_argument("--calib-batch", type=positive_int, default=d.batch_size, help="sequences per step (default: %(default)s)")
    g.add_argument("--lr", type=float, default=d.lr, help="learning rate of A, B (default: %(default)s)")
    g.add_argument("--gate-lr", type=float, default=d.gate_lr, help="learning rate of the gate (default: %(default)s)")
    g.add_argument("--seed", type=nonneg_int, default=d.seed, help="sampling, init and data-order seed (default: %(default)s)")
    from spear.compensate.calib_config import AUTO_TOP_K, FULL_TEACHER_MAX_BYTES, TOP_K_TEACHER_MAX_BYTES

    g.add_argument("--teacher-top-k", type=nonneg_int, default=d.teacher_top_k, metavar="K",
                   help="keep only the teacher's K most likely tokens per position (plus the rest's mass) "
                        "instead of the whole distribution (0): bounded memory for many samples or large "
                        f"vocabularies (default: the whole distribution while it takes at most "
                        f"{FULL_TEACHER_MAX_BYTES / 2**30:g} GiB, else K = {AUTO_TOP_K}, halved while the top K would "
                        f"take more than {TOP_K_TEACHER_MAX_BYTES / 2**30:g} GiB)")
    # Unset: CalibrationConfig's default (on: the one default job, spear/compensate/calib_config.py), off with
    # --blockwise, which trains the ECs only.
    g.add_argument("--tune-scales", action=argparse.BooleanOptionalAction, default=None,
                   help="also KL-train the quantization scales of every quantized linear (a log-factor per "
                        "stored scale, folded into the fp16 scales afterwards: no extra memory); end-to-end "
                        f"KL only (default: {'on' if d.tune_scales else 'off'}; off with --blockwise)")
    g.add_argument("--scale-lr", type=float, default=d.scale_lr,
                   help="with --tune-scales: learning rate of the scales' log-factors (default: %(default)s)")
    g.add_argument("--tune-norms", action=argparse.BooleanOptionalAction, default=None,
                   help="also KL-train the RMSNorm/LayerNorm weights in place (norm tweaking; they are stored "
                        f"anyway: no extra memory); end-to-end KL only (default: {'on' if d.tune_norms else 'off'}; "
                        "off with --blockwise)")
    g.add_argument("--norm-lr", type=float, default=d.norm_lr,
                   help="with --tune-norms: learning rate of the norm weights (default: %(default)s)")
    g.add_argument("--init", choices=["identity", "lqer", "qera-approx", "qera-exact"], default=d.init,
                   help="closed-form solution the ECs start from (default: %(default)s)")
    from spear.compensate.calib_config import TRAIN_DTYPES

    g.add_argument("--train-dtype", choices=sorted(TRAIN_DTYPES), default=d.train_dtype,
                   help="what the training steps compute in (bfloat16: torch.autocast; the parameters, the "
                        "teacher and the validation KL stay float32) (default: %(default)s)")


def calibration_config_from(args):
    """The CalibrationConfig of the parsed arguments. ``--tune-scales``/``--tune-norms`` left unset take the config's
    default, except with ``--blockwise`` (which trains the ECs only: off); asked for with it, they are an error."""
    from spear.compensate.calib_config import CalibrationConfig
    from spear.errors import SpearError

    blockwise = getattr(args, "blockwise", False)
    if blockwise and (args.tune_scales or args.tune_norms):
        raise SpearError("--tune-scales and --tune-norms need end-to-end KL calibration (not --blockwise)")
    d = CalibrationConfig()
    tune = {name: (getattr(d, name) and not blockwise) if getattr(args, name) is None else getattr(args, name)
            for name in ("tune_scales", "tune_norms")}
    return CalibrationConfig(n_samples=args.samples, val_samples=args.val_samples, sample_len=args.sample_len,
                             seed=args.seed, steps=args.steps, batch_size=args.calib_batch, lr=args.lr,
                             gate_lr=args.gate_lr, gated=getattr(args, "gate", False), hidden=args.hidden,
                             bound=args.bound, gate_per_rank=not args.gate_per_module, init=args.init,
                             teacher_top_k=args.teacher_top_k, tune_scales=tune["tune_scales"],
                             scale_lr=args.scale_lr, tune_norms=tune["tune_norms"], norm_lr=args.norm_lr,
                             train_dtype=args.train_dtype)


def register(sub) -> None:
    from spear.cli.common import OVERWRITE_HELP, add_device_arg, add_model_arg, add_plan_args, add_quant_args, \
        positive_int

    p = sub.add_parser("calibrate", help="quantize + attach SPEAR error compensators + KL-calibrate + save",
                       description="Quantize the model, attach low-rank error compensators to the modules the "
                                   "selection picks within --budget (or --rank everywhere, or a --plan file), "
                                   "calibrate them by "
                                   "KL(p_FP || p_quantized) on self-sampled text, and write a checkpoint.")
    add_model_arg(p)
    p.add_argument("--out", required=True, help="checkpoint folder to write")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    add_plan_args(p, latency=True)
    add_device_arg(p, "to calibrate")
    p.add_argument("--blockwise", action="store_true",
                   help="train one decoder layer at a time against the FP layer outputs (memory of one "
                        "layer's activations and no teacher distribution: for models too large for "
                        "end-to-end KL)")
    p.add_argument("--layer-steps", type=positive_int,
                   help="with --blockwise: optimizer steps per layer (default: --steps / 2)")
    p.add_argument("--gate-report", help="folder for gate statistics (JSON) and the gate-vs-error PNG")
    add_quant_args(p)
    add_calibration_args(p)
    p.set_defaults(func=main)


def main(args) -> int:
    from spear.cli.common import device_from, plan_from_args, quant_config_from
    from spear.compensate.gate_stats import gate_statistics, plot_gate_vs_error, summary_rows
    from spear.compensate.spec import check_plan_ranks
    from spear.compensate.workflow import attach_ecs, calibrate, calibrate_layerwise, prepare_calibration
    from spear.eval.memory import compensator_bytes, quantized_model_bytes
    from spear.fileio import check_can_write_in
    from spear.models.checkpoint import check_checkpoint_out, is_checkpoint, save_checkpoint
    from spear.models.loading import load_model, resolve_model_path
    from spear.models.modules import quantizable_linears
    from spear.quant.api import quantize_for_compensation
    from spear.errors import SpearError

    quant = quant_config_from(args)
    cfg = calibration_config_from(args)
    if is_checkpoint(resolve_model_path(args.model)):
        raise SpearError(f"{args.model} is already a spear checkpoint; calibrate from its source model")
    check_checkpoint_out(args.out, args.overwrite)
    device = device_from(args)
    if args.gate_report:
        check_can_write_in(args.gate_report)
    progress = not args.quiet
    model, tok = load_model(args.model, device=device)
    cfg = cfg.for_model(model)  # the teacher's form follows the vocabulary; the checkpoint records it
    given = args.plan is not None or args.rank is not None
    if given:
        plan, selection = plan_from_args(args, model, tok, quant, cfg, progress)
        check_plan_ranks(plan, quantizable_linears(model, quant.include_lm_head))  # before the sampling and teacher
    data = prepare_calibration(model, tok, cfg, quant.include_lm_head, progress=progress, teacher=not args.blockwise)
    if not given:  # the selection scores damage on the self-samples just drawn (with their teacher)
        plan, selection = plan_from_args(args, model, tok, quant, cfg, progress,
                                         ids=data.sample_ids[:args.damage_samples])
    modules = quantize_for_compensation(model, quant, [data], calib=data.train_ids, progress=progress, tokenizer=tok)
    unknown = sorted(set(plan) - set(modules))
    if unknown:
        raise SpearError(f"plan names {len(unknown)} module(s) that are not quantized linears, e.g. {unknown[0]}")
    applied = attach_ecs(modules, data.fp_weights, plan, cfg, data.stats)
    if not applied and not cfg.tune_scales and not cfg.tune_norms:
        raise SpearError("the plan gives every module rank 0: nothing to calibrate")
    if args.blockwise:
        report = calibrate_layerwise(model, data, cfg, args.layer_steps, progress=progress)
        meta = {"calibration": {**cfg.to_dict(), "mode": "blockwise", "layer_steps": args.layer_steps},
                "plan": applied, "report": {"seconds": report.seconds, "layers": report.layers}}
    else:
        report = calibrate(model, data, cfg, progress=progress)
        meta = {"calibration": {**cfg.to_dict(), "mode": "end-to-end KL"}, "plan": applied,
                "report": {k: v for k, v in report.__dict__.items() if k != "history"}, "history": report.history}
    total, extra = quantized_model_bytes(model), compensator_bytes(model)
    if args.gate_report and cfg.gated:
        stats = gate_statistics(model, data.val_ids, data.fp_weights)
        from pathlib import Path

        folder = Path(args.gate_report)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "gate_stats.json").write_text(json.dumps(summary_rows(stats), indent=2))
        png = plot_gate_vs_error(stats, folder / "gate_vs_error.png")
        print(f"gate statistics: {folder / 'gate_stats.json'}, {png}")
    if selection is not None:
        meta["selection"] = {k: v for k, v in selection.to_dict().items() if k not in ("plan", "damage")}
    out = save_checkpoint(model.cpu(), tok, args.out, quant, args.model, meta=meta, overwrite=args.overwrite)
    if selection is not None:
        from spear.select.plan import save_plan

        save_plan(selection, out)
    head = f"wrote {out}: {len(applied)} ECs ({'gated' if cfg.gated else 'ungated'}), +{100 * extra / total:.2f}% memory"
    if cfg.tune_scales:
        head += ", KL-tuned scales"
    if cfg.tune_norms:
        head += ", KL-tuned norms"
    if args.blockwise:
        errs = [(e["val_before"], min(e["val_before"], e["val_after"])) for e in report.layers if e["ecs"]]
        print(f"{head}; blockwise: mean layer output error {sum(b for b, _ in errs) / len(errs):.3e} -> "
              f"{sum(a for _, a in errs) / len(errs):.3e} over {len(errs)} layers ({report.seconds:.0f} s)")
    else:
        print(f"{head}; validation KL {report.initial_val_kl:.4f} -> {report.best_val_kl:.4f} "
              f"(best at step {report.best_step}/{report.steps_run}, {report.seconds:.0f} s)")
    return 0
