"""Arguments shared by several subcommands, and their conversion to configs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from spear.config import EvalConfig, QuantConfig
from spear.errors import SpearError
from spear.models.loading import DEFAULT_MODEL


def _int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"expected a number >= {minimum}, got {v}")
        return v

    parse.__name__ = f"int>={minimum}"
    return parse


positive_int = _int_at_least(1)
nonneg_int = _int_at_least(0)


def add_model_arg(p: argparse.ArgumentParser, default: str | None = DEFAULT_MODEL) -> None:
    p.add_argument("--model", default=default, required=default is None,
                   help=f"a local Hugging Face causal-LM folder, a spear checkpoint folder, or "
                        f"'{DEFAULT_MODEL}' (the embedded default){'' if default is None else ' (default: %(default)s)'}")


def add_text_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("text and evaluation protocol")
    g.add_argument("--text", default="wikipedia",
                   help="'wikipedia' (the embedded sample), 'wikitext2' (a cached datasets copy), "
                        "or a UTF-8 text file such as wiki.test.raw (default: %(default)s)")
    g.add_argument("--seq-len", type=positive_int, default=512, help="window length in tokens (default: %(default)s)")
    g.add_argument("--eval-windows", type=positive_int, default=24,
                   help="score the last N windows of the text (default: %(default)s)")
    g.add_argument("--calib-windows", type=nonneg_int, default=16,
                   help="activation statistics from the first N windows of the other articles (default: %(default)s)")
    g.add_argument("--batch-size", type=positive_int, default=1, help="windows per forward pass (default: %(default)s)")


def eval_config_from(args) -> EvalConfig:
    return EvalConfig(text=args.text, seq_len=args.seq_len, eval_windows=args.eval_windows,
                      calib_windows=args.calib_windows, batch_size=args.batch_size)


def add_quant_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("quantization")
    g.add_argument("--method", choices=["rtn", "gptq", "awq"], default="rtn", help="quantizer (default: %(default)s)")
    g.add_argument("--bits", type=int, choices=[2, 3, 4, 8], default=4, help="weight bits (default: %(default)s)")
    g.add_argument("--group-size", type=nonneg_int, default=0,
                   help="input columns per scale; 0 = per-channel (default: %(default)s)")
    g.add_argument("--asym", action="store_true", help="asymmetric (integer zero point) instead of symmetric")
    g.add_argument("--include-lm-head", action="store_true", help="also quantize the output head")
    c = p.add_argument_group("GPTQ / AWQ calibration")
    c.add_argument("--calib-source", choices=["self", "text"], default="self",
                   help="'self': sequences sampled from the FP model (data-free, cached); 'text': the "
                        "--calib-windows windows of --text (default: %(default)s)")
    c.add_argument("--calib-samples", type=positive_int, default=64,
                   help="self-sampled sequences (default: %(default)s)")
    c.add_argument("--calib-seq-len", type=positive_int, default=128,
                   help="length of each self-sampled sequence in tokens (default: %(default)s)")
    c.add_argument("--gptq-damp", type=float, default=0.01,
                   help="GPTQ dampening, fraction of the mean Hessian diagonal (default: %(default)s)")
    c.add_argument("--act-order", action="store_true",
                   help="GPTQ: quantize columns by decreasing Hessian diagonal (static groups)")
    c.add_argument("--awq-no-clip", action="store_true", help="AWQ: skip the clipping search")


def quant_config_from(args) -> QuantConfig:
    from spear.config import AWQConfig, CalibConfig, GPTQConfig

    return QuantConfig(bits=args.bits, group_size=args.group_size, symmetric=not args.asym,
                       method=args.method, include_lm_head=args.include_lm_head,
                       calib=CalibConfig(source=args.calib_source, n_samples=args.calib_samples,
                                         seq_len=args.calib_seq_len),
                       gptq=GPTQConfig(damp=args.gptq_damp, act_order=args.act_order),
                       awq=AWQConfig(clip=not args.awq_no_clip))


def read_plan(path: str | None) -> dict[str, int] | None:
    """A plan file: JSON ``{module name: rank}`` or ``{"plan": {...}}``."""
    if path is None:
        return None
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise SpearError(f"plan file {p} does not exist") from None
    except json.JSONDecodeError as exc:
        raise SpearError(f"plan file {p} is not valid JSON: {exc}") from exc
    if isinstance(data, dict) and "plan" in data:
        data = data["plan"]
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, int) and v >= 0 for k, v in data.items()):
        raise SpearError(f"plan file {p} must map module names to non-negative integer ranks")
    return data
