"""What a top-k teacher leaves out, by vocabulary: the evidence behind the top-k default.

Forward passes only (no training). On the model's own samples (the calibration set) and on
held-out text (what perplexity scores), for each k:

- ``tail_mass``: the FP teacher's mean probability outside its k most likely tokens (the mass
  the top-k KL matches only as one lump);
- ``next_outside``: how often the token that actually comes next lies outside the top k;
- ``kl_covered``: the top-k KL of the RTN W4 model against the FP model, as a fraction of the
  full KL: the share of the quantization damage the top-k objective can see at all.

    python benchmarks/bench_teacher_tail.py --model smollm2-135m
    python benchmarks/bench_teacher_tail.py --model ~/models/gemma-3-270m --ks 64,256,1024,4096
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spear.compensate.calibrate import kl_loss  # noqa: E402
from spear.compensate.teacher import TopKTeacher  # noqa: E402
from spear.config import QuantConfig  # noqa: E402
from spear.data import load_text, make_split  # noqa: E402
from spear.data.selfsample import SampleConfig, sample_sequences  # noqa: E402
from spear.eval.report import machine_label  # noqa: E402
from spear.models.loading import load_model  # noqa: E402
from spear.quant import quantize_model_rtn  # noqa: E402


@torch.no_grad()
def fp_pass(model, ids: torch.Tensor, ks: list[int]) -> tuple[dict, list[torch.Tensor]]:
    """Tail mass and next-token rank statistics per k; the FP log-probabilities (fp16) per sequence."""
    mass = {k: 0.0 for k in ks}
    miss = {k: 0 for k in ks}
    n, kept = 0, []
    for i in range(ids.shape[0]):
        x = ids[i:i + 1]
        lp = torch.log_softmax(model(input_ids=x, use_cache=False).logits.float(), -1)
        kept.append(lp.to(torch.float16))
        lp, nxt = lp[:, :-1], x[:, 1:]
        rank = (lp > lp.gather(-1, nxt[..., None])).sum(-1)  # tokens the teacher finds more likely
        csum = lp.topk(max(ks), dim=-1).values.exp().cumsum(-1)
        for k in ks:
            mass[k] += (1 - csum[..., k - 1]).clamp(min=0).sum().item()
            miss[k] += (rank >= k).sum().item()
        n += nxt.numel()
    return {k: {"tail_mass": mass[k] / n, "next_outside": miss[k] / n} for k in ks}, kept


@torch.no_grad()
def coverage(model, ids: torch.Tensor, teacher: list[torch.Tensor], ks: list[int]) -> dict:
    """Top-k KL / full KL of ``model`` against the stored FP log-probabilities."""
    full, top = 0.0, {k: 0.0 for k in ks}
    for i in range(ids.shape[0]):
        logits = model(input_ids=ids[i:i + 1], use_cache=False).logits
        t = teacher[i].float()
        full += kl_loss(logits, t).item()
        for k in ks:
            v, idx = t.topk(k, dim=-1)
            tail = torch.log1p(-v.exp().sum(-1).clamp(max=1.0 - 1e-7))
            top[k] += kl_loss(logits, TopKTeacher(v, idx, tail)).item()
    return {"kl_full": full / ids.shape[0], **{k: top[k] / full for k in ks}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--text", default="wikipedia")
    p.add_argument("--ks", default="64,256,1024,4096")
    p.add_argument("--samples", type=int, default=8, help="self-samples of 128 tokens (the calibration sampler)")
    p.add_argument("--text-windows", type=int, default=2, help="held-out windows of 512 tokens (the last ones)")
    args = p.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    t0 = time.perf_counter()
    model, tok = load_model(args.model)
    selfs = sample_sequences(model, tok, SampleConfig(n=args.samples, length=128), progress=False)
    text = make_split(load_text(args.text), tok, 512, args.text_windows, 0).eval
    out = {"model": args.model, "vocab": model.config.vocab_size, "machine": machine_label(),
           "date": time.strftime("%Y-%m-%d"), "ks": ks}
    s_stats, s_lp = fp_pass(model, selfs, ks)
    t_stats, t_lp = fp_pass(model, text, ks)
    quantize_model_rtn(model, QuantConfig(bits=4), progress=False)
    out["self_samples"] = {"teacher": s_stats, "w4_kl_covered": coverage(model, selfs, s_lp, ks)}
    out["text"] = {"teacher": t_stats, "w4_kl_covered": coverage(model, text, t_lp, ks)}
    out["seconds"] = time.perf_counter() - t0
    print(json.dumps(out, indent=1), flush=True)


if __name__ == "__main__":
    main()
