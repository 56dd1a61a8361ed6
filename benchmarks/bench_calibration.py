"""SPEAR calibration and placement benchmark: static vs KL-calibrated vs gated ECs.

Every row of one (setting, plan) pair has the same modules and ranks, hence the same
memory. Rows: static LQER / QERA-approx (text activation statistics) and KL-calibrated
variants over several seeds (the self-sample seed, gate init and data order all change
with the seed). Each finished run is appended to ``<out>/rows.jsonl`` at once, so an
interrupted grid keeps what it finished; ``--merge`` turns one or more such files into
the Markdown table (mean ± std over seeds).

    python benchmarks/bench_calibration.py                      # default grid, CPU
    python benchmarks/bench_calibration.py --device cuda --settings w4pc,w3g64 \\
        --plans r1,r2 --variants nogate,gate,"gate:gate_lr=3e-2;hidden=16"
    python benchmarks/bench_calibration.py --plans uniform@0.5,random@0.5,cka@0.5 --static qera-approx
    python benchmarks/bench_calibration.py --merge benchmarks/data/calibration-h200-2026-11-30.jsonl

Settings: ``[rtn-|gptq-|gptqact-|awq-|awqgptq-|awqkv-|omniquant-]w<bits><pc|g<group>>[+head]`` (e.g. w4pc, w3g64,
gptq-w4g64, omniquant-w4pc; gptqact is GPTQ with act-order, awqgptq AWQ with GPTQ's rounding, awqkv AWQ scaling
o_proj over grouped KV heads too (``AWQConfig.fold_kv_heads``), omniquant the
learned clipping with its default OmniQuantConfig; ``+head`` quantizes the output head too, which the
selection may then compensate like any other linear).
Plans: ``r<k>`` (rank k on every linear) or ``<placement>@<percent>`` with placement
uniform | random | cka | cka-full | cka-sqrt, the
budget in % of the quantized model; cka is SPEAR's rule, cka-full covers every module and
cka-sqrt covers the top N·√evenness (see spear/select/allocate.py); ``none`` attaches no EC
(only meaningful with ``tune_scales=1``: the scales-only ablation). Variants: ``nogate`` or ``gate`` (end-to-end KL) or ``bw-nogate``/``bw-gate``
(blockwise, one layer at a time, steps / 2 per layer) or ``bwkl-nogate``/``bwkl-gate`` (blockwise as a
warm start, then end-to-end KL), optionally followed by ``:key=value;...`` overrides of
:class:`spear.compensate.calib_config.CalibrationConfig` (and ``layer_steps=N``: blockwise steps per layer).
Every variant trains the ECs alone (``tune_scales=0;tune_norms=0``, passed explicitly) unless it says
``tune_scales=1;tune_norms=1``, which is the default job's calibration (``spear run``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from dataclasses import fields, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spear.compensate.calib_config import CalibrationConfig  # noqa: E402
from spear.compensate.scales import NormWeights, norm_modules  # noqa: E402
from spear.compensate.static import attach_static, remove_compensators  # noqa: E402
from spear.compensate.stats import collect_activation_stats  # noqa: E402
from spear.compensate.workflow import attach_ecs, calibrate, calibrate_layerwise, prepare_calibration  # noqa: E402
from spear.config import AWQConfig, GPTQConfig, QuantConfig, StaticCompensationConfig  # noqa: E402
from spear.data import load_text, make_split  # noqa: E402
from spear.eval.memory import compensator_bytes, quantized_model_bytes  # noqa: E402
from spear.eval.error_spectrum import captured, top_share, weighted_spectrum  # noqa: E402
from spear.eval.perplexity import perplexity  # noqa: E402
from spear.eval.report import gap_recovered, machine_label  # noqa: E402
from spear.models.loading import load_model  # noqa: E402
from spear.models.modules import quantizable_linears  # noqa: E402
from spear.quant.api import Reference, quantize_for_compensation  # noqa: E402
from spear.select.plan import make_plan  # noqa: E402


def parse_setting(spec: str) -> QuantConfig:
    m = re.fullmatch(r"(?:(rtn|gptq|gptqact|awq|awqgptq|awqkv|omniquant)-)?w(\d)(pc|g\d+)(\+head)?", spec)
    if not m:
        raise SystemExit(f"setting must look like w4pc, w3g64, gptq-w4g64, gptqact-w4pc, awqgptq-w4g64, awqkv-w4g64, omniquant-w4pc "
                         f"or w4g64+head; got {spec!r}")
    group = 0 if m.group(3) == "pc" else int(m.group(3)[1:])
    method = m.group(1) or "rtn"
    options = {"gptqact": dict(method="gptq", gptq=GPTQConfig(act_order=True)),
               "awqgptq": dict(method="awq", awq=AWQConfig(rounding="gptq")),  # AWQ's scaling, GPTQ's rounding
               "awqkv": dict(method="awq", awq=AWQConfig(fold_kv_heads=True))}.get(method, dict(method=method))
    return QuantConfig(bits=int(m.group(2)), group_size=group, include_lm_head=m.group(4) is not None, **options)


def parse_variant(spec: str) -> tuple[str, dict]:
    name, _, rest = spec.partition(":")
    if name not in ("nogate", "gate", "bw-nogate", "bw-gate", "bwkl-nogate", "bwkl-gate"):
        raise SystemExit(f"variant must start with nogate, gate, bw-nogate, bw-gate, bwkl-nogate or bwkl-gate; "
                         f"got {spec!r}")
    # the annotations as written (CalibrationConfig's module has ``from __future__ import annotations``)
    types = {f.name: f.type for f in fields(CalibrationConfig)} | {"layer_steps": "int"}
    over = {"gated": name.endswith("-gate") or name == "gate"}
    for item in filter(None, rest.split(";")):
        k, _, v = item.partition("=")
        if k not in types:
            raise SystemExit(f"unknown calibration setting {k!r} in {spec!r}")
        t = types[k]
        over[k] = (v.lower() in ("1", "true", "yes")) if t == "bool" else \
            (None if v.lower() == "none" else int(v)) if t in ("int", "int | None") else \
            float(v) if t == "float" else v
    return spec, over


@torch.no_grad()
def error_capture(mods, fp_weights, stats, plan) -> dict:
    """Over the compensated modules, energy-weighted (spear/eval/error_spectrum.py): the share of the
    activation-weighted quantization error the attached ECs remove, and the share the best static
    terms of the same ranks could (their top-r singular values)."""
    total = ec = svd = 0.0
    for name, r in plan.items():
        m = mods[name]
        e = fp_weights[name].double() - m.dequantized_weight(torch.float64)
        rms = stats[name].mean_sq.double().sqrt()
        energy = float(((e * rms) ** 2).sum())
        total += energy
        svd += top_share(weighted_spectrum(e, rms), r) * energy
        if m.compensator is not None:
            c = m.compensator
            ec += captured(e, rms, float(c.alpha) * c.B.double() @ c.A.double()) * energy
    return {"ec_captured": ec / total, "svd_captured": svd / total} if total else {}


def calib_over(over: dict) -> dict:
    """The overrides that are CalibrationConfig fields (``layer_steps`` is the benchmark's own)."""
    return {k: v for k, v in over.items() if k != "layer_steps"}


def sampling_key(cfg: CalibrationConfig) -> tuple:
    """The settings that change the self-samples, teacher and statistics a run trains on."""
    return (cfg.seed, cfg.n_samples, cfg.val_samples, cfg.sample_len, cfg.temperature, cfg.top_p,
            cfg.init == "qera-exact", cfg.teacher_top_k)


def summarize(rows: list[dict]) -> list[str]:
    """Markdown table, one line per (setting, plan, method), mean ± std over seeds."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["setting"], r.get("plan", ""), r["method"]), []).append(r)
    lines = ["| setting | plan | method | ppl | gap recovered | memory | modules | seeds | time/run |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]

    def ms(xs, fmt):
        return fmt.format(xs[0]) if len(xs) == 1 else (fmt + " ± " + fmt).format(statistics.mean(xs),
                                                                                  statistics.stdev(xs))
    for (setting, plan, method), rs in groups.items():
        secs = [r["seconds"] for r in rs if r.get("seconds")]
        lines.append(f"| {setting} | {plan} | {method} | {ms([r['ppl'] for r in rs], '{:.2f}')} | "
                     f"{ms([r['gap'] for r in rs], '{:.1f}')}% | {rs[0]['mem']:.3f}% | {rs[0].get('modules', '')} | "
                     f"{len(rs)} | {f'{statistics.mean(secs):.0f} s' if secs else ''} |")
    return lines


def merge(dirs: list[str]) -> None:
    rows, heads = [], []
    for d in dirs:
        path = Path(d) if Path(d).is_file() else Path(d) / "rows.jsonl"
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            (heads if rec.get("kind") == "header" else rows).append(rec)
    for h in {json.dumps({k: h[k] for k in ("date", "machine", "text", "fp_ppl", "steps")}, sort_keys=True)
              for h in heads}:
        print(h)
    print("\n".join(summarize(rows)))


def _save_damage_cache(path: Path, prefix: tuple, cache: dict) -> None:
    """Merge this process's damage scores ``cache`` into ``path`` (atomic replace)."""
    old = torch.load(path, weights_only=False) if path.exists() else {}
    old.update({prefix + tuple(k): v for k, v in cache.items()})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + f".{os.getpid()}.tmp")
    torch.save(old, tmp)
    tmp.replace(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--text", default="wikipedia")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--settings", default="w4pc")
    p.add_argument("--plans", default="r1,r2")
    p.add_argument("--static", default="lqer,qera-approx", help="static rows per plan ('' for none)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--variants", default="nogate,gate")
    p.add_argument("--steps", type=int, default=None,
                   help="KL steps of every variant that sets none (default: by the device, as spear's own)")
    p.add_argument("--damage-samples", type=int, default=16, help="self-samples (x128 tokens) for CKA damage")
    p.add_argument("--damage-cache", type=Path,
                   help="file keeping the CKA damage scores between runs (keyed by model, device, bits, group, "
                        "symmetry, samples): later runs of the same model skip the damage pass")
    p.add_argument("--eval-windows", type=int, default=24)
    p.add_argument("--out", default="results/calibration")
    p.add_argument("--merge", nargs="+", metavar="PATH",
                   help="only print the table of these result folders or rows.jsonl files")
    args = p.parse_args()
    if args.merge:
        return merge(args.merge)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 numerics, comparable with the CPU
    seeds = [int(s) for s in args.seeds.split(",")]
    variants = [parse_variant(v) for v in args.variants.split(",") if v]
    statics = [s for s in args.static.split(",") if s]
    dev = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sink = (out / "rows.jsonl").open("a")

    def emit(rec):
        sink.write(json.dumps(rec) + "\n")
        sink.flush()
        print(json.dumps(rec), flush=True)

    def fresh():
        m, t = load_model(args.model)
        return m.to(dev), t

    model, tok = fresh()
    split = make_split(load_text(args.text), tok, 512, args.eval_windows, 16)

    def ppl(m):
        return perplexity(m, split.eval, progress=False).ppl

    fp = ppl(model)
    emit({"kind": "header", "date": time.strftime("%Y-%m-%d"), "machine": machine_label(),
          "text": split.text_name, "fp_ppl": fp, "steps": args.steps, "seeds": seeds})
    head = any(parse_setting(sname).include_lm_head for sname in args.settings.split(","))
    text_stats = collect_activation_stats(model, quantizable_linears(model, head), split.calib, progress=False)
    # the ECs alone: CalibrationConfig's defaults (the default job's) also tune the scales and norms
    base_cfg = CalibrationConfig(steps=args.steps, tune_scales=False, tune_norms=False)
    data = {}  # (seed, sampling settings) -> CalibrationData, prepared while the model is FP
    prep_seconds = {}  # the same keys -> seconds of self-sampling, teacher and statistics (0 from the cache)
    for s in seeds:
        for _, over in variants:
            cfg = replace(base_cfg, seed=s, **calib_over(over))
            if sampling_key(cfg) not in data:
                t0 = time.perf_counter()
                data[sampling_key(cfg)] = prepare_calibration(model, tok, cfg, head, progress=False)
                prep_seconds[sampling_key(cfg)] = time.perf_counter() - t0
    del model
    cache_prefix = (args.model, torch.device(args.device).type)
    damage_cache: dict = {}  # damage_key -> DamageReport, shared by every setting's make_plan
    if args.damage_cache and args.damage_cache.exists():
        for key, dmg in torch.load(args.damage_cache, weights_only=False).items():
            if tuple(key[:2]) == cache_prefix:
                damage_cache.setdefault(tuple(key[2:]), dmg)
    for sname in args.settings.split(","):
        qcfg = parse_setting(sname)
        model, _ = fresh()
        fp_w = {n: lin.weight.detach().clone() for n, lin in quantizable_linears(model, qcfg.include_lm_head).items()}
        plans = {}
        t0 = time.perf_counter()
        for spec in args.plans.split(","):  # placement needs the FP model
            plans[spec] = {} if spec == "none" else make_plan(spec, model, tok, qcfg,
                                                                damage_samples=args.damage_samples,
                                                                damage_cache=damage_cache)
        select_s = time.perf_counter() - t0
        if args.damage_cache:
            _save_damage_cache(args.damage_cache, cache_prefix, damage_cache)
        # copies: the prepared references serve every setting, each rescaled by its own AWQ run
        ref, sdata = Reference(fp_w, text_stats), {key: replace(d) for key, d in data.items()}
        t0 = time.perf_counter()
        mods = quantize_for_compensation(model, qcfg, [ref, *sdata.values()], progress=False, tokenizer=tok)
        quant_s = time.perf_counter() - t0
        weights, stats = ref.fp_weights, ref.stats
        base = ppl(model)
        base_scales = {n: m.scales.clone() for n, m in mods.items()}  # tune_scales runs change them
        norms = NormWeights(norm_modules(model))
        base_norms = norms.state()  # and tune_norms runs the norm weights
        total = quantized_model_bytes(model)
        emit({"setting": qcfg.label, "method": "base", "ppl": base, "gap": 0.0, "mem": 0.0,
              "quantize_seconds": quant_s, "select_seconds": select_s})
        for pspec, plan in plans.items():
            common = {"setting": qcfg.label, "plan": pspec, "modules": len(plan)}
            for method in statics if plan else []:  # no static row without ECs
                attach_static(mods, weights, StaticCompensationConfig(method=method, rank=1, plan=plan), stats,
                              progress=False)
                v = ppl(model)
                emit({**common, "method": f"static {method}", "ppl": v, "gap": gap_recovered(base, v, fp),
                      "mem": 100 * compensator_bytes(model) / total})
                remove_compensators(model)
            for spec, over in variants:
                for s in seeds:
                    cfg = replace(base_cfg, seed=s, **calib_over(over))
                    d = sdata[sampling_key(cfg)]
                    attach_ecs(mods, d.fp_weights, plan, cfg, d.stats)
                    rec = {**common, "method": f"KL {spec}", "seed": s,
                           "prep_seconds": prep_seconds[sampling_key(cfg)]}
                    warm = 0.0
                    if spec.startswith(("bw-", "bwkl-")):  # blockwise: layer by layer, steps / 2 per layer
                        rep = calibrate_layerwise(model, d, cfg, over.get("layer_steps"), progress=False)
                        rec.update(method=f"blockwise {spec[3:]}", seconds=rep.seconds, layers=rep.layers)
                        warm = rep.seconds
                    if not spec.startswith("bw-"):  # end-to-end KL (after the blockwise warm start for bwkl-)
                        rep = calibrate(model, d, cfg, progress=False)
                        rec.update(method=f"KL {spec}", val_kl=rep.best_val_kl, initial_val_kl=rep.initial_val_kl,
                                   best_step=rep.best_step, steps_run=rep.steps_run, seconds=warm + rep.seconds,
                                   history=[h for h in rep.history if "val_kl" in h])
                    if not cfg.gated:
                        rec.update(error_capture(mods, d.fp_weights, d.stats, plan))
                    v = ppl(model)
                    emit({**rec, "ppl": v, "gap": gap_recovered(base, v, fp),
                          "mem": 100 * compensator_bytes(model) / total})
                    remove_compensators(model)
                    if cfg.tune_scales:  # the next run starts from the same quantized base
                        for n, m in mods.items():
                            m.set_quantized(m.codes, base_scales[n], m.zeros)
                    if cfg.tune_norms:
                        norms.load_state(base_norms)
        del model, mods
    sink.close()
    rows = [json.loads(x) for x in (out / "rows.jsonl").read_text().splitlines()]
    table = summarize([r for r in rows if r.get("kind") != "header"])
    (out / "calibration.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
