"""``spear run``: the whole default job, printed as one table and saved as JSON/Markdown."""

from __future__ import annotations

from spear.cli.common import (add_device_arg, add_model_arg, add_plan_args, add_quant_args, add_text_args,
                              eval_config_from, quant_config_from, read_plan)
from spear.config import DEFAULT_BASELINES, DEFAULT_SPEAR_VARIANTS, STATIC_METHODS
from spear.errors import SpearError


def register(sub) -> None:
    p = sub.add_parser("run", help="quantize, evaluate FP / W4 / static baselines / SPEAR ECs, print the table",
                       description="The whole default job: FP, the quantized base, static low-rank baselines "
                                   "and SPEAR's KL-calibrated ECs at the same modules and ranks (by default the "
                                   "selection's placement within 1% extra memory), evaluated on the same windows, "
                                   "as one table (also saved as JSON and Markdown).")
    add_model_arg(p)
    add_quant_args(p)
    add_text_args(p)
    g = p.add_argument_group("compensation")
    g.add_argument("--baselines", default=",".join(DEFAULT_BASELINES),
                   help=f"comma-separated static methods from {', '.join(STATIC_METHODS)}, or 'all' "
                        "or 'none' (default: %(default)s)")
    g.add_argument("--spear", choices=list(SPEAR_VARIANTS), default=SPEAR_CHOICE[DEFAULT_SPEAR_VARIANTS],
                   help="SPEAR rows: the KL-calibrated low-rank EC (nogate, the default), the token-gated EC, "
                        "both, or none (default: %(default)s)")
    add_plan_args(p)
    from spear.cli.calibrate import add_calibration_args

    add_calibration_args(p, with_gate_flag=False)
    add_device_arg(p, "to run the job")
    p.add_argument("--out", default="results/run", help="folder for run.json / run.md (default: %(default)s)")
    p.set_defaults(func=main)


# --spear's choices and the variants run_job takes
SPEAR_VARIANTS = {"gate": ("gate",), "nogate": ("nogate",), "both": ("nogate", "gate"), "none": ()}
SPEAR_CHOICE = {v: k for k, v in SPEAR_VARIANTS.items()}


def parse_methods(text: str) -> list[str]:
    if text == "all":
        return list(STATIC_METHODS)
    if text in ("", "none"):
        return []
    methods = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in methods if m not in STATIC_METHODS]
    if bad:
        raise SpearError(f"unknown baseline(s) {bad}; choose from {', '.join(STATIC_METHODS)}")
    return methods


def main(args) -> int:
    from spear.eval.report import markdown_table, write_report
    from spear.pipeline import run_job

    from spear.cli.calibrate import calibration_config_from
    from spear.cli.common import device_from
    from spear.fileio import check_can_write_in

    methods = parse_methods(args.baselines)
    variants = SPEAR_VARIANTS[args.spear]
    if args.plan is not None and args.rank is not None:
        raise SpearError("give --plan or --rank, not both")
    check_can_write_in(args.out)  # run.json / run.md go there after the whole job; other files there stay
    result = run_job(args.model, quant_config_from(args), eval_config_from(args), methods, rank=args.rank,
                     plan=read_plan(args.plan), progress=not args.quiet, spear_variants=variants,
                     calib_cfg=calibration_config_from(args) if variants else None, budget=args.budget,
                     placement=args.placement, damage_samples=args.damage_samples, tp=args.tp,
                     device=device_from(args))
    print()
    for k, v in result.header.items():
        print(f"{k}: {v}")
    print()
    print(markdown_table(result.rows))
    json_path, md_path = write_report(args.out, "run", result.rows, result.header)
    print(f"\nsaved {json_path} and {md_path}")
    return 0
