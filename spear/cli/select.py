"""``spear select``: score every linear's damage, place ECs within a memory budget, write plan.json."""

from __future__ import annotations


def register(sub) -> None:
    from spear.cli.common import add_device_arg, add_model_arg, add_plan_args, add_quant_args

    p = sub.add_parser("select", help="choose which modules get ECs, at which rank, within --budget",
                       description="Quantize one module at a time (the rest in full precision), score its "
                                   "damage as 1 - CKA of the final hidden states on self-sampled text, and "
                                   "turn the scores into a plan {module: rank} within --budget by the "
                                   "CKA-entropy-cost rule (spear/select/allocate.py). Writes OUT/plan.json "
                                   "and OUT/selection.png; `spear calibrate --plan OUT` and `spear run "
                                   "--plan OUT` use it.")
    add_model_arg(p)
    p.add_argument("--out", required=True, help="folder for plan.json and selection.png (a checkpoint folder is fine)")
    add_device_arg(p, "to score the damage")
    p.add_argument("--gate", action="store_true", help="count the bytes of token-gated ECs (default: ungated)")
    p.add_argument("--hidden", type=int, default=8, help="gate width the byte count assumes (default: %(default)s)")
    add_quant_args(p)
    add_plan_args(p, overrides=False, latency=True)
    p.set_defaults(func=main)


def main(args) -> int:
    from types import SimpleNamespace

    from spear.cli.common import device_from, plan_from_args, quant_config_from
    from spear.errors import SpearError
    from spear.fileio import check_can_write_in
    from spear.models.checkpoint import is_checkpoint
    from spear.models.loading import load_model, resolve_model_path
    from spear.select.plan import save_plan
    from spear.select.plot import plot_selection

    if is_checkpoint(resolve_model_path(args.model)):
        raise SpearError(f"{args.model} is already a spear checkpoint; select on its source model")
    quant = quant_config_from(args)
    check_can_write_in(args.out)  # plan.json and selection.png go there after the damage scoring
    device = device_from(args)
    model, tok = load_model(args.model, device=device)
    cfg = SimpleNamespace(hidden=args.hidden, gated=args.gate, gate_per_rank=True)
    plan, sel = plan_from_args(args, model, tok, quant, cfg, progress=not args.quiet)
    path = save_plan(sel, args.out)
    png = plot_selection(sel, path.parent / "selection.png")
    d = sel.to_dict()
    print(f"wrote {path} and {png}: {d['modules']} of {len(d.get('damage') or plan)} modules, ranks "
          f"{min(plan.values(), default=0)}..{max(plan.values(), default=0)}, {d['bytes'] / 2**20:.2f} MiB = "
          f"{d['memory_pct']:.2f}% of the quantized model (budget {d['budget_pct']:.2f}%)")
    if "latency_us" in d:
        print(f"extra decode latency {d['latency_us']:.1f} us = {d['latency_pct']:.2f}% of the W4 step "
              f"({d['base_step_us']:.0f} us; budget {d['latency_budget_pct']:.2f}%), {d['latency_model']}")
    if "entropy" in d:
        print(f"damage entropy {d['entropy']:.2f} nats (N_eff {d['effective_modules']:.0f}, evenness "
              f"{d['evenness']:.2f}); scored on {d['damage_tokens']} tokens in {d['damage_seconds']:.0f} s")
    return 0
