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
quantized shells, and validates spear_config.json's schema and every tensor's name,
shape, dtype, finiteness and code range before assigning it; nothing is ever
unpickled, and a damaged file is a SpearError naming it, never a traceback or random
weights. spear_config.json records each tensor's SHA-256; ``verify=True``
(``--verify``) checks them, which also catches bit flips that leave values finite.
Writes go to a temporary sibling folder that is renamed into place, so a failed
write leaves nothing half-written; the temporary folders of a killed writer are
removed by the next write to the same place (spear/fileio.py).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from torch import nn

from spear.compensate.registry import STORAGE_DTYPE as COMPENSATOR_DTYPE
from spear.compensate.registry import build_compensator, compensator_spec
from spear.config import QuantConfig
from spear.errors import SpearError
from spear.fileio import check_output_folder, read_json, write_folder_atomic
from spear.models.modules import linearize_conv1d, set_module
from spear.quant.linear import QuantLinear
from spear.quant.primitives import n_groups, pack_codes, unpack_codes

FORMAT = "spear-checkpoint"
VERSION = 1
CONFIG_NAME = "spear_config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
WEIGHTS_NAME = "model.safetensors"
DTYPES = ("float32", "float16", "bfloat16")


def is_checkpoint(path: str | os.PathLike) -> bool:
    return (Path(path) / CONFIG_NAME).is_file()


def check_checkpoint_out(out_dir: str | os.PathLike, overwrite: bool) -> Path:
    """Refuse ``out_dir`` as the folder of a new checkpoint before any work goes into one (see
    :func:`spear.fileio.check_output_folder`): ``overwrite`` replaces a spear checkpoint (its
    spear_config.json read whole) or an empty folder, never a folder of anything else."""
    return check_output_folder(out_dir, overwrite, marker=CONFIG_NAME, owned=read_spear_config)


