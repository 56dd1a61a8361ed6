"""Shared fixtures: the default model's tokenizer and a tiny random Llama that uses it.

Without a CUDA GPU the Triton kernels run through Triton's CPU interpreter. ``triton.jit`` and
``spear.kernels._common.INTERPRET`` read TRITON_INTERPRET when ``spear.kernels`` is first imported,
and any test module may import it first, so it is set here, before every test module and every
other conftest is imported (tests/kernels/test_interpreter.py checks that it took effect).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# pytest-xdist workers share the machine's cores: each would otherwise start one torch thread per core, and
# 8 workers of 16 threads made a CPU reference of the GPU tests (a paged decode attention at 4,000 tokens,
# about a second alone) run past 45 s on a 16-core host (H100, 2026-12-07).
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))


@pytest.fixture(scope="session")
def default_model_path():
    from spear.models.loading import resolve_model_path

    return resolve_model_path("smollm2-135m")  # converts the embedded GGUF once per cache


@pytest.fixture(scope="session")
def tokenizer(default_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path)


def _tiny_llama(path, tokenizer, initializer_range):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id, initializer_range=initializer_range)
    LlamaForCausalLM(cfg).eval().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory, tokenizer):
    """A 2-layer random Llama (hidden 64) with the default tokenizer, saved as an HF folder."""
    return _tiny_llama(tmp_path_factory.mktemp("tiny-llama"), tokenizer, 0.02)


@pytest.fixture(scope="session")
def sharp_tiny_llama_path(tmp_path_factory, tokenizer):
    """The tiny Llama with larger weights: peaked predictions, so quantization error shows in the KL."""
    return _tiny_llama(tmp_path_factory.mktemp("sharp-tiny-llama"), tokenizer, 0.1)


@pytest.fixture()
def tiny_llama(tiny_llama_path):
    from spear.models.loading import load_model

    return load_model(tiny_llama_path)


@pytest.fixture(scope="session")
def article_text():
    """A few real articles of the embedded Wikipedia sample, in WikiText layout."""
    from spear.data.text import load_text

    return "".join(load_text("wikipedia").articles[:12])


def sqnr_db(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.detach().double(), out.detach().double()
    return float(20 * torch.log10(ref.norm() / (ref - out).norm()))
