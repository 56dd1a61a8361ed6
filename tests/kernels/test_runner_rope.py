"""The engine's decode step with the rotary and cache write inside the attention kernel
(``model_runner.ROPE_IN_ATTENTION``) against the separate ``rope_write_kv`` launch, on the fused-kernel
layer path run through Triton's interpreter: same logits and caches, bit for bit."""

from __future__ import annotations

import torch

from spear.serve import model_runner as mr
from spear.serve.config import EngineConfig
from spear.serve.engine import LLMEngine
from spear.serve.sampling import SamplingParams


def test_decode_with_rope_in_attention_equals_the_separate_launch(tiny_llama, tokenizer, monkeypatch):
    from spear.kernels import fused
    from spear.kernels.attention import paged_decode_attention

    eng = LLMEngine(tiny_llama[0], tokenizer, EngineConfig(num_blocks=64, max_num_seqs=4, max_model_len=128,
                                                        cuda_graphs=False))
    for n in (5, 17, 33):  # three sequences, padded to four rows below
        eng.add_request(list(range(100, 100 + n)), SamplingParams(max_tokens=8, temperature=0))
    eng.step()  # prefill, on the reference layer path
    sched = eng.scheduler.schedule()
    assert sched.is_decode_only and len(sched.chunks) == 3
    runner = eng.runner
    inputs = runner._decode_inputs(sched, 4, 8)
    runner.fused = fused  # the fused-kernel layer path (CUDA's), here on the interpreter
    # the paged kernel for every decode attention, as on CUDA (decode_attention keeps CPU tensors on torch)
    monkeypatch.setattr(mr, "decode_attention", lambda q, kc, vc, t, lens, scale, rope=None:
                        paged_decode_attention(q, kc, vc, t, lens, scale, rope=rope))
    k0 = [k.clone() for k in runner.k_cache]
    v0 = [v.clone() for v in runner.v_cache]
    results = {}
    for flag in (False, True):
        monkeypatch.setattr(mr, "ROPE_IN_ATTENTION", flag)
        for dst, src in zip(runner.k_cache + runner.v_cache, k0 + v0):
            dst.copy_(src)
        with torch.inference_mode():
            logits = runner._forward_decode(*inputs)
        results[flag] = (logits, [k.clone() for k in runner.k_cache], [v.clone() for v in runner.v_cache])
    (l0, kc0, vc0), (l1, kc1, vc1) = results[False], results[True]
    assert torch.isfinite(l1).all()
    assert all(torch.equal(a, b) for a, b in zip(kc0 + vc0, kc1 + vc1)), "caches differ"
    assert torch.equal(l0, l1), "logits differ"
    # the new tokens' cache slots were written (they were zero before the step)
    pos = inputs[1][:3]
    slots = inputs[2][:3]
    bs = runner.block_size
    assert all(bool(k[slots // bs, slots % bs].abs().sum() > 0) for k in kc1)
    assert all(bool(k0_[slots // bs, slots % bs].abs().sum() == 0) for k0_ in k0), pos
