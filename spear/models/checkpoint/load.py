"""Loading a spear checkpoint: the architecture from config.json with empty weights, quantized
shells swapped in, every tensor checked (name, shape, dtype, finiteness, code range; with
``verify``, its SHA-256) before it is assigned."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from spear.compensate.registry import STORAGE_DTYPE as COMPENSATOR_DTYPE
from spear.compensate.registry import build_compensator
from spear.errors import SpearError
from spear.fileio import read_json
from spear.models.checkpoint.format import (CONFIG_NAME, GENERATION_CONFIG_NAME, WEIGHTS_NAME, is_checkpoint,
                                            non_persistent_buffers, read_spear_config, tensor_sha256)
from spear.models.modules import linearize_conv1d, set_module
from spear.quant.linear import QuantLinear
from spear.quant.primitives import n_groups, unpack_codes


def read_tensors(file: Path, expected: dict | None = None, hashes: dict | None = None,
                 verify: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor of ``file``, checked for finite values, against ``expected`` (name -> (shape,
    dtype); None: any names and shapes), and with ``verify`` against the digests ``hashes`` records.
    Any damage is a SpearError naming the file or the tensor."""
    from safetensors import safe_open

    hashes = hashes or {}
    state: dict[str, torch.Tensor] = {}
    try:
        with safe_open(str(file), framework="pt") as fh:
            keys = set(fh.keys())
            if expected is None:
                expected = {key: None for key in keys}
            missing = sorted(set(expected) - keys)
            if missing:
                raise SpearError(f"checkpoint {file} lacks tensor {missing[0]}"
                                 + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
            unexpected = sorted(keys - set(expected))
            if unexpected:
                raise SpearError(f"checkpoint {file} has unexpected tensor {unexpected[0]}"
                                 + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))
            for key in sorted(keys):
                shape = tuple(fh.get_slice(key).get_shape())
                want_shape, want_dtype = expected[key] or (shape, None)
                if shape != want_shape:
                    raise SpearError(f"checkpoint tensor {key}: shape {shape}, expected {want_shape}")
                t = fh.get_tensor(key)
                if want_dtype is not None and t.dtype != want_dtype:
                    raise SpearError(f"checkpoint tensor {key}: dtype {t.dtype}, expected {want_dtype}")
                if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                    raise SpearError(f"checkpoint tensor {key} holds non-finite values (NaN or inf): the file "
                                     "is damaged")
                if verify:
                    if key not in hashes:
                        raise SpearError(f"--verify: {file.parent / CONFIG_NAME} records no digest for {key} "
                                         "(written by an older spear)")
                    if tensor_sha256(t) != hashes[key]:
                        raise SpearError(f"--verify: checkpoint tensor {key} does not match its recorded SHA-256: "
                                         "the file is damaged")
                state[key] = t
    except SpearError:
        raise
    except Exception as exc:  # safetensors' own errors, a short read, an unreadable file
        raise SpearError(f"checkpoint {file} is not a readable safetensors file: {exc}") from None
    return state


