"""The random models bench_decode.py serves and the variants it makes of them: Llama-2-7B and
Llama-3-8B shapes (HF init, never zero weights), RTN W4 g128, gated ECs spread evenly up to a
memory budget."""

from __future__ import annotations

import math

import torch

from spear.compensate.ec import GatedCompensator
from spear.eval.memory import compensator_bytes, quantized_model_bytes

SHAPES = {
    "Llama-2-7B": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "Llama-3-8B": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                       rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    "Llama-2-13B": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
                        num_key_value_heads=40, vocab_size=32000, max_position_embeddings=4096,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024, max_position_embeddings=1024),
}
GROUP = 128


class IdsTokenizer:
    """The engine only decodes text for stop strings and streaming; ids suffice here."""
    eos_token_id = None

    def decode(self, ids, **kw):
        return ""

    def save_pretrained(self, path):  # a checkpoint of these models holds no tokenizer files
        pass


def build_model(shape: str, layers: int | None, device: str, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(SHAPES[shape])
    if layers:
        kw["num_hidden_layers"] = layers
    cfg = LlamaConfig(**kw, tie_word_embeddings=False, eos_token_id=None, bos_token_id=None)
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)  # HF init: normal(0, 0.02) linears, unit norms
    finally:
        torch.set_default_dtype(prev)
    return model.eval()


def attach_ecs(modules: dict, rank: int, hidden: int, budget: float | None, model) -> tuple[int, float]:
    """Gated ECs on evenly spread modules until ``budget`` x W4 bytes (all modules when None)."""
    names = list(modules)
    w4_bytes = quantized_model_bytes(model)
    per = {n: 2 * (rank * (m.in_features + m.out_features) + 2 * rank * hidden + hidden + rank + 1)
           for n, m in modules.items()}
    if budget is None:
        chosen = names
    else:
        stride = max(1, math.ceil(sum(per.values()) / (budget * w4_bytes)))
        chosen = names[::stride]
    g = torch.Generator().manual_seed(1)
    for n in chosen:
        q = modules[n]
        dev = q.codes.device
        a = (torch.randn(rank, q.in_features, generator=g) / math.sqrt(q.in_features)).to(dev)
        b = (torch.randn(q.out_features, rank, generator=g) * 1e-2).to(dev)
        ec = GatedCompensator(a, b, hidden=hidden)
        with torch.no_grad():
            ec.w2.copy_(torch.randn(ec.w2.shape, generator=g).to(dev) * 0.1)
        q.compensator = ec
    return len(chosen), 100 * compensator_bytes(model) / w4_bytes


def remove_ecs(modules: dict) -> None:
    for q in modules.values():
        q.compensator = None
