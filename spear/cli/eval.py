"""``spear eval``: perplexity of a model or checkpoint on a text."""

from __future__ import annotations

import json
from pathlib import Path


def register(sub) -> None:
    from spear.cli.common import add_model_arg, add_text_args

    p = sub.add_parser("eval", help="perplexity of an HF folder, a spear checkpoint or the default model",
                       description="Perplexity with non-overlapping windows (SPEAR.md §4): the last "
                                   "--eval-windows windows of --text, tokenizer-level.")
    add_model_arg(p, verify=True)
    add_text_args(p)
    p.add_argument("--json", metavar="PATH",
                   help="also write the result as JSON to this file (checked before the model loads)")
    p.set_defaults(func=main)


def main(args) -> int:
    from spear.cli.common import eval_config_from
    from spear.eval.memory import compensator_bytes, quantized_model_bytes
    from spear.eval.perplexity import perplexity
    from spear.fileio import check_can_write_file, write_text_atomic
    from spear.models.loading import load_model
    from spear.pipeline import load_split
    from spear.quant import quantized_modules

    cfg = eval_config_from(args)
    if args.json:
        check_can_write_file(args.json)  # as --out is: before the evaluation, not after it
    model, tokenizer = load_model(args.model, verify=args.verify)
    split = load_split(tokenizer, cfg)
    res = perplexity(model, split.eval, cfg.batch_size, progress=not args.quiet)
    out = {"model": args.model, "text": split.text_name, **res.to_dict()}
    if quantized_modules(model):
        total, extra = quantized_model_bytes(model), compensator_bytes(model)
        out.update(quantized_model_bytes=total, compensator_bytes=extra, memory_pct=100 * extra / total)
    print(f"{args.model} on {split.text_name}: ppl {res.ppl:.3f} over {res.tokens} tokens "
          f"({res.windows} windows x {res.seq_len})")
    if args.json:
        write_text_atomic(Path(args.json).expanduser(), json.dumps(out, indent=2))
    return 0
