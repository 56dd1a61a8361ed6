"""Tiny random Llama models (own vocabulary, no tokenizer) and token ids for the GPTQ/AWQ/import tests."""

import pytest
import torch


def make_tiny_llama(seed: int = 0, tie: bool = False, layers: int = 2, kv_heads: int = 4):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64,
                      tie_word_embeddings=tie, attn_implementation="eager")
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        # Random norms and spread-out activations make the scaling non-trivial.
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.copy_(torch.rand_like(p) * 1.5 + 0.25)
    return model


class OnePlusNorm(torch.nn.Module):
    """A norm computing x · (1 + w): dividing w by s is not a fold, so AWQ and LET must detect and skip it."""

    def __init__(self, n):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(n))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + self.weight)


@pytest.fixture
def rand_llama():
    return make_tiny_llama()


@pytest.fixture
def rand_ids():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 128, (6, 16), generator=g)
