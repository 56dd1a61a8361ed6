"""Greedy output of the engine equals HF ``generate`` token for token (fp32, CPU).

Batch compositions: all prompts at once, chunked prefill with a small token budget,
requests arriving while others decode, and a cache so small that sequences are
preempted and recomputed. Also on an RTN W4 model with compensators, on a saved
spear checkpoint, and on tiny Qwen2 / Mistral / llama3-rope models (dense, W4 and W4 with
ECs; preempted too).
"""

from __future__ import annotations

import copy

import pytest
import torch

from spear.serve import EngineConfig, LLMEngine, SamplingParams
from tests.serve.conftest import hf_greedy

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a land far away, there lived",
    "The three primary colors are",
    "import numpy as np\nimport torch\n\n# A function that",
    "Photosynthesis is the process by which green plants and some other organisms use sunlight to "
    "synthesize foods from carbon dioxide and water. In plants, it generally involves the green pigment",
]
MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0)


@pytest.fixture(scope="module")
def reference(default_model):
    model, tok = default_model
    return [hf_greedy(model, tok, p, MAX_NEW) for p in PROMPTS]


def engine(model_and_tok, **cfg) -> LLMEngine:
    model, tok = model_and_tok
    return LLMEngine(model, tok, EngineConfig(**{"num_blocks": 256, **cfg}))


def test_batch_equals_hf(default_model, reference):
    eng = engine(default_model, max_num_seqs=8)
    outs = eng.generate(PROMPTS, GREEDY)
    assert [o.output_token_ids for o in outs] == reference
    assert all(o.finish_reason in ("length", "stop") for o in outs)
    assert eng.stats().kv_usage == 0.0


def test_chunked_prefill_equals_hf(default_model, reference):
    eng = engine(default_model, max_num_seqs=4, max_num_batched_tokens=7)  # the long prompt takes 6 steps
    outs = eng.generate(PROMPTS, GREEDY)
    assert [o.output_token_ids for o in outs] == reference


def test_arrivals_mid_decode_equal_hf(default_model, reference):
    eng = engine(default_model, max_num_seqs=8, max_num_batched_tokens=16, block_size=4)
    tokens: dict[str, list[int]] = {}
    pending = list(enumerate(PROMPTS))
    steps = 0
    while pending or eng.has_unfinished():
        if pending and steps % 3 == 0:  # a new request every third step, while others decode
            i, p = pending.pop(0)
            eng.add_request(p, GREEDY, request_id=str(i))
        for out in eng.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        steps += 1
    assert [tokens[str(i)] for i in range(len(PROMPTS))] == reference


def test_preemption_and_recompute_equal_hf(default_model, reference):
    # 12 blocks of 4 tokens: fewer than the prompts need together, so decodes preempt.
    eng = engine(default_model, num_blocks=12, block_size=4, max_num_seqs=6, max_num_batched_tokens=48)
    outs = eng.generate(PROMPTS[:4], GREEDY)
    assert eng.core.num_preemptions > 0
    assert [o.output_token_ids for o in outs] == reference[:4]
    assert eng.stats().kv_usage == 0.0


def test_stop_string_and_stop_token(default_model, reference):
    model, tok = default_model
    eng = engine(default_model)
    full = tok.decode(reference[0])
    stop = full.strip().split()[1]  # a word in the middle of the greedy continuation
    out = eng.generate([PROMPTS[0]], SamplingParams(max_tokens=MAX_NEW, temperature=0, stop=(stop,)))[0]
    assert out.finish_reason == "stop" and out.text == full[:full.index(stop)]
    # a stop token ends the output after it (as EOS does unless ignore_eos)
    out = eng.generate([PROMPTS[0]], SamplingParams(max_tokens=4, temperature=0, stop_token_ids=(reference[0][1],)))[0]
    assert out.output_token_ids == reference[0][:2] and out.finish_reason == "stop"
    assert tok.eos_token_id in eng.core.eos_ids


def test_seeded_sampling_is_reproducible_across_batches(default_model):
    eng = engine(default_model, max_num_seqs=4)
    p = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    alone = eng.generate([PROMPTS[2]], p)[0].output_token_ids
    batched = eng.generate([PROMPTS[0], PROMPTS[2], PROMPTS[3]],
                           [SamplingParams(max_tokens=8, temperature=1.0), p, GREEDY])[1].output_token_ids
    assert alone == batched


def test_abort_frees_blocks(default_model):
    eng = engine(default_model)
    rid = eng.add_request(PROMPTS[5], SamplingParams(max_tokens=50, temperature=0))
    eng.step()
    assert eng.stats().kv_usage > 0
    assert eng.abort(rid) and not eng.abort(rid)
    assert eng.stats().kv_usage == 0.0 and not eng.has_unfinished()