def tensor_sha256(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes as stored (row-major, its own dtype)."""
    return hashlib.sha256(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


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


def save_checkpoint(model: nn.Module, tokenizer, out_dir: str | os.PathLike, quant: QuantConfig,
                    source_model: str, meta: dict | None = None, overwrite: bool = False) -> Path:
    """Write ``model`` (with its QuantLinears and compensators) as a spear checkpoint; ``overwrite``
    replaces an existing spear checkpoint at ``out_dir`` (never a folder of anything else)."""
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
        (tmp / CONFIG_NAME).write_text(json.dumps(spear_cfg, indent=2))

    target = Path(out_dir)
    write_folder_atomic(target, write, overwrite, marker=CONFIG_NAME, owned=read_spear_config)
    return target


def quantization_config(quant: QuantConfig) -> dict:
    """config.json's ``quantization_config`` of a spear checkpoint: the method's name, which is what
    vLLM reads to pick the ``spear`` plugin without ``--quantization``, and a summary; every
    module's own settings stay in spear_config.json, which the plugin and spear's loader read."""
    return {"quant_method": "spear", "format": FORMAT, "version": VERSION, "config_file": CONFIG_NAME,
            "bits": quant.bits, "group_size": quant.group_size, "sym": quant.symmetric}


def _name_method(config_json: Path, quant: QuantConfig) -> None:
    """Add ``quantization_config`` to the config.json ``save_pretrained`` just wrote."""
    cfg = json.loads(config_json.read_text())
    cfg["quantization_config"] = quantization_config(quant)
    config_json.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _fail(path: Path, message: str):
    raise SpearError(f"{path / CONFIG_NAME}: {message}")


def _check_module_entry(path: Path, name, entry) -> None:
    if not isinstance(name, str) or not name:
        _fail(path, f"module names must be non-empty strings, got {name!r}")
    if not isinstance(entry, dict):
        _fail(path, f"module {name}: expected an object, got {type(entry).__name__}")
    for key in ("in_features", "out_features", "bits", "group_size"):
        v = entry.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if key == "group_size" else 1):
            _fail(path, f"module {name}: {key} must be a whole number >= {0 if key == 'group_size' else 1}, "
                        f"got {v!r}")
    if entry["bits"] not in (2, 3, 4, 8):
        _fail(path, f"module {name}: bits must be 2, 3, 4 or 8, got {entry['bits']}")
    for key in ("symmetric", "bias"):
        if not isinstance(entry.get(key), bool):
            _fail(path, f"module {name}: {key} must be true or false, got {entry.get(key)!r}")
    comp = entry.get("compensator")
    if comp is not None:
        from spear.compensate.spec import CompensatorSpec

        try:
            CompensatorSpec.from_dict(comp)
        except SpearError as exc:
            _fail(path, f"module {name}: {exc}")


def read_spear_config(path: str | os.PathLike) -> dict:
    """spear_config.json, its schema checked (every malformed field is a SpearError naming it)."""
    path = Path(path)
    if not os.path.lexists(path / CONFIG_NAME):
        raise SpearError(f"{path} is not a spear checkpoint (no {CONFIG_NAME})")
    cfg = read_json(path / CONFIG_NAME)
    if not isinstance(cfg, dict):
        _fail(path, f"expected a JSON object, got {type(cfg).__name__}")
    if cfg.get("format") != FORMAT:
        _fail(path, f"format is {cfg.get('format')!r}, expected {FORMAT!r}")
    version = cfg.get("version")
    if isinstance(version, bool) or not isinstance(version, int):
        _fail(path, f"version must be the whole number {VERSION}, got {version!r} ({type(version).__name__})")
    if version != VERSION:
        _fail(path, f"version {version} is not supported; this spear reads version {VERSION}")
    for key in ("quant", "modules", "dtype"):
        if key not in cfg:
            _fail(path, f"lacks the field {key!r}")
    if cfg["dtype"] not in DTYPES:
        _fail(path, f"dtype must be one of {', '.join(DTYPES)}, got {cfg['dtype']!r}")
    if not isinstance(cfg["quant"], dict):
        _fail(path, f"quant must be an object, got {type(cfg['quant']).__name__}")
    try:
        QuantConfig.from_dict(cfg["quant"])
    except SpearError as exc:
        _fail(path, f"quant: {exc}")
    except (TypeError, ValueError) as exc:
        _fail(path, f"quant is malformed: {exc}")
    modules = cfg["modules"]
    if not isinstance(modules, dict) or not modules:
        _fail(path, f"modules must be a non-empty object of module name -> entry, got {modules!r:.80}")
    for name, entry in modules.items():
        _check_module_entry(path, name, entry)
    if not isinstance(cfg.get("meta", {}), dict):
        _fail(path, "meta must be an object")
    hashes = cfg.get("sha256", {})
    if not isinstance(hashes, dict) or not all(isinstance(k, str) and isinstance(v, str) and len(v) == 64
                                               for k, v in hashes.items()):
        _fail(path, "sha256 must map tensor names to 64-digit hex digests")
    return cfg


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
    skip = _non_persistent(model)
    seen: set[int] = set()
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.startswith(prefixes) or name in skip or id(t) in seen:
            continue
        seen.add(id(t))
        exp[name] = (tuple(t.shape), t.dtype)
    return exp


def _hf_config(path: Path):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path)
    except Exception as exc:  # a missing, malformed or unknown config.json
        raise SpearError(f"{path / 'config.json'} cannot be read as a transformers model config: {exc}") from None


def load_checkpoint(path: str | os.PathLike, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
                    verify: bool = False):
    """Load ``(model, tokenizer)`` from a spear checkpoint folder, validating every tensor
    (``verify``: also against the SHA-256 digests recorded at save)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    path = Path(path)
    cfg = read_spear_config(path)
    saved_dtype = getattr(torch, cfg["dtype"])
    hf_config = _hf_config(path)
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
