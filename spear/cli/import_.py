"""``spear import``: turn a Hugging Face GPTQ/AWQ checkpoint into a spear checkpoint."""

from __future__ import annotations


def register(sub) -> None:
    from spear.cli.common import OVERWRITE_HELP

    p = sub.add_parser("import", help="convert a HF GPTQ/AWQ folder (qweight/qzeros/scales) to a spear checkpoint",
                       description="Read a local Hugging Face GPTQ (checkpoint_format gptq or gptq_v2) or AWQ "
                                   "(GEMM) folder, unpack its int32 codes into spear's quantized linears "
                                   "(bit-exact), and write a spear checkpoint that every spear command loads.")
    p.add_argument("--model", required=True, help="local folder of the quantized HF model")
    p.add_argument("--out", required=True, help="spear checkpoint folder to write")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32",
                   help="dtype of the non-quantized tensors and of compute (default: %(default)s)")
    p.set_defaults(func=main)


def main(args) -> int:
    import torch

    from spear.eval.memory import quantized_model_bytes
    from spear.models.checkpoint import check_checkpoint_out, save_checkpoint
    from spear.quant import quantized_modules
    from spear.quant.hf_import import import_hf_quantized

    check_checkpoint_out(args.out, args.overwrite)
    model, tokenizer, quant, source_cfg = import_hf_quantized(args.model, dtype=getattr(torch, args.dtype))
    meta = {"imported_from": {k: v for k, v in source_cfg.items() if isinstance(v, (str, int, float, bool, type(None)))}}
    out = save_checkpoint(model, tokenizer, args.out, quant, args.model, meta=meta, overwrite=args.overwrite)
    n = len(quantized_modules(model))
    print(f"wrote {out}: {n} modules imported from {source_cfg['quant_method']} ({quant.label}), "
          f"quantized model {quantized_model_bytes(model) / 2**20:.1f} MiB")
    return 0
