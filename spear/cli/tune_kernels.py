"""``spear tune-kernels``: measure the W4 kernel's decode launches on this GPU and write a launch table."""

from __future__ import annotations

import json

from spear.fileio import write_text_atomic


def _tokens(text: str) -> tuple[int, ...]:
    import argparse

    try:
        tokens = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts such as 1,2,4; got {text!r}") from None
    if not tokens or any(t not in (1, 2, 4) for t in tokens) or 1 not in tokens:
        raise argparse.ArgumentTypeError(f"token counts are 1, 2 and 4 (the one-token loop's classes), 1 among them; "
                                         f"got {text!r}")
    return tokens


def register(sub) -> None:
    from spear.cli.common import add_model_arg

    p = sub.add_parser("tune-kernels", help="measure the W4 kernel's decode launches on this GPU (a launch table)",
                       description="Time the W4 kernel's one-token loops (1, 2 and 4 tokens) over a grid of launch "
                                   "shapes on the layer shapes of --model, on this CUDA GPU, and write the fastest "
                                   "as a JSON launch table for `spear serve --launch-table` (the built-in table was "
                                   "chosen on an H200). Needs a CUDA GPU; a few minutes.")
    add_model_arg(p)
    p.add_argument("--out", required=True, help="the launch table to write (JSON)")
    p.add_argument("--tokens", type=_tokens, default=(1, 2, 4),
                   help="token counts to tune, from 1, 2, 4 (default: 1,2,4)")
    p.add_argument("--budget-s", type=float, default=600,
                   help="stop starting new launches after this many seconds (default: %(default)s)")
    p.set_defaults(func=main)


def _write_json(path, data: dict) -> None:
    write_text_atomic(path, json.dumps(data, indent=1))


def main(args) -> int:
    import torch

    from spear.errors import SpearError

    if not torch.cuda.is_available():
        raise SpearError("tune-kernels times the W4 kernel on a CUDA GPU; none is available here")
    from transformers import AutoConfig

    from spear.kernels import launch, tune
    from spear.models.loading import resolve_model_path

    config = AutoConfig.from_pretrained(resolve_model_path(args.model))
    try:
        shapes = tune.model_shapes(config)
    except AttributeError as exc:
        raise SpearError(f"--model {args.model}: not a Llama-family config ({exc})") from None
    table, rows = tune.tune(shapes, tokens=args.tokens, budget_s=args.budget_s, progress=not args.quiet)
    if not table:
        raise SpearError("no launch was timed on every shape within --budget-s; give it more time")
    out = {k: launch._thaw(v) for k, v in launch.merged_table(table).items()}
    _write_json(args.out, out)
    print(f"{torch.cuda.get_device_name()}: {len(rows)} shape x token rows on {', '.join(s[0] for s in shapes)}")
    for m in args.tokens:
        rs = [r for r in rows if r["m"] == m]
        best, us, _ = tune._best(rows, "kmajor", m)
        if best is not None:
            tc = tune.geomean(r["kmajor"]["tc_us"] for r in rs)
            print(f"  {m} token(s): {best} {us:.1f} us geomean (tensor-core tiles {tc:.1f} us)")
    print(f"wrote {args.out}: serve with `spear serve --model ... --launch-table {args.out}`")
    return 0
