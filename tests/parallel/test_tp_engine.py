"""Tensor parallelism of the serving engine on the CPU: N gloo processes against one.

Greedy tokens of ``tensor_parallel_size`` N equal those of one rank, token for token, on the
default model (9 heads, 3 kv heads: N = 3) and on random Llama and Qwen2 models with GQA (12
heads, 6 kv heads: N = 2 and 3), for FP, W4, W4 + ungated and W4 + gated compensators (the
gated checkpoint mixes gated, ungated and absent ECs per layer, with gated ones on both
row-parallel layers: tests/vllm/_checkpoints.py). A small token budget makes the prompts'
prefill chunked, so mixed steps (prefill chunks beside decodes) run too. Each TP engine starts
N - 1 worker processes (~10 s on 2 cores): the default selection runs the gated case of each
model, the whole matrix is ``slow``.
"""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from spear.errors import SpearError
from spear.serve import EngineConfig, LLMEngine, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _config(tp: int, **kw) -> EngineConfig:
    return EngineConfig(tensor_parallel_size=tp, max_num_seqs=4, max_num_batched_tokens=8, num_blocks=96, **kw)


def _greedy(path, tp: int) -> list[list[int]]:
    with LLMEngine.from_pretrained(str(path), _config(tp), device="cpu") as engine:
        return [o.output_token_ids for o in engine.generate(PROMPTS, GREEDY)]


def _random_folder(root, kind: str, tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cls, model_cls = (LlamaConfig, LlamaForCausalLM) if kind == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    cfg = cls(vocab_size=len(tokenizer), hidden_size=192, intermediate_size=384, num_hidden_layers=2,
              num_attention_heads=12, num_key_value_heads=6, max_position_embeddings=512, tie_word_embeddings=True,
              initializer_range=0.08, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    path = root / kind
    model_cls(cfg).eval().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _variants(root, fp_path) -> dict:
    """FP (the HF folder), RTN W4 per-channel, and W4 with ungated / gated seeded ECs."""
    from spear.config import QuantConfig
    from spear.models.checkpoint import save_checkpoint
    from spear.models.loading import load_model
    from spear.quant.api import quantize_model
    from tests.vllm._checkpoints import write_compensated

    model, tok = load_model(fp_path)
    cfg = QuantConfig(bits=4, group_size=0)
    quantize_model(model, cfg, progress=False)
    save_checkpoint(model, tok, root / "w4", cfg, str(fp_path))
    write_compensated(root / "w4", root / "w4-ungated", seed=1, gated=False)
    write_compensated(root / "w4", root / "w4-gated", seed=2, gated=True)
    return {"fp": fp_path, "w4": root / "w4", "w4-ungated": root / "w4-ungated", "w4-gated": root / "w4-gated"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer, default_model_path):
    """model -> variant -> folder, made once per module (lazily per model)."""
    cache: dict = {}

    def get(model: str, variant: str):
        if model not in cache:
            root = tmp_path_factory.mktemp(f"tp-{model}")
            fp = default_model_path if model == "default" else _random_folder(root, model, tokenizer)
            cache[model] = _variants(root, fp)
        return cache[model][variant]

    return get


CASES = [(m, v, tp) for m, tps in (("default", (3,)), ("llama", (2, 3)), ("qwen2", (2, 3)))
         for v in ("fp", "w4", "w4-ungated", "w4-gated") for tp in tps]
# ~30 s each on 2 cores (start-up of the ranks included)
DEFAULT_CI = {("default", "w4-gated", 3), ("llama", "w4-gated", 2), ("qwen2", "w4-gated", 3)}


@pytest.mark.parametrize("model,variant,tp", [pytest.param(*c, marks=() if c in DEFAULT_CI else pytest.mark.slow)
                                              for c in CASES])
def test_tensor_parallel_greedy_equals_one_rank(checkpoints, model, variant, tp):
    """Catches: the gate applied to a rank's partial u, B split by columns, a rank's heads paired with
    another rank's kv heads, the head's vocabulary slices gathered out of order, a bias added per rank."""
    path = checkpoints(model, variant)
    want = _greedy(path, 1)
    assert _greedy(path, tp) == want
    assert not multiprocessing.active_children()  # the workers stopped with the engine


def test_a_model_whose_heads_do_not_split_is_refused_before_any_process_starts(default_model_path):
    with pytest.raises(SpearError, match="9 attention heads do not split evenly across 2"):
        LLMEngine.from_pretrained(default_model_path, _config(2), device="cpu")
    assert not multiprocessing.active_children()


def test_a_share_that_cuts_a_quantization_group_is_one_error_and_stops_the_workers(checkpoints, tmp_path):
    """RTN W4 g64 on a hidden size of 192: two ranks hold 96 inputs of o_proj each, which cuts a
    group; the engine fails with one line naming the module and leaves no worker behind."""
    from spear.config import QuantConfig
    from spear.models.checkpoint import save_checkpoint
    from spear.models.loading import load_model
    from spear.quant.api import quantize_model

    fp = checkpoints("llama", "fp")
    model, tok = load_model(fp)
    cfg = QuantConfig(bits=4, group_size=64)
    quantize_model(model, cfg, progress=False)
    save_checkpoint(model, tok, tmp_path / "g64", cfg, str(fp))
    with pytest.raises(SpearError, match="o_proj: a tensor-parallel rank's input columns 0..96 cut through its "
                                         "quantization groups of 64"):
        LLMEngine.from_pretrained(str(tmp_path / "g64"), _config(2), device="cpu")
    assert not multiprocessing.active_children()


def test_tensor_parallel_needs_a_folder(checkpoints):
    from spear.models.loading import load_model

    with pytest.raises(SpearError, match="loads each rank's share from disk"):
        LLMEngine(*load_model(checkpoints("llama", "fp")), config=_config(2))


def test_a_step_that_fails_after_it_was_sent_fails_its_requests_and_the_ranks_stop(checkpoints):
    """Rank 0 raises after sending a step: the other rank may wait in that step's collectives, so
    the step's requests fail (no retry in parts, whose collectives would pair with the sent step's),
    later steps are refused with a one-line reason, and close() stops the workers at once. Catches:
    later steps sent to ranks still inside the failed one (their collectives pair with the wrong
    step: a size mismatch aborts gloo, NCCL hangs or mixes data)."""
    import time

    path = checkpoints("llama", "w4")
    engine = LLMEngine.from_pretrained(str(path), _config(2), device="cpu")
    try:
        real, calls = engine.core.runner.run, []

        def run(step):
            calls.append(step.kind)
            if len(calls) == 3:
                raise RuntimeError("out of memory on rank 0")
            return real(step)

        engine.core.runner.run = run
        outs = engine.generate(PROMPTS[:2], GREEDY)
        assert all(o.finish_reason == "error" for o in outs)
        assert "out of memory on rank 0" in outs[0].error
        later = engine.generate(PROMPTS[:1], GREEDY)[0]
        assert later.finish_reason == "error" and "out of step" in later.error
    finally:
        t0 = time.monotonic()
        engine.close()
    assert time.monotonic() - t0 < 20
    assert not multiprocessing.active_children()
