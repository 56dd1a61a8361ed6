"""``spear tune-kernels``: measure the W4 kernel's launches on this GPU and write a launch table."""

from __future__ import annotations

import json

from spear.fileio import write_text_atomic


def _shapes(text: str) -> list[tuple[str, int, int]]:
    import argparse

    out = []
    for part in text.split(","):
        try:
            n, k = (int(v) for v in part.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected layer shapes such as 4096x4096,28672x4096 (out x in "
                                             f"features); got {part!r}") from None
        if n < 16 or k < 64 or n % 16 or k % 64:
            raise argparse.ArgumentTypeError(f"layer shape {part!r}: out features a multiple of 16, in features "
                                             f"of 64 (the fragment layout's tile)")
        out.append((part, n, k))
    return out


def _classes(text: str) -> list[str]:
    import argparse

    from spear.kernels.launch import FRAGMENT_CLASSES, GLUON_CLASSES

    out = [c.strip() for c in text.split(",") if c.strip()]
    known = dict.fromkeys(FRAGMENT_CLASSES + GLUON_CLASSES)
    if not out or set(out) - set(known):
        raise argparse.ArgumentTypeError(f"token classes among {','.join(known)}; got {text!r}")
    return out


def register(sub) -> None:
    from spear.cli.common import add_model_arg

    p = sub.add_parser("tune-kernels", help="measure the W4 kernel's launches on this GPU (a launch table)",
                       description="Time the W4 kernel over a grid of launch shapes on the layer shapes of --model "
                                   "(or --shapes), on this CUDA GPU, and write the fastest as a JSON launch table "
                                   "for `spear serve --launch-table` (the built-in table was chosen on an H200 and, "
                                   "for the Gluon GEMM, an H100). "
                                   "--kernel triton (default): the Triton GEMM of the fragment layout, per token "
                                   "class from 1 to 4096 tokens, against cuBLAS FP16; --kernel gluon: the "
                                   "warp-specialized Gluon GEMM of the fragment layout (Hopper), per token class "
                                   "from 16 tokens on, kept for a class only where it beats the path without it. "
                                   "Needs a CUDA GPU; minutes.")
    add_model_arg(p)
    p.add_argument("--shapes", type=_shapes, default=None,
                   help="tune on these layer shapes instead of --model's, e.g. 4096x4096,28672x4096,4096x14336 "
                        "(out x in features)")
    p.add_argument("--kernel", choices=["triton", "gluon"], default="triton",
                   help="the launches to tune: the fragment layout's Triton GEMM or its Gluon GEMM "
                        "(default: %(default)s)")
    p.add_argument("--classes", type=_classes, default=None,
                   help="--kernel triton: the token classes to tune, among 16,32,64,128,256,big; --kernel gluon: "
                        "among 16,32,64,128,256,512,1024,big (default: all); the others keep the built-in launches")
    p.add_argument("--out", required=True, help="the launch table to write (JSON)")
    p.add_argument("--rows", default=None, help="also write every timing (JSON), with cuBLAS FP16 beside each")
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

    from spear.kernels import tune
    from spear.models.loading import resolve_model_path

    if args.shapes:
        shapes = args.shapes
    else:
        config = AutoConfig.from_pretrained(resolve_model_path(args.model))
        try:
            shapes = tune.model_shapes(config)
        except AttributeError as exc:
            raise SpearError(f"--model {args.model}: not a Llama-family config ({exc})") from None
    if args.kernel == "gluon":
        return _tune_gluon(args, shapes)
    return _tune_fragment(args, shapes)


def _tune_fragment(args, shapes) -> int:
    import torch

    from spear.errors import SpearError
    from spear.kernels import launch, tune

    table, rows = tune.tune_fragment(shapes, classes=args.classes, budget_s=args.budget_s, progress=not args.quiet)
    if not table["fragment"]:
        raise SpearError("no launch was timed on every shape within --budget-s; give it more time")
    _write_json(args.out, launch.to_json(launch.merged_table(table)))
    if args.rows:
        _write_json(args.rows, {"device": torch.cuda.get_device_name(), "rows": rows})
    _print_rows(rows, shapes, "default_us", "triton")
    print(f"wrote {args.out}: serve with `spear serve --model ... --launch-table {args.out}`")
    return 0


def _print_rows(rows, shapes, baseline: str, kind: str) -> None:
    """Per (shape, M) row: cuBLAS FP16, the ``baseline`` column, and the sweep's best launch."""
    import torch

    print(f"{torch.cuda.get_device_name()}: {len(rows)} shape x token rows on {', '.join(s[0] for s in shapes)}")
    print(f"{'M':>6} {'shape':>12} {'fp16 us':>9} {baseline.removesuffix('_us') + ' us':>12} "
          f"{'best ' + kind + ' us':>14}  vs fp16  launch")
    for r in rows:
        timed = {kk: v["us"] for kk, v in r["sweep"].items() if "us" in v}
        if not timed:
            continue
        best = min(timed, key=timed.get)
        split = r["sweep"][best].get("split")
        print(f"{r['m']:>6} {r['shape']:>12} {r['fp16_us']:>9.1f} {r[baseline]:>12.1f} {timed[best]:>14.1f} "
              f"{r['fp16_us'] / timed[best]:>7.2f}x  {best}" + (f" split {split}" if split else ""))


def _tune_gluon(args, shapes) -> int:
    import torch

    from spear.errors import SpearError
    from spear.kernels import launch, tune_gluon
    from spear.kernels.planner import target

    if not target(torch.device("cuda")).gluon:
        raise SpearError("--kernel gluon needs a Hopper GPU (sm_90) and a Triton with Gluon; this is "
                         f"{torch.cuda.get_device_name()}")
    table, rows = tune_gluon.tune_gluon(shapes, classes=args.classes, budget_s=args.budget_s, progress=not args.quiet)
    _write_json(args.out, launch.to_json(launch.merged_table(table)))
    if args.rows:
        _write_json(args.rows, {"device": torch.cuda.get_device_name(), "rows": rows})
    _print_rows(rows, shapes, "without_us", "gluon")
    for key, which in (("gluon_wide", f"{launch.GLUON_WIDE_N} or more output features"),
                       ("gluon_deep", f"fewer outputs and {launch.GLUON_DEEP_K} or more input features"),
                       ("gluon", "other shapes")):
        if key in table:
            print(f"classes that take the Gluon GEMM, layers of {which}: {', '.join(table[key]) or 'none'}")
    print(f"wrote {args.out}: serve with `spear serve --model ... --launch-table {args.out}`")
    return 0
