"""Weights for the engine's model, from a checkpoint on disk or a model in memory.

Sources, each turned into the same two maps that ``llama.build_model`` places:

  a spear checkpoint   spear_config.json (schema checked) and model.safetensors (finite values,
                       the recorded SHA-256 with ``verify``): each quantized module's packed codes,
                       scales, zero points, bias and compensator, and every other tensor by name;
  an HF folder         its safetensors files (sharded or not), dense;
  a model in memory    a transformers causal LM, with spear's QuantLinears and compensators where
                       it has them (what ``spear calibrate`` leaves in a Python session).

Compensators are rebuilt from their recorded spec (spear.compensate.registry) and exported to
their runtime factors (spear.compensate.spec), so the engine computes exactly the module that
was calibrated. Nothing is unpickled.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from spear.compensate.spec import factors
from spear.errors import SpearError
from spear.fileio import read_json
from spear.serve.model.layers.linear import MemberWeights, QuantTensors

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # old checkpoints store the recomputed rotary buffer


def from_module(model: nn.Module) -> tuple[object, dict[str, MemberWeights], dict[str, torch.Tensor]]:
    """(config, quantized linears, other tensors) of a transformers model in memory."""
    from spear.quant.linear import QuantLinear

    quantized: dict[str, MemberWeights] = {}
    owned: set[str] = set()
    for name, mod in model.named_modules():
        if isinstance(mod, QuantLinear):
            ec = None if mod.compensator is None else factors(mod.compensator)
            quantized[name] = MemberWeights(
                name, quant=QuantTensors(mod.codes, mod.scales, mod.zeros, mod.bits, mod.group_size, mod.symmetric),
                bias=None if mod.bias is None else mod.bias.detach(), ec=ec)
            owned.add(name + ".")
    tensors = {}
    prefixes = tuple(owned)
    for name, t in model.state_dict(keep_vars=False).items():
        if name.startswith(prefixes) or name.endswith(_IGNORED_SUFFIXES):
            continue
        tensors[name] = t.detach()
    if getattr(model.config, "tie_word_embeddings", False) and "lm_head" not in quantized:
        tensors.pop("lm_head.weight", None)  # the same tensor as the embeddings
    return model.config, quantized, tensors


def _safetensor_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        data = read_json(index)
        try:
            names = sorted(set(data["weight_map"].values()))
        except (KeyError, TypeError, AttributeError) as exc:
            raise SpearError(f"{index} is not a valid safetensors index: no weight_map of file names ({exc})") from None
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise SpearError(f"{path} holds no safetensors weights (the engine reads *.safetensors only)")
    return files


def from_folder(path: Path, verify: bool = False) -> tuple[object, dict[str, MemberWeights], dict[str, torch.Tensor]]:
    """(config, quantized linears, other tensors) of a spear checkpoint or an HF folder."""
    from spear.models.checkpoint import CONFIG_NAME, WEIGHTS_NAME, is_checkpoint, read_hf_config, read_spear_config, \
        read_tensors

    config = read_hf_config(path)
    if not is_checkpoint(path):
        from spear.models.loading import _check_plain_folder

        _check_plain_folder(path)
        tensors: dict[str, torch.Tensor] = {}
        for f in _safetensor_files(path):
            tensors.update(read_tensors(f))
        return config, {}, {k: v for k, v in tensors.items() if not k.endswith(_IGNORED_SUFFIXES)}
    cfg = read_spear_config(path)
    file = path / WEIGHTS_NAME
    if not file.is_file():
        raise SpearError(f"checkpoint {path} lacks {WEIGHTS_NAME}")
    tensors = read_tensors(file, None, cfg.get("sha256", {}), verify)
    quantized = {name: _quantized_member(name, entry, tensors, path / CONFIG_NAME) for name, entry in
                 cfg["modules"].items()}
    return config, quantized, {k: v for k, v in tensors.items() if not k.endswith(_IGNORED_SUFFIXES)}


def _take(tensors: dict, key: str, shape: tuple, dtype: torch.dtype | None) -> torch.Tensor:
    t = tensors.pop(key, None)
    if t is None:
        raise SpearError(f"the checkpoint lacks tensor {key}")
    if tuple(t.shape) != shape:
        raise SpearError(f"checkpoint tensor {key}: shape {tuple(t.shape)}, expected {shape}")
    if dtype is not None and t.dtype != dtype:
        raise SpearError(f"checkpoint tensor {key}: dtype {t.dtype}, expected {dtype}")
    return t


def _quantized_member(name: str, entry: dict, tensors: dict, where: Path) -> MemberWeights:
    """One quantized module of a spear checkpoint (its tensors are taken out of ``tensors``)."""
    from spear.compensate.registry import build_compensator
    from spear.quant.primitives import n_groups, unpack_codes

    n, k, bits, group = entry["out_features"], entry["in_features"], entry["bits"], entry["group_size"]
    g = n_groups(k, group)
    packed = _take(tensors, f"{name}.qweight", (n, (k * bits + 7) // 8), torch.uint8)
    codes = unpack_codes(packed, bits, k)
    if int(codes.max()) >= 2 ** bits:
        raise SpearError(f"checkpoint tensor {name}.qweight holds codes beyond {bits} bits: the file is damaged")
    scales = _take(tensors, f"{name}.scales", (n, g), torch.float16)
    if entry["symmetric"]:
        zeros = torch.full((n, g), 2 ** (bits - 1), dtype=torch.uint8)
    else:
        zeros = _take(tensors, f"{name}.zeros", (n, g), torch.uint8)
        if int(zeros.max()) >= 2 ** bits:
            raise SpearError(f"checkpoint tensor {name}.zeros holds zero points beyond {bits} bits: the file is damaged")
    bias = _take(tensors, f"{name}.bias", (n,), None) if entry["bias"] else None
    ec = None
    if entry["compensator"] is not None:
        try:
            comp = build_compensator(entry["compensator"], k, n, device="cpu", dtype=torch.float32)
        except SpearError as exc:
            raise SpearError(f"{where}: module {name}: {exc}") from None
        except (TypeError, ValueError, KeyError) as exc:
            raise SpearError(f"{where}: module {name}: malformed compensator spec: {exc}") from None
        state = {key: _take(tensors, f"{name}.compensator.{key}", tuple(t.shape), None)
                 for key, t in comp.state_dict().items()}
        comp.load_state_dict({key: t.float() for key, t in state.items()})
        ec = factors(comp)
    return MemberWeights(name, quant=QuantTensors(codes, scales, zeros, bits, group, entry["symmetric"]), bias=bias,
                         ec=ec)


def generation_config(path):
    """The folder's generation config (transformers), None without one; a damaged one is a
    SpearError naming it (:func:`spear.models.checkpoint.read_generation_config`)."""
    from spear.models.checkpoint import read_generation_config

    return read_generation_config(path)


def eos_token_ids(config, gen_config) -> set[int]:
    """The ids that end a request by the model's configs: the generation config's and the model config's."""
    ids: set[int] = set()
    for source in (getattr(gen_config, "eos_token_id", None), getattr(config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source is not None:
            ids.update(source)
    return ids