def _expected(model: nn.Module, modules: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of every tensor the file must hold."""
    exp: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for name, entry in modules.items():
        mod = model.get_submodule(name)
        exp[f"{name}.qweight"] = ((mod.out_features, (mod.in_features * mod.bits + 7) // 8), torch.uint8)
        exp[f"{name}.scales"] = (tuple(mod.scales.shape), torch.float16)
        if not mod.symmetric:
            exp[f"{name}.zeros"] = (tuple(mod.zeros.shape), torch.uint8)
        if mod.bias is not None:
            exp[f"{name}.bias"] = (tuple(mod.bias.shape), mod.bias.dtype)
        if mod.compensator is not None:
            for k, t in mod.compensator.state_dict().items():
                exp[f"{name}.compensator.{k}"] = (tuple(t.shape), COMPENSATOR_DTYPE if t.is_floating_point() else t.dtype)
    prefixes = tuple(f"{n}." for n in modules)
    skip = non_persistent_buffers(model)
    seen: set[int] = set()
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.startswith(prefixes) or name in skip or id(t) in seen:
            continue
        seen.add(id(t))
        exp[name] = (tuple(t.shape), t.dtype)
    return exp


def read_hf_config(path: Path):
    """The folder's config.json as a transformers config. Read as JSON first, so that a file
    that is not (nested too deeply, truncated) is named as such here, not by whatever reads it
    next (the tokenizer's loader reads it too)."""
    from transformers import AutoConfig

    file = Path(path) / "config.json"
    data = read_json(file, "model config")
    if not isinstance(data, dict):
        raise SpearError(f"model config {file}: expected a JSON object, got {type(data).__name__}")
    try:
        return AutoConfig.from_pretrained(path)
    except Exception as exc:  # values or a model type transformers does not take
        raise SpearError(f"{file} cannot be read as a transformers model config: {exc}") from None


def check_folder_configs(path: str | os.PathLike) -> None:
    """Read every config file of a model folder or spear checkpoint as loading it will, weights
    aside: config.json, spear_config.json (a checkpoint's), generation_config.json; a SpearError
    naming the first damaged one. Cheap, so that a command says it before it starts anything
    (spear serve: before its HTTP server and engine core)."""
    path = Path(path)
    read_hf_config(path)
    if is_checkpoint(path):
        read_spear_config(path)
    read_generation_config(path)


def load_checkpoint(path: str | os.PathLike, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
                    verify: bool = False):
    """Load ``(model, tokenizer)`` from a spear checkpoint folder, validating every tensor
    (``verify``: also against the SHA-256 digests recorded at save)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    path = Path(path)
    cfg = read_spear_config(path)
    saved_dtype = getattr(torch, cfg["dtype"])
    hf_config = read_hf_config(path)
    try:
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(hf_config, dtype=saved_dtype)
    except ValueError as exc:  # not a causal-LM architecture transformers knows
        raise SpearError(f"{path / 'config.json'}: {exc}") from None
    linearize_conv1d(model)  # the saved model's Conv1D (GPT-2) were nn.Linear when it was written
    model.tie_weights()
    for name, entry in cfg["modules"].items():
        try:
            lin = model.get_submodule(name)
        except AttributeError:
            raise SpearError(f"checkpoint module {name} does not exist in the {hf_config.model_type} architecture") from None
        if not isinstance(lin, nn.Linear) or (lin.in_features, lin.out_features) != (entry["in_features"], entry["out_features"]):
            raise SpearError(f"checkpoint module {name}: recorded {entry['in_features']}->{entry['out_features']} "
                             f"but the architecture has {lin}")
        n_groups(entry["in_features"], entry["group_size"])
        q = QuantLinear(entry["in_features"], entry["out_features"], entry["bits"], entry["group_size"],
                        entry["symmetric"], bias=entry["bias"], dtype=saved_dtype, device="meta")
        if entry["compensator"] is not None:
            try:
                q.compensator = build_compensator(entry["compensator"], entry["in_features"], entry["out_features"],
                                                  device="meta", dtype=saved_dtype)
            except SpearError as exc:
                raise SpearError(f"{path / CONFIG_NAME}: module {name}: {exc}") from None
            except (TypeError, ValueError, KeyError) as exc:
                raise SpearError(f"{path / CONFIG_NAME}: module {name}: malformed compensator spec: {exc}") from None
        set_module(model, name, q)

    expected = _expected(model, cfg["modules"])
    file = path / WEIGHTS_NAME
    if not file.is_file():
        raise SpearError(f"checkpoint {path} lacks {WEIGHTS_NAME}")
    state = read_tensors(file, expected, cfg.get("sha256", {}), verify)

    for name, entry in cfg["modules"].items():
        mod: QuantLinear = model.get_submodule(name)
        codes = unpack_codes(state.pop(f"{name}.qweight"), mod.bits, mod.in_features)
        if int(codes.max()) >= 2 ** mod.bits:
            raise SpearError(f"checkpoint tensor {name}.qweight holds codes beyond {mod.bits} bits: the file is damaged")
        state[f"{name}.codes"] = codes
        if not mod.symmetric and int(state[f"{name}.zeros"].max()) >= 2 ** mod.bits:
            raise SpearError(f"checkpoint tensor {name}.zeros holds zero points beyond {mod.bits} bits: "
                             "the file is damaged")
        if mod.symmetric:
            state[f"{name}.zeros"] = torch.full(tuple(mod.zeros.shape), 2 ** (mod.bits - 1), dtype=torch.uint8)
        if mod.compensator is not None:
            for k in list(mod.compensator.state_dict()):
                key = f"{name}.compensator.{k}"
                state[key] = state[key].to(saved_dtype) if state[key].is_floating_point() else state[key]
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    for m in model.modules():
        # a quantized head of a tied model: tie_weights has just hung the input embeddings on it as
        # a stray ``weight`` parameter; the head computes from its codes, so it must not hold one
        if isinstance(m, QuantLinear):
            m._parameters.pop("weight", None)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.device.type == "meta":
            raise SpearError(f"checkpoint {path} left tensor {name} unset")
    for m in model.modules():
        if isinstance(m, QuantLinear):
            for p in m.parameters():
                p.requires_grad_(False)
    if dtype is not None and dtype != saved_dtype:
        model.to(dtype)
        for m in model.modules():
            if isinstance(m, QuantLinear):
                m.compute_dtype = dtype
    model.to(device).eval()
    return model, load_folder_tokenizer(path)


def read_generation_config(path: str | os.PathLike):
    """The folder's generation_config.json as a transformers ``GenerationConfig``, None without one.
    A file that is there but unreadable, not JSON (nested too deeply included), not an object, or
    not a generation config transformers accepts is a SpearError naming it: its end-of-sequence
    ids decide where generation stops, so a damaged one is never dropped silently."""
    from transformers import GenerationConfig

    file = Path(path) / GENERATION_CONFIG_NAME
    if not os.path.lexists(file):
        return None
    data = read_json(file)
    if not isinstance(data, dict):
        raise SpearError(f"{file}: expected a JSON object, got {type(data).__name__}")
    try:
        return GenerationConfig.from_pretrained(file.parent)
    except Exception as exc:  # values it refuses, or nesting its copies recurse too deeply into
        raise SpearError(f"{file} is not a generation config transformers accepts: {exc}") from None


def load_folder_tokenizer(path: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # missing or malformed tokenizer files
        raise SpearError(f"cannot load the tokenizer of {path}: {exc}") from None
