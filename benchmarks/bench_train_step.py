"""Seconds per KL calibration step of the default model, by what the step trains and the dtype it
computes in.

    python benchmarks/bench_train_step.py                         # the variants below, 2 x 12 steps
    python benchmarks/bench_train_step.py --variants fp32,bf16 --steps 20 --threads 2

Each variant runs ``train_ecs`` (spear/compensate/calibrate.py, the loop ``spear calibrate`` runs)
twice on the same RTN W4 per-channel model with rank-``--rank`` ECs on every linear, for 1 and for
1 + ``--steps`` steps, and reports the difference over ``--steps``: the steps alone, without the
validation passes and state copies both runs share. Batches are the default's (4 sequences of 128
tokens) of random token ids against the FP model's top-4,096 teacher of them: a step's cost does not
depend on what the tokens say. Variants: ``fp32`` / ``bf16`` (``train_dtype``), with ``+scales``
(``tune_scales``) and ``+norms`` (``tune_norms``) appended, e.g. ``bf16+scales+norms``.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spear.compensate.calib_config import CalibrationConfig  # noqa: E402
from spear.compensate.calibrate import train_ecs  # noqa: E402
from spear.compensate.scales import NormWeights, norm_modules  # noqa: E402
from spear.compensate.static import remove_compensators  # noqa: E402
from spear.compensate.stats import collect_activation_stats  # noqa: E402
from spear.compensate.teacher import top_k_of  # noqa: E402
from spear.compensate.workflow import attach_ecs, uniform_plan  # noqa: E402
from spear.config import QuantConfig  # noqa: E402
from spear.models.loading import load_model  # noqa: E402
from spear.models.modules import quantizable_linears  # noqa: E402
from spear.quant.api import Reference, quantize_for_compensation  # noqa: E402

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def parse_variant(spec: str) -> dict:
    dtype, *extras = spec.split("+")
    if dtype not in DTYPES or not set(extras) <= {"scales", "norms"}:
        raise SystemExit(f"variant {spec!r}: expected fp32|bf16 followed by +scales and/or +norms")
    return dict(train_dtype=DTYPES[dtype], tune_scales="scales" in extras, tune_norms="norms" in extras)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--variants", default="fp32,bf16,fp32+scales,fp32+scales+norms,bf16+scales+norms")
    p.add_argument("--steps", type=int, default=12, help="timed steps per variant (beyond the first)")
    p.add_argument("--rank", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    variants = {v: parse_variant(v) for v in args.variants.split(",") if v}
    model, tok = load_model(args.model)
    g = torch.Generator().manual_seed(0)
    base = CalibrationConfig(n_samples=16, val_samples=4, eval_every=10 ** 6, patience=10 ** 6)
    vocab = model.get_output_embeddings().out_features
    ids = torch.randint(0, vocab, (base.n_samples + base.val_samples, base.sample_len), generator=g)
    with torch.no_grad():
        teacher = top_k_of(torch.cat([model(input_ids=ids[i:i + 4], use_cache=False).logits
                                      for i in range(0, ids.shape[0], 4)]), 4096)
    lins = quantizable_linears(model, False)
    fp_w = {n: lin.weight.detach().clone() for n, lin in lins.items()}
    stats = collect_activation_stats(model, lins, ids[:8], progress=False)
    mods = quantize_for_compensation(model, QuantConfig(), [Reference(fp_w, stats)], progress=False, tokenizer=tok)
    scales0 = {n: m.scales.clone() for n, m in mods.items()}
    norms = NormWeights(norm_modules(model))
    norms0 = norms.state()
    train, val = slice(0, base.n_samples), slice(base.n_samples, None)
    print(f"# {datetime.date.today()}, {platform.machine()}, {torch.get_num_threads()} torch threads, "
          f"rank {args.rank} on {len(mods)} linears, batches of {base.batch_size} x {base.sample_len} tokens")
    print("| variant | s / step |\n|---|---:|")
    for name, over in variants.items():
        seconds = []
        for steps in (1, 1 + args.steps):
            cfg = replace(base, steps=steps, **over)
            attach_ecs(mods, fp_w, uniform_plan(mods, args.rank), cfg, stats)
            rep = train_ecs(model, ids[train], teacher[train], ids[val], teacher[val], cfg, progress=False)
            seconds.append(rep.seconds)
            remove_compensators(model)
            for n, m in mods.items():  # tuned scales and norms stay: the next run starts from the same base
                m.set_quantized(m.codes, scales0[n], m.zeros)
            norms.load_state(norms0)
        print(f"| {name} | {(seconds[1] - seconds[0]) / args.steps:.3f} |", flush=True)


if __name__ == "__main__":
    main()
