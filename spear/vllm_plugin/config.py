"""``SpearConfig``: the vLLM quantization method ``spear``, read from a checkpoint's spear_config.json.

``vllm serve CKPT --quantization spear`` finds spear_config.json in the folder
(:meth:`get_config_filenames`) and passes it to :meth:`from_config`. A config.json carrying
``"quantization_config": {"quant_method": "spear"}`` makes vLLM pick the method without the flag;
that stub holds no module list, so :meth:`maybe_update_config` reads spear_config.json from the
model folder then. Every linear recorded there gets :class:`SpearLinearMethod` (q/k/v and gate/up
together, as vLLM merges them); the others, the embeddings and the output head get vLLM's
unquantized methods.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.models.utils import WeightsMapper

from spear.errors import SpearError
from spear.models.checkpoint import CONFIG_NAME, FORMAT, VERSION, read_spear_config
from spear.vllm_plugin import sharding
from spear.vllm_plugin.linear_method import SpearLinearMethod

NAME = "spear"


def _check(cfg: dict) -> dict[str, sharding.Member]:
    if cfg.get("format") != FORMAT or cfg.get("version") != VERSION:
        raise SpearError(f"{CONFIG_NAME}: format {cfg.get('format')!r} version {cfg.get('version')!r}; "
                         f"the vLLM plugin reads {FORMAT!r} version {VERSION}")
    modules = {name: sharding.Member.from_entry(name, entry) for name, entry in cfg["modules"].items()}
    heads = [n for n in modules if n.rsplit(".", 1)[-1] == "lm_head"]
    if heads:
        raise SpearError(f"the vLLM plugin serves the output head unquantized; this checkpoint quantizes {heads[0]} "
                         "(quantize without --include-lm-head / --lm-head-bits)")
    return modules


@register_quantization_config(NAME)
class SpearConfig(QuantizationConfig):
    """The modules of one spear checkpoint, by their names in the checkpoint."""

    def __init__(self, spear_config: dict | None = None):
        super().__init__()
        self.spear_config = spear_config
        self.modules = None if spear_config is None else _check(spear_config)

    def __repr__(self) -> str:
        n = "?" if self.modules is None else len(self.modules)
        return f"SpearConfig({n} quantized modules)"

    def get_name(self) -> str:
        return NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        # fp16/bf16 run spear's kernels on CUDA; fp32 (and any dtype off CUDA) the torch reference
        return [torch.float16, torch.bfloat16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 80  # bf16 tensor-core tiles in the W4 kernels need Ampere; they are tuned on Hopper

    @staticmethod
    def get_config_filenames() -> list[str]:
        return [CONFIG_NAME]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "SpearConfig":
        if "modules" not in config:  # config.json's {"quant_method": "spear"}: the module list comes later
            return cls(None)
        return cls(config)

    def maybe_update_config(self, model_name: str, hf_config=None, revision=None) -> None:
        if self.modules is None:
            self.spear_config = read_spear_config(model_name)
            self.modules = _check(self.spear_config)

    def get_checkpoint_weight_mapper(self) -> WeightsMapper:
        # parameter names cannot hold dots: "<module>.compensator.A" loads into "<module>.ec_A"
        ours = WeightsMapper(orig_to_new_suffix={f".{ckpt}": f".{param}" for param, ckpt in sharding.SUFFIXES.items()
                                                 if param.startswith("ec_")})
        return super().get_checkpoint_weight_mapper() | ours

    def _members(self, prefix: str) -> list[str]:
        base, _, last = prefix.rpartition(".")
        parts = self.packed_modules_mapping.get(last)
        return [f"{base}.{p}" if base else p for p in parts] if parts else [prefix]

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if not isinstance(layer, LinearBase):
            return None  # embeddings and the output head: vLLM's unquantized methods
        if self.modules is None:
            raise SpearError(f"the spear quantization config has no module list yet ({CONFIG_NAME} unread)")
        names = self._members(prefix)
        found = [n in self.modules for n in names]
        if not any(found):
            return UnquantizedLinearMethod()
        if not all(found):
            missing = [n for n, f in zip(names, found) if not f]
            raise SpearError(f"vLLM runs {', '.join(names)} as one layer, but the checkpoint quantized only some "
                             f"of them ({', '.join(missing)} is not quantized)")
        return SpearLinearMethod(tuple(self.modules[n] for n in names))
