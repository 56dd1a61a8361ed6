"""Loading models (local HF folders, the embedded default) and spear checkpoints."""

from spear.models.loading import DEFAULT_MODEL, load_model, load_tokenizer, resolve_model_path
from spear.models.modules import quantizable_linears

__all__ = ["DEFAULT_MODEL", "load_model", "load_tokenizer", "resolve_model_path", "quantizable_linears"]
