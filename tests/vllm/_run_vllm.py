"""Greedy tokens (and their log-probabilities) of spear checkpoints served by vLLM through the
plugin, one JSON line per checkpoint.

    python tests/vllm/_run_vllm.py --dtype float32 --tp 1 --max-tokens 24 PROMPTS_JSON CKPT [CKPT ...]

A script of its own because vLLM starts its engine in spawned processes (which re-import the
main module) and keeps process-wide state between models; each call is one clean process.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--compile", action="store_true", help="vLLM's torch.compile path instead of eager")
    ap.add_argument("prompts")
    ap.add_argument("checkpoints", nargs="+")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's CPU default takes far more
    if args.tp > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        # vLLM binds each CPU rank to a NUMA node of its own; one node here, so the ranks share
        # it, each with its own cores (round-robin when there are more ranks than cores)
        cpus = sorted(os.sched_getaffinity(0))
        groups = [cpus[i::args.tp] or [cpus[i % len(cpus)]] for i in range(args.tp)]
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, g)) for g in groups)
    from vllm import LLM, SamplingParams

    prompts = json.loads(args.prompts)
    for ckpt in args.checkpoints:
        t0 = time.perf_counter()
        # no quantization argument: the checkpoint's config.json names the method (quant_method "spear")
        llm = LLM(model=ckpt, dtype=args.dtype, max_model_len=512, seed=0, tensor_parallel_size=args.tp,
                  enforce_eager=not args.compile)
        load_s = time.perf_counter() - t0
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens, logprobs=1))
        print(json.dumps({
            "checkpoint": ckpt, "load_s": round(load_s, 1),
            "prompt_token_ids": [list(o.prompt_token_ids) for o in outs],
            "token_ids": [list(o.outputs[0].token_ids) for o in outs],
            # the chosen token's log-probability at each step (from the raw logits)
            "logprobs": [[step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                         for o in outs]}), flush=True)
        del llm
        gc.collect()


if __name__ == "__main__":
    main()
