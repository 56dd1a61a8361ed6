"""Host time of a serving-engine decode step: what the engine spends around the model.

    python benchmarks/bench_engine_host.py                       # batches 1, 8, 32, 64; CPU
    python benchmarks/bench_engine_host.py --batches 64 --out results/engine-host

On a GPU the decode step's model part is one CUDA-graph replay; everything else in
``LLMEngine.step`` (scheduling, building the step's inputs, sampling, appending tokens, stop
checks, detokenizing, building the outputs) runs on the host between replays and adds to every
token's latency. This script measures that part on its own: a two-layer Llama of width 64 with
the default model's tokenizer and vocabulary (SmolLM2-135M, 49,152 tokens; real byte-level BPE
detokenization), so the model's forward is small, and it is timed and subtracted. Decode-only
steps at each batch size, greedy, 64 new tokens per sequence after distinct 128-token prompts
(text of the default corpus), median over the steps. Parts:

  schedule   Scheduler.schedule
  inputs     ModelRunner.execute minus the model's forward (the step's input tensors)
  forward    the model's forward (subtracted from the host total; forward hooks on the model)
  sample     token selection from the logits (on a GPU: the argmax kernel and the read-back),
             timed by calling the engine's sampler again on the step's logits right after the
             step (greedy rows draw nothing, so the call repeats the step's work exactly)
  finish     the rest of the step: scheduler bookkeeping, tokens appended, stop checks,
             incremental detokenization, the per-request outputs

Prints a Markdown table with date and machine; --out also writes results.json / table.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spear.serve import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from spear.serve.core.sampling import sample  # noqa: E402

PARTS = ("schedule", "inputs", "sample", "finish")


def tiny_model(vocab: int, max_len: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_len)
    return LlamaForCausalLM(cfg).eval()


class Timers:
    """Wall-clock timers on this engine instance (seconds accumulated per step): its scheduler's
    ``schedule`` and runner's ``execute`` wrapped on the instance, the model's forward through
    forward hooks; the runner's logits and the rows' sampling parameters are kept for
    :meth:`time_sample`. No package module is changed."""

    def __init__(self, eng: LLMEngine):
        self.cur = dict.fromkeys(("schedule", "execute", "forward", "sample"), 0.0)
        self.last: tuple[torch.Tensor, list] | None = None
        self._wrap(eng.core.scheduler, "schedule", "schedule")
        self._wrap(eng.core.runner, "execute", "execute", keep=True)
        model = eng.core.runner.model
        model.register_forward_pre_hook(lambda *_: setattr(self, "_t_forward", time.perf_counter()))
        model.register_forward_hook(lambda *_: self._add("forward", self._t_forward))

    def _add(self, key: str, t0: float) -> None:
        self.cur[key] += time.perf_counter() - t0

    def _wrap(self, obj, name: str, key: str, keep: bool = False) -> None:
        fn = getattr(obj, name)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                out = fn(*a, **k)
            finally:
                self._add(key, t0)
            if keep:  # execute(sched): the rows the engine samples next, in the sampled chunks' order
                self.last = (out, [c.seq.params for c in a[0].chunks if c.samples])
            return out

        setattr(obj, name, timed)

    def time_sample(self) -> None:
        """The sampler on the last step's logits (before the next step can overwrite a graph's
        output buffer); greedy rows use no generator, so ``None`` ones repeat the step's call."""
        logits, params = self.last
        t0 = time.perf_counter()
        sample(logits, params, [None] * len(params))
        if logits.is_cuda:
            torch.cuda.synchronize()
        self.cur["sample"] += time.perf_counter() - t0

    def reset(self) -> None:
        self.last = None
        for k in self.cur:
            self.cur[k] = 0.0


def measure(eng: LLMEngine, prompts: list[list[int]], batch: int, new_tokens: int) -> dict:
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    for p in prompts[:batch]:
        eng.add_request(p, params)
    timers = Timers(eng)
    rows = []
    while eng.has_unfinished():
        sched = eng.core.scheduler
        decode_only = not sched.waiting and len(sched.running) == batch and all(s.is_decode for s in sched.running)
        timers.reset()
        t0 = time.perf_counter()
        eng.step()
        total = time.perf_counter() - t0
        if decode_only:
            timers.time_sample()
            c = timers.cur
            rows.append(dict(total=total, forward=c["forward"], schedule=c["schedule"],
                             inputs=c["execute"] - c["forward"], sample=c["sample"],
                             finish=total - c["schedule"] - c["execute"] - c["sample"]))
    med = {k: statistics.median(r[k] for r in rows) * 1e6 for k in rows[0]}
    med["host"] = statistics.median((r["total"] - r["forward"]) for r in rows) * 1e6
    med["steps"] = len(rows)
    return med


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,8,32,64", help="comma-separated decode batch sizes (default: %(default)s)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per sequence (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per sequence (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: %(default)s)")
    p.add_argument("--out", type=Path, help="folder for results.json and table.md")
    args = p.parse_args(argv)
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        p.error(f"--batches must be comma-separated integers, got {args.batches!r}")
    if min(batches) < 1 or args.new_tokens < 2 or args.prompt_len < 1:
        p.error("batch sizes and --prompt-len must be >= 1, --new-tokens >= 2")
    torch.set_num_threads(args.threads)

    from spear.data import load_text
    from spear.models.loading import load_tokenizer

    tok = load_tokenizer("smollm2-135m")
    ids = tok(load_text().text[:200_000], add_special_tokens=False)["input_ids"]
    n = args.prompt_len
    if len(ids) < max(batches) * n:
        p.error(f"the default text gives {len(ids)} tokens; fewer than {max(batches)} prompts of {n}")
    prompts = [ids[i * n:(i + 1) * n] for i in range(max(batches))]
    max_len = n + args.new_tokens + 16
    model = tiny_model(len(tok), max_len)
    results = []
    for b in batches:
        eng = LLMEngine(model, tok, EngineConfig(max_num_seqs=b, max_num_batched_tokens=max(512, b), block_size=16,
                                                 num_blocks=b * (-(-max_len // 16)) + 8, max_model_len=max_len))
        r = measure(eng, prompts, b, args.new_tokens)
        r["batch"] = b
        results.append(r)
        print(f"batch {b:3d}: step {r['total']:8.0f} us  forward {r['forward']:8.0f} us  host {r['host']:7.0f} us "
              f"({r['host'] / b:6.1f} us per sequence)", flush=True)

    date = datetime.date.today().isoformat()
    machine = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch thread(s)"
    head = f"Engine host time per decode step, {date}, CPU ({machine}), torch {torch.__version__}"
    lines = [head, "", "| batch | step µs | model forward µs | host µs | host µs / sequence | "
             + " | ".join(f"{k} µs" for k in PARTS) + " |",
             "|---:|---:|---:|---:|---:|" + "---:|" * len(PARTS)]
    for r in results:
        lines.append(f"| {r['batch']} | {r['total']:.0f} | {r['forward']:.0f} | {r['host']:.0f} | "
                     f"{r['host'] / r['batch']:.1f} | " + " | ".join(f"{r[k]:.0f}" for k in PARTS) + " |")
    table = "\n".join(lines)
    print("\n" + table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(dict(date=date, machine=machine, results=results), indent=1))
        (args.out / "table.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
