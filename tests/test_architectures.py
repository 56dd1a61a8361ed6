"""The quality pipeline on architectures unlike the default model.

Tiny random models built from transformers configs (nothing downloaded): Llama, Qwen2
(q/k/v biases), Mistral (sliding window), Gemma-2 (GeGLU, pre/post norms, (1 + w) norms,
scaled tied embeddings, attention and final soft-capping), Gemma-3 (q/k norms, sliding and
full layers), Phi-3 (fused qkv and gate/up), GPT-2 (Conv1D, LayerNorm, biases) and OPT
(LayerNorm, biases, ReLU). On each: a norm that zeroes some channels of the MLP input (the
case that made L²QER's 1/S overflow fp16), RTN quantization, every static baseline, a short
KL calibration and a checkpoint round trip, with finite numbers everywhere, compensators that
lower the KL to the FP model, and a calibration whose training beat its static start.

The matrix quantizes at 3 bits, not the project's default 4: these tiny random models show
quantization error, and what eight calibration steps win back, more at W3. At W4 (the same
quantize, pack and checkpoint code; only the width differs) every assertion here still held
when checked, but the calibration gains range 0.45-24% of the start's validation KL (Gemma-2
the least: its best at step 4, worse again by step 8) against 1.2-16% at W3 (Mistral the least,
GPT-2 the most), so the check that training improved would rest on a far thinner margin.
"""

from __future__ import annotations

import math

import pytest
import torch

from spear.compensate.calib_config import CalibrationConfig
from spear.compensate.calibrate import ec_modules, val_kl
from spear.compensate.static import attach_static, remove_compensators
from spear.compensate.stats import collect_activation_stats
from spear.compensate.workflow import attach_ecs, calibrate, prepare_calibration, uniform_plan
from spear.config import STATIC_METHODS, QuantConfig, StaticCompensationConfig
from spear.errors import SpearError
from spear.eval.perplexity import perplexity
from spear.models.checkpoint import save_checkpoint
from spear.models.loading import load_model
from spear.models.modules import quantizable_linears
from spear.quant import quantize_model_rtn

VOCAB = 512
ZERO = [3, 17, 40]  # MLP input channels a norm weight zeroes


def _config(arch: str, tok):
    import transformers as tf

    ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.eos_token_id}
    # one decoder layer, two for Gemma-3 (a sliding-window layer and a full one)
    layers = 2 if arch == "gemma3" else 1
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  initializer_range=0.1, **ids)
    if arch == "llama":
        return tf.LlamaConfig(**common, tie_word_embeddings=True)
    if arch == "qwen2":
        return tf.Qwen2Config(**common)
    if arch == "mistral":
        return tf.MistralConfig(**common, sliding_window=8)
    if arch == "gemma2":
        return tf.Gemma2Config(**common, head_dim=16, query_pre_attn_scalar=16, sliding_window=8)
    if arch == "gemma3":
        return tf.Gemma3TextConfig(**common, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                                   layer_types=["sliding_attention", "full_attention"],
                                   final_logit_softcapping=30.0)
    if arch == "phi3":
        return tf.Phi3Config(**common)
    if arch == "gpt2":
        return tf.GPT2Config(vocab_size=VOCAB, n_positions=256, n_embd=64, n_layer=layers, n_head=4,
                             initializer_range=0.1, **ids)
    if arch == "opt":
        return tf.OPTConfig(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=layers,
                            num_attention_heads=4, word_embed_proj_dim=64, max_position_embeddings=256,
                            init_std=0.1, **ids)
    raise AssertionError(arch)


# per architecture: the norm in front of the MLP and the first MLP linear it feeds
MLP_INPUT = {
    "llama": ("post_attention_layernorm", "mlp.up_proj"), "qwen2": ("post_attention_layernorm", "mlp.up_proj"),
    "mistral": ("post_attention_layernorm", "mlp.up_proj"), "phi3": ("post_attention_layernorm", "mlp.gate_up_proj"),
    "gemma2": ("pre_feedforward_layernorm", "mlp.up_proj"), "gemma3": ("pre_feedforward_layernorm", "mlp.up_proj"),
    "gpt2": ("ln_2", "mlp.c_fc"), "opt": ("final_layer_norm", "fc1"),
}
ARCHS = list(MLP_INPUT)
SERVED = {"llama", "qwen2", "mistral"}


def _layers(model):
    return model.transformer.h if hasattr(model, "transformer") else \
        model.model.decoder.layers if hasattr(model.model, "decoder") else model.model.layers


def _zero_mlp_channels(model, arch):
    norm_name, _ = MLP_INPUT[arch]
    with torch.no_grad():
        for layer in _layers(model):
            norm = getattr(layer, norm_name)
            # Gemma's RMSNorm multiplies by (1 + w): w = -1 zeroes the channel
            norm.weight[ZERO] = -1.0 if arch.startswith("gemma") else 0.0
            if getattr(norm, "bias", None) is not None:
                norm.bias[ZERO] = 0.0


