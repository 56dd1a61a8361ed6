"""spear checkpoints: a folder that any spear command and the Python API load.

Layout::

    config.json, generation_config.json, tokenizer files   (from the source model)
    spear_config.json   format version, quantization config, every quantized module
                        (shape, bits, group size, compensator kind and spec), and any
                        calibration / plan metadata the writer adds under "meta"
    model.safetensors   <module>.qweight  uint8 (out, ceil(in*bits/8)) packed codes
                        <module>.scales   fp16 (out, n_groups)
                        <module>.zeros    uint8 (out, n_groups)      (asymmetric only)
                        <module>.bias     (when the linear has one)
                        <module>.compensator.<tensor>   fp16
                        every other model tensor (embeddings, norms...) as is

Loading builds the architecture from config.json with empty weights, swaps in
quantized shells, and validates every tensor's name, shape and dtype before
assigning it; nothing is ever unpickled. Writes go to a temporary sibling folder
that is renamed into place, so a failed write leaves nothing half-written.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from spear.compensate.registry import STORAGE_DTYPE as COMPENSATOR_DTYPE
from spear.compensate.registry import build_compensator, compensator_spec
from spear.config import QuantConfig
from spear.errors import SpearError
from spear.models.modules import linearize_conv1d, set_module
from spear.quant.linear import QuantLinear
from spear.quant.primitives import n_groups, pack_codes, unpack_codes

FORMAT = "spear-checkpoint"
VERSION = 1
CONFIG_NAME = "spear_config.json"
WEIGHTS_NAME = "model.safetensors"


def is_checkpoint(path: str | os.PathLike) -> bool:
    return (Path(path) / CONFIG_NAME).is_file()


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
    skip = _non_persistent(model)
    # named_parameters dedupes tied tensors (tie_weights restores them at load).
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.startswith(prefixes) or id(t) in seen or name in skip:
            continue
        seen.add(id(t))
        out[name] = t.data
    return {k: v.detach().contiguous().cpu() for k, v in out.items()}


def _non_persistent(model: nn.Module) -> set[str]:
    """Qualified names of non-persistent buffers (rotary ``inv_freq``, Gemma's ``embed_scale``): recomputed,
    never saved. Only the buffers: a module holding one (Gemma's scaled embedding) still saves its weight."""
    names = set()
    for mname, mod in model.named_modules():
        for b in getattr(mod, "_non_persistent_buffers_set", ()):
            names.add(f"{mname}.{b}" if mname else b)
    return names


def publish_permissions(folder: Path) -> None:
    """Give a folder made by mkdtemp (mode 0700) the permissions of a normal one."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for f in folder.rglob("*"):
        os.chmod(f, (0o777 if f.is_dir() else 0o666) & ~umask)


def _write_atomic_folder(target: Path, write, overwrite: bool) -> None:
    target = target.expanduser()
    if target.exists() and not target.is_dir():
        raise SpearError(f"output {target} exists and is not a folder")
    if target.exists() and any(target.iterdir()) and not overwrite:
        raise SpearError(f"output folder {target} exists and is not empty (pass --overwrite to replace it)")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        write(tmp)
        publish_permissions(tmp)
        if target.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.replace(target, trash / "old")
            os.replace(tmp, target)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_checkpoint(model: nn.Module, tokenizer, out_dir: str | os.PathLike, quant: QuantConfig,
                    source_model: str, meta: dict | None = None, overwrite: bool = False) -> Path:
    """Write ``model`` (with its QuantLinears and compensators) as a spear checkpoint."""
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
    }

    def write(tmp: Path):
        model.config.save_pretrained(tmp)
        gen = getattr(model, "generation_config", None)
        if gen is not None:
            gen.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt", "spear": str(VERSION)})
        (tmp / CONFIG_NAME).write_text(json.dumps(spear_cfg, indent=2))

    target = Path(out_dir)
    _write_atomic_folder(target, write, overwrite)
    return target


def read_spear_config(path: str | os.PathLike) -> dict:
    path = Path(path)
    try:
        cfg = json.loads((path / CONFIG_NAME).read_text())
    except FileNotFoundError:
        raise SpearError(f"{path} is not a spear checkpoint (no {CONFIG_NAME})") from None
    except json.JSONDecodeError as exc:
        raise SpearError(f"{path / CONFIG_NAME} is not valid JSON: {exc}") from exc
    if cfg.get("format") != FORMAT:
        raise SpearError(f"{path / CONFIG_NAME}: format is {cfg.get('format')!r}, expected {FORMAT!r}")
    if cfg.get("version") != VERSION:
        raise SpearError(f"{path / CONFIG_NAME}: version {cfg.get('version')} is not supported (this spear reads {VERSION})")
    for key in ("quant", "modules", "dtype"):
        if key not in cfg:
            raise SpearError(f"{path / CONFIG_NAME} lacks the field {key!r}")
    return cfg


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
    skip = _non_persistent(model)
    seen: set[int] = set()
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.startswith(prefixes) or name in skip or id(t) in seen:
            continue
        seen.add(id(t))
        exp[name] = (tuple(t.shape), t.dtype)
    return exp


def load_checkpoint(path: str | os.PathLike, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"):
    """Load ``(model, tokenizer)`` from a spear checkpoint folder, validating every tensor."""
    from accelerate import init_empty_weights
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    cfg = read_spear_config(path)
    saved_dtype = getattr(torch, cfg["dtype"], None)
    if not isinstance(saved_dtype, torch.dtype):
        raise SpearError(f"{path / CONFIG_NAME}: unknown dtype {cfg['dtype']!r}")
    QuantConfig.from_dict(cfg["quant"])  # validates
    hf_config = AutoConfig.from_pretrained(path)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=saved_dtype)
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
            q.compensator = build_compensator(entry["compensator"], entry["in_features"], entry["out_features"],
                                              device="meta", dtype=saved_dtype)
        set_module(model, name, q)

    expected = _expected(model, cfg["modules"])
    file = path / WEIGHTS_NAME
    if not file.is_file():
        raise SpearError(f"checkpoint {path} lacks {WEIGHTS_NAME}")
    state: dict[str, torch.Tensor] = {}
    with safe_open(str(file), framework="pt") as fh:
        keys = set(fh.keys())
        missing = sorted(set(expected) - keys)
        if missing:
            raise SpearError(f"checkpoint {file} lacks tensor {missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        unexpected = sorted(keys - set(expected))
        if unexpected:
            raise SpearError(f"checkpoint {file} has unexpected tensor {unexpected[0]}" + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))
        for key in sorted(keys):
            sl = fh.get_slice(key)
            shape = tuple(sl.get_shape())
            want_shape, want_dtype = expected[key]
            if shape != want_shape:
                raise SpearError(f"checkpoint tensor {key}: shape {shape}, expected {want_shape}")
            t = fh.get_tensor(key)
            if t.dtype != want_dtype:
                raise SpearError(f"checkpoint tensor {key}: dtype {t.dtype}, expected {want_dtype}")
            state[key] = t

    for name, entry in cfg["modules"].items():
        mod: QuantLinear = model.get_submodule(name)
        codes = unpack_codes(state.pop(f"{name}.qweight"), mod.bits, mod.in_features)
        if int(codes.max()) >= 2 ** mod.bits:
            raise SpearError(f"checkpoint tensor {name}.qweight holds codes beyond {mod.bits} bits")
        state[f"{name}.codes"] = codes
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
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer
