"""RTN vs GPTQ vs AWQ vs OmniQuant on the default model (SPEAR.md §3/§4 protocol), with static QERA-approx on top.

For each granularity (W4 per-channel sym, W4 g64 sym): perplexity of every base,
its quantization wall time on this machine, and static QERA-approx rank 4 on all
quantized linears on top of it (gap recovered relative to that base's own gap).
GPTQ/AWQ/OmniQuant calibrate on sequences self-sampled from the FP model (data-free; the
sampling time is reported once, it is cached and shared); QERA statistics come from
the text's calibration windows, as in ``spear run``.

    .venv/bin/python benchmarks/bench_quantizers.py [--out results/quantizers]
    .venv/bin/python benchmarks/bench_quantizers.py --methods rtn,omniquant   # OmniQuant's default settings

Writes ``bench_quantizers.json`` / ``.md`` under ``--out`` after every row.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

import torch

from spear.compensate.static import attach_static, remove_compensators
from spear.compensate.stats import collect_activation_stats
from spear.config import (AWQConfig, CalibConfig, EvalConfig, GPTQConfig, OmniQuantConfig, QuantConfig,
                          StaticCompensationConfig)
from spear.eval.memory import compensator_bytes, quantized_model_bytes
from spear.eval.perplexity import perplexity
from spear.eval.report import Row, gap_recovered, machine_label
from spear.models.loading import load_model
from spear.models.modules import quantizable_linears
from spear.pipeline import load_split
from spear.quant.api import Reference, calibration_ids, quantize_for_compensation


def spear_rows(model, modules, fp_weights, stats, base_label: str) -> list[Row]:
    """Hook for the SPEAR calibrated compensator on top of each base.

    Returns no rows until the KL-calibrated (gated) compensator lands; it then
    attaches to ``modules`` against ``fp_weights`` (already AWQ-rescaled) and is
    evaluated exactly like the static row.
    """
    return []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", default="results/quantizers")
    ap.add_argument("--granularities", default="0,64", help="group sizes, 0 = per-channel")
    ap.add_argument("--methods", default="rtn,gptq,awq")
    ap.add_argument("--calib-samples", type=int, default=CalibConfig().n_samples)
    ap.add_argument("--calib-seq-len", type=int, default=CalibConfig().seq_len)
    ap.add_argument("--calib-source", choices=["self", "text"], default="self",
                    help="'text': GPTQ/AWQ calibrate on the text's calibration windows instead")
    ap.add_argument("--act-order", action="store_true", help="GPTQ act-order (static groups)")
    ap.add_argument("--awq-fold-kv-heads", action="store_true",
                    help="AWQ: also scale o_proj where attention heads share KV heads (AWQConfig.fold_kv_heads)")
    ap.add_argument("--rank", type=int, default=4)
    d = OmniQuantConfig()
    ap.add_argument("--omniquant-epochs", type=int, default=d.epochs)
    ap.add_argument("--omniquant-lr", type=float, default=d.lr)
    ap.add_argument("--omniquant-init", choices=["search", "max"], default=d.init)
    ap.add_argument("--omniquant-let", choices=["on", "off"],
                    help="OmniQuant's learnable channel scales (LET; default: on with groups, off per channel)")
    ap.add_argument("--omniquant-let-lr", type=float, default=d.let_lr)
    args = ap.parse_args()
    torch.manual_seed(0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    eval_cfg = EvalConfig()
    calib_cfg = CalibConfig(source=args.calib_source, n_samples=args.calib_samples, seq_len=args.calib_seq_len)
    omni = OmniQuantConfig(epochs=args.omniquant_epochs, lr=args.omniquant_lr, init=args.omniquant_init,
                           let=None if args.omniquant_let is None else args.omniquant_let == "on",
                           let_lr=args.omniquant_let_lr)
    model, tokenizer = load_model(args.model)
    split = load_split(tokenizer, eval_cfg)
    print(f"text: {split.describe()}", flush=True)

    def ppl(m):
        return perplexity(m, split.eval, eval_cfg.batch_size, progress=False)

    t0 = time.perf_counter()
    fp = ppl(model)
    print(f"FP ppl {fp.ppl:.3f} ({fp.tokens} tokens, {time.perf_counter() - t0:.0f} s)", flush=True)
    targets = quantizable_linears(model)
    fp_weights0 = {n: lin.weight.detach().clone() for n, lin in targets.items()}
    stats0 = collect_activation_stats(model, targets, split.calib, progress=False)
    del model

    header = {"model": args.model, "text": split.text_name, "seq_len": split.seq_len,
              "eval_windows": split.eval.shape[0], "tokens_scored": fp.tokens,
              "calibration": (f"{calib_cfg.n_samples} self-sampled sequences x {calib_cfg.seq_len} tokens "
                              f"(seed {calib_cfg.seed}, T={calib_cfg.temperature}, top-p {calib_cfg.top_p})"
                              if calib_cfg.source == "self" else f"{split.calib.shape[0]} text windows"),
              "gptq_act_order": args.act_order, "awq_fold_kv_heads": args.awq_fold_kv_heads,
              "omniquant": asdict(omni),
              "qera_stats": f"{split.calib.shape[0]} text windows",
              "threads": torch.get_num_threads(), "torch": torch.__version__, "machine": machine_label(),
              "date": time.strftime("%Y-%m-%d")}
    records = [{"config": "FP", "method": "FP", "ppl": fp.ppl}]
    rtn_pc = None
    for gs in [int(g) for g in args.granularities.split(",")]:
        base_ppl = {}
        for method in args.methods.split(","):
            cfg = QuantConfig(bits=4, group_size=gs, symmetric=True, method=method, calib=calib_cfg,
                              gptq=GPTQConfig(act_order=args.act_order), omniquant=omni,
                              awq=AWQConfig(fold_kv_heads=args.awq_fold_kv_heads))
            model, _ = load_model(args.model)
            text_calib = split.calib if calib_cfg.source == "text" else None
            if method != "rtn" and text_calib is None and "self_sampling_s" not in header:
                # Sampled (or read from the cache) before the clock starts: shared by all runs.
                t0 = time.perf_counter()
                ids = calibration_ids(model, cfg, tokenizer=tokenizer, progress=False)
                header["self_sampling_s"] = round(time.perf_counter() - t0, 1)
                print(f"calibration: {tuple(ids.shape)} self-sampled ids in {header['self_sampling_s']} s", flush=True)
            ref = Reference(fp_weights0, stats0)
            t0 = time.perf_counter()
            modules = quantize_for_compensation(model, cfg, [ref], calib=None if method == "rtn" else text_calib,
                                                progress=False, tokenizer=tokenizer)
            quant_s = time.perf_counter() - t0
            base = ppl(model)
            base_ppl[method] = base.ppl
            label = cfg.label + (" act-order" if method == "gptq" and args.act_order else "")
            if method == "omniquant" and omni != OmniQuantConfig():
                label += (f" (epochs {omni.epochs}, lr {omni.lr:g}, init {omni.init}, LET "
                          f"{f'lr {omni.let_lr:g}' if omni.let_on(gs) else 'off'})")
            label += " (text calib)" if method != "rtn" and text_calib is not None else ""
            if gs == 0 and method == "rtn":
                rtn_pc = base.ppl
            rec = {"config": f"W4 {'per-channel' if gs == 0 else f'g{gs}'} sym", "method": label, "ppl": base.ppl,
                   "quant_time_s": round(quant_s, 1),
                   "gap_vs_rtn_per_channel": None if rtn_pc is None else gap_recovered(rtn_pc, base.ppl, fp.ppl)}
            records.append(rec)
            print(json.dumps(rec), flush=True)

            fp_weights, stats = ref.fp_weights, ref.stats
            comp = StaticCompensationConfig(method="qera-approx", rank=args.rank)
            attach_static(modules, fp_weights, comp, stats, progress=False)
            total, extra = quantized_model_bytes(model), compensator_bytes(model)
            res = ppl(model)
            rec = {"config": rec["config"], "method": f"{label} + QERA-approx r{args.rank}", "ppl": res.ppl,
                   "memory_pct": 100 * extra / total, "modules": len(modules),
                   "gap_recovered_own_base": gap_recovered(base.ppl, res.ppl, fp.ppl)}
            records.append(rec)
            print(json.dumps(rec), flush=True)
            remove_compensators(model)
            for row in spear_rows(model, modules, fp_weights, stats, label):
                records.append({"config": rec["config"], **asdict(row)})
            _write(out, header, records)
            del model, modules
    _write(out, header, records)


def _write(out: Path, header: dict, records: list[dict]) -> None:
    (out / "bench_quantizers.json").write_text(json.dumps({**header, "rows": records}, indent=2))
    lines = [f"- {k}: {v}" for k, v in header.items()] + ["",
             "| config | method | ppl | gap recovered | extra memory | quant time (CPU) |", "|---|---|---:|---:|---:|---:|"]
    for r in records:
        gap = r.get("gap_recovered_own_base", r.get("gap_vs_rtn_per_channel"))
        gap = "—" if gap is None else f"{gap:.1f}%"
        mem = f"{r['memory_pct']:.2f}%" if "memory_pct" in r else "—"
        secs = f"{r['quant_time_s']:.0f} s" if "quant_time_s" in r else "—"
        lines.append(f"| {r['config']} | {r['method']} | {r['ppl']:.2f} | {gap} | {mem} | {secs} |")
    (out / "bench_quantizers.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
