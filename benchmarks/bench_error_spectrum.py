"""What each quantized base leaves for a low-rank compensator: the activation-weighted spectrum of W − Ŵ.

For every quantizable linear of the model and every base (RTN, GPTQ, AWQ; per-channel, g64):
E = W − Ŵ (AWQ: against the weights it rounded, spear.quant.fold.rescale_reference), s = the RMS of
each input channel on the calibration self-samples, the singular values of E·diag(s)
(spear/eval/error_spectrum.py). Reported, energy-weighted over the modules: the base's error
energy relative to RTN per-channel's, the share a rank-r term could hold for r = 1, 2, 4, 8, 16, 64
and at the ranks of the selection's plan (``--plan``, default cka@1), and the median effective rank
(Σσ²)² / Σσ⁴ (how many directions the energy is spread over).

    python benchmarks/bench_error_spectrum.py --damage-cache /tmp/damage.pt
    python benchmarks/bench_error_spectrum.py --settings w4pc,awq-w4g64 --out results/spectrum
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_calibration import parse_setting  # noqa: E402
from spear.compensate.calib_config import CalibrationConfig  # noqa: E402
from spear.compensate.stats import collect_activation_stats  # noqa: E402
from spear.data.selfsample import sample_sequences  # noqa: E402
from spear.eval.error_spectrum import top_share, weighted_spectrum  # noqa: E402
from spear.eval.report import machine_label  # noqa: E402
from spear.models.loading import load_model  # noqa: E402
from spear.models.modules import quantizable_linears  # noqa: E402
from spear.quant.api import Reference, quantize_for_compensation  # noqa: E402
from spear.select.plan import make_plan  # noqa: E402

RANKS = (1, 2, 4, 8, 16, 64)


@torch.no_grad()
def spectra(model_name: str, spec: str, plan_spec: str, damage_cache: dict, damage_samples: int) -> dict:
    qcfg = parse_setting(spec)
    model, tok = load_model(model_name)
    targets = quantizable_linears(model, qcfg.include_lm_head)
    cal = CalibrationConfig().for_model(model)
    ids = sample_sequences(model, tok, cal.self_samples(cal.n_samples + cal.val_samples, cal.sample_len),
                           progress=False)[: cal.stats_samples]
    ref = Reference({n: lin.weight.detach().clone() for n, lin in targets.items()},
                    collect_activation_stats(model, targets, ids, progress=False))
    plan = make_plan(plan_spec, model, tok, qcfg, damage_samples=damage_samples, damage_cache=damage_cache)
    t0 = time.perf_counter()
    mods = quantize_for_compensation(model, qcfg, [ref], progress=False, tokenizer=tok)
    quant_s = time.perf_counter() - t0
    fp, stats = ref.fp_weights, ref.stats
    total, at_plan, shares, eff = 0.0, 0.0, dict.fromkeys(RANKS, 0.0), []
    for name, m in mods.items():
        e = fp[name].double() - m.dequantized_weight(torch.float64)
        sv = weighted_spectrum(e, stats[name].mean_sq.double().sqrt())
        energy = float((sv ** 2).sum())
        total += energy
        for r in RANKS:
            shares[r] += top_share(sv, r) * energy
        at_plan += top_share(sv, plan.get(name, 0)) * energy
        eff.append(energy ** 2 / float((sv ** 4).sum()) if energy > 0 else 0.0)
    return {"setting": qcfg.label, "energy": total, "plan": plan_spec, "plan_modules": len(plan),
            "share_at_plan": at_plan / total, **{f"share_r{r}": shares[r] / total for r in RANKS},
            "median_effective_rank": statistics.median(eff), "quantize_seconds": quant_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--settings", default="w4pc,gptq-w4pc,awq-w4pc,w4g64,gptq-w4g64,awq-w4g64")
    p.add_argument("--plan", default="cka@1")
    p.add_argument("--damage-samples", type=int, default=8)
    p.add_argument("--damage-cache", type=Path, help="file of CKA damage scores (bench_calibration.py's format)")
    p.add_argument("--out", default="results/spectrum")
    args = p.parse_args()
    cache: dict = {}
    prefix = (args.model, "cpu")
    if args.damage_cache and args.damage_cache.exists():
        for key, dmg in torch.load(args.damage_cache, weights_only=False).items():
            if tuple(key[:2]) == prefix:
                cache[tuple(key[2:])] = dmg
    rows = []
    for spec in args.settings.split(","):
        rows.append(spectra(args.model, spec, args.plan, cache, args.damage_samples))
        print(json.dumps(rows[-1]), flush=True)
    base = next((r["energy"] for r in rows if r["setting"].startswith("RTN W4 per-channel")), None)
    lines = ["| base | error energy (RTN per-channel = 1) | " + " | ".join(f"top-{r}" for r in RANKS)
             + f" | at the {args.plan} plan | median effective rank |",
             "|---|---:|" + "---:|" * len(RANKS) + "---:|---:|"]
    for r in rows:
        lines.append(f"| {r['setting']} | {r['energy'] / base if base else float('nan'):.2f} | "
                     + " | ".join(f"{100 * r[f'share_r{k}']:.1f}%" for k in RANKS)
                     + f" | {100 * r['share_at_plan']:.1f}% | {r['median_effective_rank']:.0f} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "spectrum.json").write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "machine": machine_label(),
                                                   "model": args.model, "rows": rows}, indent=1))
    (out / "spectrum.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