def test_requests_that_cannot_run_are_refused(default_model):
    from spear.errors import SpearError

    eng = engine(default_model, max_model_len=64)
    with pytest.raises(SpearError, match="empty"):
        eng.add_request([], GREEDY)
    with pytest.raises(SpearError, match="context"):
        eng.add_request(list(range(100, 170)), GREEDY)
    with pytest.raises(SpearError, match="max_tokens"):
        eng.add_request(list(range(100, 150)), SamplingParams(max_tokens=20))
    assert not eng.has_unfinished()


def test_step_outputs_are_snapshots(default_model):
    """Each step's output keeps the tokens and text of that step while the request goes on."""
    eng = engine(default_model, max_num_seqs=2)
    rid = eng.add_request(PROMPTS[0], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    seen = []
    while eng.has_unfinished():
        seen += [o for o in eng.step() if o.request_id == rid]
    final = seen[-1]
    assert final.finished and final.num_output_tokens == 8 == len(final.output_token_ids)
    for k, out in enumerate(seen, 1):
        assert out.output_token_ids == final.output_token_ids[:k] and out.num_output_tokens == k
        assert final.text.startswith(out.text)
        assert out.text == "".join(o.new_text for o in seen[:k])


def test_bad_engine_settings_are_refused(default_model):
    from spear.errors import SpearError
    from spear.serve.config import kernel_policy

    with pytest.raises(SpearError, match="pdl must be one of off, wait, auto"):
        kernel_policy(pdl="sometimes")
    with pytest.raises(SpearError, match="kernels must be a KernelPolicy"):
        EngineConfig(kernels="fast")
    with pytest.raises(SpearError, match=r"programmatic dependent launch \(pdl='wait'\) needs a Hopper"):
        engine(default_model, kernels=kernel_policy(pdl="wait"))
    # "auto" (the default) is PDL where the hardware has it: nothing on the CPU (no error either)
    for eng in (engine(default_model, kernels=kernel_policy(pdl="auto")), engine(default_model)):
        assert eng.core.config.kernels.pdl == "auto" and not eng.core.runner.pdl_ok and eng.core.runner.eager_ctx.pdl == 0
    with pytest.raises(SpearError, match="cannot read the launch table"):
        kernel_policy(launch_table="/nonexistent/launch_table.json")
    with pytest.raises(SpearError, match="nmajor.16.BN must be a power of two"):
        kernel_policy(launch_table={"nmajor": {"16": {"BN": 48}}})


# ---------------------------------------------------------------------- quantized models
def _rtn_w4(model, ec_layers: int = 0, rank: int = 4):
    """RTN W4 (per-channel) on every linear of ``model``, in place, and rank-``rank`` gated ECs (static
    closed-form A, B; a random non-trivial gate) on the linears of layers ``< ec_layers``."""
    from spear.compensate.ec import GatedCompensator
    from spear.compensate.svd_init import error_factors
    from spear.config import QuantConfig
    from spear.quant import quantize_model_rtn

    fp = {n: m.weight.detach().clone() for n, m in model.named_modules() if type(m) is torch.nn.Linear}
    modules = quantize_model_rtn(model, QuantConfig(bits=4), progress=False)
    g = torch.Generator().manual_seed(0)
    for name, q in modules.items():
        if int(name.split(".")[2]) < ec_layers:
            a, b = error_factors(fp[name], q, rank, None)
            ec = GatedCompensator(a.float(), b.float(), hidden=8)
            with torch.no_grad():  # a non-trivial gate, so the per-token path is exercised
                ec.w2.copy_(torch.randn(ec.w2.shape, generator=g) * 0.5)
            q.compensator = ec
    return modules


@pytest.fixture(scope="module")
def w4_model(default_model):
    """The default model with RTN W4 (per-channel) on every linear and rank-4 gated ECs on layers 0-3."""
    model, tok = default_model
    model = copy.deepcopy(model)
    _rtn_w4(model, ec_layers=4)
    return model, tok


def test_w4_with_compensators_equals_hf(w4_model):
    from spear.quant.linear import QuantLinear

    model, tok = w4_model
    assert sum(isinstance(m, QuantLinear) and m.compensator is not None for m in model.modules()) == 28
    prompts = PROMPTS[:3]
    ref = [hf_greedy(model, tok, p, MAX_NEW) for p in prompts]
    eng = engine(w4_model, max_num_seqs=4, max_num_batched_tokens=8)
    assert [o.output_token_ids for o in eng.generate(prompts, GREEDY)] == ref


@pytest.mark.parametrize("head_bits", [0, 8])
def test_spear_checkpoint_loads_and_equals_hf(tiny_llama_path, tmp_path, head_bits):
    """A W4 checkpoint, and one whose (tied) head is W8 too (--lm-head-bits 8), served greedily."""
    from spear.config import QuantConfig
    from spear.models.checkpoint import save_checkpoint
    from spear.models.loading import load_model
    from spear.quant.api import quantize_model
    from spear.quant.linear import QuantLinear

    model, tok = load_model(tiny_llama_path)
    cfg = QuantConfig(bits=4, group_size=32, include_lm_head=bool(head_bits), head_bits=head_bits)
    quantize_model(model, cfg, progress=False)
    save_checkpoint(model, tok, tmp_path / "ckpt", cfg, str(tiny_llama_path))
    eng = LLMEngine.from_pretrained(str(tmp_path / "ckpt"), EngineConfig(num_blocks=64), device="cpu")
    hf, _ = load_model(tmp_path / "ckpt")  # transformers' model of the same checkpoint: the reference
    assert isinstance(hf.lm_head, QuantLinear) == bool(head_bits)
    assert torch.equal(eng.core.model.lm_head.method.weight,
                       hf.lm_head.dequantized_weight() if head_bits else hf.lm_head.weight)
    ids = list(range(10, 30))
    assert eng.generate([ids], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0].output_token_ids \
        == hf_greedy(hf, tok, ids, 16)


# ---------------------------------------------------------------------- other Llama-family layouts
def _tiny(kind: str):
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, \
        Qwen2ForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1)
    if kind == "qwen2":  # q/k/v biases
        model = Qwen2ForCausalLM(Qwen2Config(**common))
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    elif kind == "mistral":
        model = MistralForCausalLM(MistralConfig(**common, sliding_window=None))
    else:  # llama3 rope scaling, untied head
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        model = LlamaForCausalLM(LlamaConfig(**common, rope_parameters=rope, tie_word_embeddings=False))
    return model.eval()