@pytest.fixture(scope="module")
def tokenizer():
    """A word-level tokenizer over VOCAB tokens: saves and loads in milliseconds."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", bos_token="w1", eos_token="w2")


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tokenizer):
    from transformers import AutoModelForCausalLM

    out = {}
    for arch in ARCHS:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(_config(arch, tokenizer)).eval()
        _zero_mlp_channels(model, arch)
        path = tmp_path_factory.mktemp(arch)
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        out[arch] = path
    return out


CFG = CalibrationConfig(n_samples=8, val_samples=4, sample_len=20, steps=8, batch_size=4, eval_every=4,
                        patience=5, lr=5e-3, teacher_top_k=0, tune_scales=False, tune_norms=False)
QUANT = QuantConfig(bits=3)


@pytest.mark.parametrize("arch", ARCHS)
def test_quality_pipeline_on_architecture(arch, folders, tmp_path, monkeypatch):
    monkeypatch.setenv("SPEAR_CACHE", str(tmp_path / "cache"))
    model, tok = load_model(folders[arch])
    # Gemma-3 has a 262k vocabulary in real life: calibrate it against a top-k teacher
    cfg = CalibrationConfig(**{**CFG.to_dict(), "teacher_top_k": 16 if arch == "gemma3" else 0})
    data = prepare_calibration(model, tok, cfg, progress=False)
    mlp_in = f"{[n for n in quantizable_linears(model) if n.endswith(MLP_INPUT[arch][1])][0]}"
    assert (data.stats[mlp_in].mean_abs[ZERO] == 0).all()  # the zero-channel case is really there
    targets = quantizable_linears(model)
    assert all(type(m) is torch.nn.Linear for m in targets.values())  # GPT-2's Conv1D included
    n_linears = {"phi3": 4, "gpt2": 4, "opt": 6}.get(arch, 7) * len(_layers(model))
    assert len(targets) == n_linears

    stats = collect_activation_stats(model, targets, data.train_ids[:4], outer=True, progress=False)  # QERA-exact
    mods = quantize_model_rtn(model, QUANT, progress=False)
    snap = {n: (m.codes.clone(), m.scales.clone(), m.zeros.clone()) for n, m in mods.items()}

    def kl():
        v = val_kl(model, data.val_ids, data.val_teacher, cfg.batch_size)
        assert math.isfinite(v)
        return v

    base = kl()
    assert base > 0
    for method in STATIC_METHODS:
        attach_static(mods, data.fp_weights, StaticCompensationConfig(method=method, rank=2, loftq_iters=2), stats,
                      progress=False)
        for name, mod in mods.items():
            assert torch.isfinite(mod.compensator.A).all() and torch.isfinite(mod.compensator.B).all(), name
        assert kl() < base, method
        remove_compensators(model)
        for n, m in mods.items():  # LoftQ re-quantized: every method starts from the same codes
            m.set_quantized(*snap[n])

    attach_ecs(mods, data.fp_weights, uniform_plan(mods, 2), cfg, data.stats)
    start = kl()
    report = calibrate(model, data, cfg, progress=False)
    assert math.isfinite(report.best_val_kl)
    # Calibration is keep-best (it hands back the static start when training did not beat it), so
    # "no worse than the start" holds by construction. What is checked is that training itself won:
    # a trained step was kept, and it beat the start by at least 0.5% of the start's held-out KL
    # (every architecture here gains 1.2-16% at W3; none keeps its start at these sizes).
    # Catches: `opt.step()` left out of the training loop (the optimizer never steps: every
    # evaluation equals the start, which is kept), a learning rate of 0 for A and B (only α trains:
    # Llama, Qwen2 and Mistral keep their start, the others gain under 0.4%), or a report whose
    # initial_val_kl is the final one (`initial_val_kl=best`).
    assert report.initial_val_kl == pytest.approx(start, rel=1e-6)
    assert report.kept == "trained" and 0 < report.best_step <= report.steps_run, report
    assert report.best_val_kl < 0.995 * report.initial_val_kl, report
    assert report.best_val_kl < base
    assert kl() == pytest.approx(report.best_val_kl, rel=1e-6)
    assert math.isfinite(perplexity(model, data.val_ids, batch_size=4, progress=False).ppl)

    ckpt = save_checkpoint(model, tok, tmp_path / "ckpt", QUANT, str(folders[arch]), meta={"arch": arch})
    loaded, _ = load_model(ckpt)
    assert len(ec_modules(loaded)) == len(mods)
    assert all(torch.isfinite(t).all() for t in loaded.state_dict().values() if t.is_floating_point())
    with torch.no_grad():
        ref = model(input_ids=data.val_ids).logits
        got = loaded(input_ids=data.val_ids).logits
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", sorted(set(ARCHS) - SERVED))
def test_serving_engine_refuses_unserved_architectures(arch, tokenizer):
    from transformers import AutoModelForCausalLM

    from spear.serve import LLMEngine

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(arch, tokenizer)).eval()
    with pytest.raises(SpearError) as info:
        LLMEngine(model, tokenizer)
    msg = str(info.value)
    assert "\n" not in msg and repr(model.config.model_type) in msg and "llama" in msg
