"""Weight quantization: primitives (quantize/dequantize/pack), the quantized linear, RTN."""

from spear.quant.linear import QuantLinear
from spear.quant.rtn import quantize_model_rtn


def quantized_modules(model) -> dict[str, QuantLinear]:
    """``{name: QuantLinear}`` of a model, in module order."""
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}


__all__ = ["QuantLinear", "quantize_model_rtn", "quantized_modules"]
