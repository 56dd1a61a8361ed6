import math

import torch
import torch.nn.functional as F

from spear.config import QuantConfig
from spear.eval.memory import quantized_model_bytes
from spear.eval.perplexity import perplexity
from spear.eval.report import Row, fill_gap, gap_recovered, markdown_table
from spear.quant import quantize_model_rtn


class _Uniform(torch.nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.vocab = vocab
        self.p = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, use_cache=False):
        return type("Out", (), {"logits": torch.zeros(*input_ids.shape, self.vocab)})()


def test_uniform_model_has_vocab_size_perplexity():
    res = perplexity(_Uniform(50), torch.randint(0, 50, (3, 9), generator=torch.Generator().manual_seed(0)),
                     progress=False)
    assert math.isclose(res.ppl, 50, rel_tol=1e-6)
    assert res.tokens == 3 * 8 and res.windows == 3 and res.seq_len == 9


def test_perplexity_matches_manual_nll(tiny_llama):
    model, _ = tiny_llama
    windows = torch.randint(0, 2000, (3, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(input_ids=windows).logits
    nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))
    for bs in (1, 2):
        res = perplexity(model, windows, batch_size=bs, progress=False)
        assert math.isclose(res.ppl, math.exp(nll.item()), rel_tol=1e-5)


def test_gap_recovered_and_table():
    assert gap_recovered(48.0, 36.0, 24.0) == 50.0
    rows = [Row("FP", 24.0), Row("W4", 48.0), Row("X", 30.0, 0.5, 1024)]
    fill_gap(rows, 24.0, 48.0)
    assert [r.gap_recovered for r in rows] == [100.0, 0.0, 75.0]
    table = markdown_table(rows)
    assert "| X | 30.00 | 75.0% | 0.50%" in table


def test_quantized_model_bytes(tiny_llama):
    model, _ = tiny_llama
    quantize_model_rtn(model, QuantConfig(bits=4, group_size=32, symmetric=False), progress=False)
    h, i, v, kv = 64, 128, model.config.vocab_size, 32
    per_layer = {"q": (h, h), "k": (h, kv), "v": (h, kv), "o": (h, h), "g": (h, i), "u": (h, i), "d": (i, h)}
    lin = sum(out * inp // 2 + out * (inp // 32) * 2 + out * (inp // 32) * 4 // 8 for inp, out in per_layer.values())
    rest = v * h + 2 * (2 * h) + h  # tied embedding, two norms per layer, final norm
    assert quantized_model_bytes(model) == 2 * lin + 2 * rest
