"""The checkpoint format: file names, version, the tensors a checkpoint holds, and the schema check
of spear_config.json (every malformed field a SpearError naming it)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from torch import nn

from spear.config import QuantConfig
from spear.errors import SpearError
from spear.fileio import read_json

FORMAT = "spear-checkpoint"
VERSION = 1
CONFIG_NAME = "spear_config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
WEIGHTS_NAME = "model.safetensors"
DTYPES = ("float32", "float16", "bfloat16")
PLAN_NAME = "plan.json"  # spear calibrate's selection, written beside the checkpoint (spear.select.plan.PLAN_FILE)
# What a checkpoint written before spear_config.json listed its files holds: spear's own files and
# every file transformers' tokenizers save (the vocabulary files by their class's names).
_OLDER_CHECKPOINT_FILES = frozenset({
    CONFIG_NAME, WEIGHTS_NAME, GENERATION_CONFIG_NAME, PLAN_NAME, "config.json", "tokenizer.json",
    "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
    "chat_template.json", "additional_chat_templates", "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model",
    "spiece.model", "sentencepiece.bpe.model", "vocab.model"})


def is_checkpoint(path: str | os.PathLike) -> bool:
    return (Path(path) / CONFIG_NAME).is_file()


def tensor_sha256(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes as stored (row-major, its own dtype)."""
    return hashlib.sha256(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def quantization_config(quant: QuantConfig) -> dict:
    """config.json's ``quantization_config`` of a spear checkpoint: the method's name, which is what
    vLLM reads to pick the ``spear`` plugin without ``--quantization``, and a summary; every
    module's own settings stay in spear_config.json, which the plugin and spear's loader read."""
    return {"quant_method": "spear", "format": FORMAT, "version": VERSION, "config_file": CONFIG_NAME,
            "bits": quant.bits, "group_size": quant.group_size, "sym": quant.symmetric}


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
    files = cfg.get("files", [])
    if not isinstance(files, list) or not all(isinstance(f, str) and f and "/" not in f and f not in (".", "..")
                                              for f in files):
        _fail(path, f"files must list the names of the checkpoint's files, got {files!r:.80}")
    return cfg


def checkpoint_files(path: str | os.PathLike) -> set[str]:
    """The names of the files the spear checkpoint at ``path`` holds, as its spear_config.json
    lists them (with calibrate's plan.json, written after it); a checkpoint written before the
    list: every name a checkpoint may hold. A SpearError where spear_config.json is not spear's."""
    cfg = read_spear_config(path)
    if "files" not in cfg:
        return set(_OLDER_CHECKPOINT_FILES)
    return {*cfg["files"], CONFIG_NAME, PLAN_NAME}


def non_persistent_buffers(model: nn.Module) -> set[str]:
    """Qualified names of non-persistent buffers (rotary ``inv_freq``, Gemma's ``embed_scale``): recomputed,
    never saved. Only the buffers: a module holding one (Gemma's scaled embedding) still saves its weight."""
    names = set()
    for mname, mod in model.named_modules():
        for b in getattr(mod, "_non_persistent_buffers_set", ()):
            names.add(f"{mname}.{b}" if mname else b)
    return names
