"""SPEAR calibration benchmark: static vs KL-calibrated vs gated ECs at equal memory.

For each quantization setting and uniform rank (same modules and ranks for every
row): static LQER and QERA-approx (text activation statistics), then KL-calibrated
variants over several seeds (self-sample seed, gate init and data order all
change with the seed). Prints one Markdown table (mean ± std over seeds) and
writes JSON + Markdown to --out.

    python benchmarks/bench_calibration.py                         # default grid, CPU
    python benchmarks/bench_calibration.py --device cuda --seeds 0,1,2 \\
        --variants nogate,gate,"gate:gate_lr=3e-2;hidden=16"

A variant is ``nogate`` or ``gate``, optionally followed by ``:key=value;...``
overrides of :class:`spear.compensate.calibrate.CalibrationConfig`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import fields, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spear.compensate.calibrate import CalibrationConfig  # noqa: E402
from spear.compensate.static import attach_static  # noqa: E402
from spear.compensate.stats import collect_activation_stats  # noqa: E402
from spear.compensate.workflow import attach_ecs, calibrate, prepare_calibration, uniform_plan  # noqa: E402
from spear.config import QuantConfig, StaticCompensationConfig  # noqa: E402
from spear.data import load_text, make_split  # noqa: E402
from spear.eval.memory import compensator_bytes, quantized_model_bytes  # noqa: E402
from spear.eval.perplexity import perplexity  # noqa: E402
from spear.eval.report import gap_recovered, machine_label  # noqa: E402
from spear.models.loading import load_model  # noqa: E402
from spear.models.modules import quantizable_linears  # noqa: E402
from spear.quant import quantize_model_rtn  # noqa: E402


def parse_variant(spec: str) -> tuple[str, dict]:
    name, _, rest = spec.partition(":")
    if name not in ("nogate", "gate"):
        raise SystemExit(f"variant must start with nogate or gate, got {spec!r}")
    types = {f.name: f.type for f in fields(CalibrationConfig)}
    over = {"gated": name == "gate"}
    for item in filter(None, rest.split(";")):
        k, _, v = item.partition("=")
        if k not in types:
            raise SystemExit(f"unknown calibration setting {k!r} in {spec!r}")
        t = types[k]
        over[k] = (v.lower() in ("1", "true", "yes")) if t in (bool, "bool") else \
            int(v) if t in (int, "int") else float(v) if t in (float, "float") else v
    return spec, over


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--text", default="wikipedia")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--settings", default="w4pc", help="comma list of w4pc (W4 per-channel sym), w3g64 (W3 g64 sym)")
    p.add_argument("--ranks", default="1,2")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--variants", default="nogate,gate")
    p.add_argument("--steps", type=int, default=240)
    p.add_argument("--eval-windows", type=int, default=24)
    p.add_argument("--out", default="results/calibration")
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 numerics, comparable with the CPU
    settings = {"w4pc": QuantConfig(bits=4), "w3g64": QuantConfig(bits=3, group_size=64)}
    ranks = [int(r) for r in args.ranks.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    variants = [parse_variant(v) for v in args.variants.split(",")]
    dev = torch.device(args.device)

    def fresh():
        m, t = load_model(args.model)
        return m.to(dev), t

    model, tok = fresh()
    split = make_split(load_text(args.text), tok, 512, args.eval_windows, 16)

    def ppl(m):
        return perplexity(m, split.eval, progress=False).ppl

    fp = ppl(model)
    text_stats = collect_activation_stats(model, quantizable_linears(model), split.calib, progress=False)
    base_cfg = CalibrationConfig(steps=args.steps)
    data = {s: prepare_calibration(model, tok, replace(base_cfg, seed=s), progress=False) for s in seeds}
    results = {"date": time.strftime("%Y-%m-%d"), "machine": machine_label(), "text": split.text_name,
               "fp_ppl": fp, "eval_tokens": split.eval.numel() - split.eval.shape[0], "steps": args.steps,
               "seeds": seeds, "rows": []}
    print(f"FP {fp:.3f} on {split.text_name}", flush=True)
    for sname in args.settings.split(","):
        qcfg = settings[sname]
        model, _ = fresh()
        fp_w = {n: l.weight.detach().clone() for n, l in quantizable_linears(model).items()}
        mods = quantize_model_rtn(model, qcfg, progress=False)
        base = ppl(model)
        total = quantized_model_bytes(model)
        print(f"{qcfg.label}: {base:.3f}", flush=True)
        results["rows"].append({"setting": qcfg.label, "method": "base", "ppl": [base], "gap": [0.0], "mem": 0.0})
        for rank in ranks:
            for method in ("lqer", "qera-approx"):
                attach_static(mods, fp_w, StaticCompensationConfig(method=method, rank=rank), text_stats, progress=False)
                v = ppl(model)
                row = {"setting": qcfg.label, "rank": rank, "method": f"static {method}", "ppl": [v],
                       "gap": [gap_recovered(base, v, fp)], "mem": 100 * compensator_bytes(model) / total}
                results["rows"].append(row)
                print(row, flush=True)
            for spec, over in variants:
                row = {"setting": qcfg.label, "rank": rank, "method": f"KL {spec}", "ppl": [], "gap": [],
                       "val_kl": [], "seconds": [], "best_step": []}
                for s in seeds:
                    cfg = replace(base_cfg, seed=s, **over)
                    attach_ecs(mods, fp_w, uniform_plan(mods, rank), cfg, data[s].stats)
                    rep = calibrate(model, data[s], cfg, progress=False)
                    v = ppl(model)
                    row["ppl"].append(v)
                    row["gap"].append(gap_recovered(base, v, fp))
                    row["val_kl"].append(rep.best_val_kl)
                    row["seconds"].append(rep.seconds)
                    row["best_step"].append(rep.best_step)
                    row["mem"] = 100 * compensator_bytes(model) / total
                print(row, flush=True)
                results["rows"].append(row)
        for m in mods.values():
            m.compensator = None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "calibration.json").write_text(json.dumps(results, indent=2))
    lines = [f"{results['date']}, {results['machine']}, {results['text']}, FP {fp:.2f}, {args.steps} steps, "
             f"seeds {seeds}", "", "| setting | rank | method | ppl | gap recovered | memory | time/run |",
             "|---|---:|---|---:|---:|---:|---:|"]
    for r in results["rows"]:
        def ms(xs, fmt):
            return fmt.format(xs[0]) if len(xs) == 1 else (fmt + " ± " + fmt).format(statistics.mean(xs), statistics.stdev(xs))
        secs = f"{statistics.mean(r['seconds']):.0f} s" if r.get("seconds") else ""
        lines.append(f"| {r['setting']} | {r.get('rank', '')} | {r['method']} | {ms(r['ppl'], '{:.2f}')} | "
                     f"{ms(r['gap'], '{:.1f}')}% | {r['mem']:.2f}% | {secs} |")
    (out / "calibration.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
