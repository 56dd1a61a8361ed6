"""Tensor parallelism on two CUDA GPUs (marked ``multi_gpu``; never in the default selection).

* The peer reduction (symmetric-memory buffers read by one ``tp_reduce_ec`` launch) against the
  NCCL all-reduce followed by the same kernel on the sum, on the same partials: within one unit
  in the last place of fp16 (the two sum the ranks' fp16 partials in fp32 in the same rank order,
  the all-reduce rounds the sum to fp16 first), and both against the fp32 reference.
* The engine at TP=2 (both reductions, CUDA graphs on) against TP=1: greedy tokens equal on a
  random GQA Llama with gated compensators on both row-parallel layers.

Run: ``python -m pytest -m multi_gpu tests/parallel -q`` on a host with two GPUs.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.multi_gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]


def _reduce_worker(rank: int, size: int, address: str, results):
    from spear.kernels import reference
    from spear.kernels.layout import pack_ec
    from spear.parallel.comm import AllReduceComm, PeerComm, RowPost, destroy_group, init_group
    from spear.parallel.shard import TPRank

    tp = TPRank(rank, size)
    device = torch.device(f"cuda:{rank}")
    torch.cuda.set_device(device)
    init_group(tp, address, device, 120)
    import torch.distributed as dist

    g = torch.Generator().manual_seed(0)  # the same EC on every rank
    n, r, h = 4096, 16, 16
    ec = pack_ec(torch.randn(r, 64, generator=g), torch.randn(n, r, generator=g) * 0.1, 0.9, torch.float16,
                 w1=torch.randn(h, r, generator=g), b1=torch.randn(h, generator=g), w2=torch.randn(r, h, generator=g),
                 b2=torch.randn(r, generator=g), bound=0.5)
    ec = type(ec)(*(t.to(device) if torch.is_tensor(t) else t for t in
                    (ec.a, ec.b, ec.w1, ec.b1, ec.w2, ec.b2, ec.alpha, ec.bound, ec.rank)))
    bias = torch.randn(n, generator=g).half().to(device)
    post = RowPost(n, bias, packed=ec)
    peer, nccl = PeerComm(tp, dist.group.WORLD, device, torch.float16, 64 * 16384), AllReduceComm(tp, dist.group.WORLD)
    out = {}
    for m in (1, 8, 32):
        mine = torch.Generator().manual_seed(100 + rank + m)
        y = torch.randn(m, n, generator=mine).half().to(device)
        u = torch.randn(m, ec.b.shape[1], generator=mine).half().to(device)
        peer.begin_step()
        a = peer.reduce(y, u, post)
        b = nccl.reduce(y, u, post)
        parts = [torch.empty(m, n + u.shape[1], dtype=torch.float16, device=device) for _ in range(size)]
        dist.all_gather(parts, torch.cat([y, u], -1))
        ref = reference.tp_reduce_ec(parts, n, bias, ec.b, ec.alpha, ec.w1, ec.b1, ec.w2, ec.b2, ec.bound)
        out[m] = (float((a.float() - b.float()).abs().max()), float((a.float() - ref).norm() / ref.norm()),
                  float((b.float() - ref).norm() / ref.norm()), float(ref.abs().max()))
    torch.cuda.synchronize()
    results[rank] = out
    destroy_group()


def test_peer_reduction_equals_the_allreduce_path():
    import torch.multiprocessing as mp

    from spear.serve.model.workers import free_address

    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    results = mp.Manager().dict()
    mp.spawn(_reduce_worker, args=(2, free_address(), results), nprocs=2, join=True)
    for rank in range(2):
        for m, (diff, err_peer, err_nccl, scale) in results[rank].items():
            assert diff <= 2 * 2.0 ** -10 * max(1.0, scale), (rank, m, diff)  # ~1 ulp of fp16 at the outputs' size
            assert err_peer < 2e-3 and err_nccl < 2e-3, (rank, m, err_peer, err_nccl)


@pytest.mark.parametrize("reduce", ["allreduce", "peer"])
def test_engine_on_two_gpus_equals_one(tmp_path, tokenizer, reduce):
    from transformers import LlamaConfig, LlamaForCausalLM

    from spear.config import QuantConfig
    from spear.models.checkpoint import save_checkpoint
    from spear.models.loading import load_model
    from spear.quant.api import quantize_model
    from spear.serve import EngineConfig, LLMEngine, SamplingParams
    from tests.vllm._checkpoints import write_compensated

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                      tie_word_embeddings=True, initializer_range=0.05)
    LlamaForCausalLM(cfg).eval().save_pretrained(tmp_path / "fp")
    tokenizer.save_pretrained(tmp_path / "fp")
    model, tok = load_model(tmp_path / "fp")
    qcfg = QuantConfig(bits=4, group_size=128)
    quantize_model(model, qcfg, progress=False)
    save_checkpoint(model, tok, tmp_path / "w4", qcfg, str(tmp_path / "fp"))
    write_compensated(tmp_path / "w4", tmp_path / "w4-gated", seed=2, gated=True)
    prompts = ["The capital of France is", "Once upon a time", "1, 2, 3,"]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = {}
    for tp in (1, 2):
        with LLMEngine.from_pretrained(str(tmp_path / "w4-gated"), EngineConfig(
                tensor_parallel_size=tp, tp_reduce=reduce, max_num_seqs=4, num_blocks=128)) as engine:
            outs[tp] = [o.output_token_ids for o in engine.generate(prompts, greedy)]
    assert outs[2] == outs[1]
