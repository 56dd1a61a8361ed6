import torch

from spear.config import QuantConfig
from spear.models.modules import quantizable_linears
from spear.quant import quantize_model_rtn, quantized_modules
from tests.conftest import sqnr_db


def test_rtn_replaces_every_linear_but_lm_head(tiny_llama):
    model, _ = tiny_llama
    n = len(quantizable_linears(model))
    assert n == 2 * 7  # q, k, v, o, gate, up, down per layer
    quantize_model_rtn(model, QuantConfig(), progress=False)
    assert len(quantized_modules(model)) == n
    assert type(model.lm_head) is torch.nn.Linear
    assert not quantizable_linears(model)


def test_rtn_w8_is_nearly_lossless(tiny_llama):
    model, _ = tiny_llama
    ids = torch.randint(0, 1000, (1, 32), generator=torch.Generator().manual_seed(0))
    ref = model(input_ids=ids).logits
    quantize_model_rtn(model, QuantConfig(bits=8, group_size=32), progress=False)
    out = model(input_ids=ids).logits
    assert sqnr_db(ref, out) > 35