class _IdsTokenizer:
    """Enough of a tokenizer for token-id prompts."""
    eos_token_id = None

    def decode(self, ids, **kw):
        return " ".join(map(str, ids))


def _tiny_variant(kind: str, variant: str):
    """A tiny ``kind`` model as it is (dense), RTN W4 on its 14 linears, or W4 with gated rank-4 ECs on all of them."""
    from spear.quant.linear import QuantLinear

    model = _tiny(kind)
    if variant != "dense":
        _rtn_w4(model, ec_layers=2 if variant == "w4+ec" else 0)
    quant = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(quant) == (0 if variant == "dense" else 14)
    assert sum(m.compensator is not None for m in quant) == (14 if variant == "w4+ec" else 0)
    return model


FAMILY_PROMPTS = [list(range(3, 40)), list(range(50, 55)), [7] * 90]  # the last one passes position 64


def _family_greedy_equals_hf(model, eng, prompts=FAMILY_PROMPTS, max_new: int = 20):
    outs = eng.generate(prompts, SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True))
    for p, o in zip(prompts, outs):
        x = torch.tensor([p])
        ref = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert o.output_token_ids == ref, (p[:3], o.output_token_ids, ref)
    assert eng.stats().kv_usage == 0.0


@pytest.mark.parametrize("variant", ["dense", "w4", "w4+ec"])
@pytest.mark.parametrize("kind", ["qwen2", "mistral", "llama3"])
def test_llama_family_layouts_equal_hf(kind, variant):
    """Qwen2 (q/k/v biases), Mistral and llama3-rope (untied head) models, dense, RTN W4 and W4 with
    gated ECs, served greedily with chunked prefill: token for token transformers' generate of the
    same (quantized) model.

    Catches: the engine's loader dropping a QuantLinear's bias (``bias=None`` in
    ``spear/serve/model/loader.py::from_module``: the Qwen2 W4 cases) or its compensator (``ec=None``: the
    W4+EC cases)."""
    model = _tiny_variant(kind, variant)
    eng = LLMEngine(model, _IdsTokenizer(), EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=8,
                                                         max_num_seqs=4))
    _family_greedy_equals_hf(model, eng)


def test_llama_family_preemption_equals_hf():
    """The Qwen2 W4+EC model with 40 blocks of 4 tokens for five requests that need 83 together
    (prompts of 37, 5, 90, 60 and 30 tokens, 20 new tokens each): decodes preempt sequences, whose
    freed blocks others then fill, and the preempted ones are recomputed; the tokens still equal
    transformers'.

    Catches: a preempted sequence resuming on the KV of its freed blocks instead of recomputing
    them (``seq.num_computed_tokens = 0`` dropped from ``Scheduler._preempt``), and a cache large
    enough that nothing is preempted."""
    model = _tiny_variant("qwen2", "w4+ec")
    eng = LLMEngine(model, _IdsTokenizer(), EngineConfig(num_blocks=40, block_size=4, max_num_batched_tokens=48,
                                                         max_num_seqs=5))
    _family_greedy_equals_hf(model, eng, FAMILY_PROMPTS + [list(range(100, 160)), list(range(200, 230))])
    assert eng.core.num_preemptions > 0
