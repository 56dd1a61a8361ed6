"""Writing a spear checkpoint: every tensor packed and hashed, into a temporary sibling folder
renamed into place (spear/fileio.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from spear.compensate.registry import STORAGE_DTYPE as COMPENSATOR_DTYPE
from spear.compensate.registry import compensator_spec
from spear.config import QuantConfig
from spear.errors import SpearError
from spear.fileio import OWNER_FILE, check_output_folder, write_folder_atomic
from spear.models.checkpoint.format import (CONFIG_NAME, FORMAT, VERSION, WEIGHTS_NAME, checkpoint_files,
                                            non_persistent_buffers, quantization_config, tensor_sha256)
from spear.quant.linear import QuantLinear
from spear.quant.primitives import pack_codes


def check_checkpoint_out(out_dir: str | os.PathLike, overwrite: bool) -> Path:
    """Refuse ``out_dir`` as the folder of a new checkpoint before any work goes into one (see
    :func:`spear.fileio.check_output_folder`): ``overwrite`` replaces a spear checkpoint (its
    spear_config.json read whole) that holds nothing but its own files, or an empty folder;
    never a folder of anything else, nor one with a user's file beside the checkpoint's."""
    return check_output_folder(out_dir, overwrite, marker=CONFIG_NAME, owned=checkpoint_files)


def _module_entry(mod: QuantLinear) -> dict:
    return {
        "in_features": mod.in_features, "out_features": mod.out_features, "bits": mod.bits,
        "group_size": mod.group_size, "symmetric": mod.symmetric, "bias": mod.bias is not None,
        "compensator": None if mod.compensator is None else compensator_spec(mod.compensator),
    }


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    quant = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    out: dict[str, torch.Tensor] = {}
    for name, mod in quant.items():
        out[f"{name}.qweight"] = pack_codes(mod.codes, mod.bits)
        out[f"{name}.scales"] = mod.scales.to(torch.float16)
        if not mod.symmetric:
            out[f"{name}.zeros"] = mod.zeros
        if mod.bias is not None:
            out[f"{name}.bias"] = mod.bias.data
        if mod.compensator is not None:
            for k, t in mod.compensator.state_dict().items():
                out[f"{name}.compensator.{k}"] = t.to(COMPENSATOR_DTYPE) if t.is_floating_point() else t
    prefixes = tuple(f"{n}." for n in quant)
    seen: set[int] = set()
    skip = non_persistent_buffers(model)
    # named_parameters dedupes tied tensors (tie_weights restores them at load).
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.startswith(prefixes) or id(t) in seen or name in skip:
            continue
        seen.add(id(t))
        out[name] = t.data
    return {k: v.detach().contiguous().cpu() for k, v in out.items()}



def save_checkpoint(model: nn.Module, tokenizer, out_dir: str | os.PathLike, quant: QuantConfig,
                    source_model: str, meta: dict | None = None, overwrite: bool = False) -> Path:
    """Write ``model`` (with its QuantLinears and compensators) as a spear checkpoint; ``overwrite``
    replaces an existing spear checkpoint at ``out_dir`` that holds nothing but its own files
    (never a folder of anything else, nor a user's file beside the checkpoint's)."""
    from safetensors.torch import save_file

    modules = {n: _module_entry(m) for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    if not modules:
        raise SpearError("the model has no quantized modules; quantize it before saving a checkpoint")
    tensors = _tensors(model)
    for name, t in tensors.items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise SpearError(f"refusing to save: tensor {name} has non-finite values")
    spear_cfg = {
        "format": FORMAT, "version": VERSION, "source_model": str(source_model),
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "quant": quant.to_dict(), "modules": modules, "meta": meta or {},
        "sha256": {name: tensor_sha256(t) for name, t in sorted(tensors.items())},
    }

    def write(tmp: Path):
        model.config.save_pretrained(tmp)
        _name_method(tmp / "config.json", quant)
        gen = getattr(model, "generation_config", None)
        if gen is not None:
            gen.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt", "spear": str(VERSION)})
        # what --overwrite may replace: the files of this checkpoint (the tokenizer's depend on its class)
        spear_cfg["files"] = sorted({p.name for p in tmp.iterdir() if p.name != OWNER_FILE} | {CONFIG_NAME})
        (tmp / CONFIG_NAME).write_text(json.dumps(spear_cfg, indent=2))

    target = Path(out_dir)
    write_folder_atomic(target, write, overwrite, marker=CONFIG_NAME, owned=checkpoint_files)
    return target


def _name_method(config_json: Path, quant: QuantConfig) -> None:
    """Add ``quantization_config`` to the config.json ``save_pretrained`` just wrote."""
    cfg = json.loads(config_json.read_text())
    cfg["quantization_config"] = quantization_config(quant)
    config_json.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
