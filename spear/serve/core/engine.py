"""``EngineCore``: requests of token ids in, token ids out, one scheduled step at a time.

    core = EngineCore.from_pretrained("smollm2-135m")
    core.add(CoreRequest("r1", [1, 2, 3], SamplingParams(max_tokens=4), time.monotonic()))
    while core.has_unfinished():
        outputs = core.step()          # [CoreOutput(request_id, new_token_ids, finish_reason, error)]

``add`` queues a request the input processor checked (frontend/processor.py), ``step`` runs the
scheduler, the model and the sampler once and returns the new token ids of every request that
got one or failed, ``abort`` drops requests and frees their KV blocks. A request ends here on an
EOS or stop token id ("stop"), on its length ("length") or on a failure ("error"); text, stop
strings and ``RequestOutput`` are the frontend's (frontend/output.py). The core is
single-threaded: ``LLMEngine`` steps it in the caller's thread, ``spear serve`` in a process of its
own (core/process.py).

Failure isolation: a step that fails fails only the requests that cause it. When the model raises
on a step, its chunks run again in halves (recomputing a chunk rewrites the same K/V at the same
slots, so a retry is exact) until the chunks that fail on their own are found; a row of non-finite
logits fails its request alone; a step that raises outside any request fails every request.
"""

from __future__ import annotations

import logging
import time
import weakref

import torch
from torch import nn

from spear.errors import SpearError
from spear.parallel.shard import TPRank
from spear.serve.config import EngineConfig
from spear.serve.core.block_manager import BlockManager
from spear.serve.core.messages import CoreFacts, CoreOutput, CoreRequest, EngineStats, LatencyFacts, StepRecord
from spear.serve.core.sampling import make_generator, sample
from spear.serve.core.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from spear.serve.core.sequence import Sequence
from spear.serve.model import loader
from spear.serve.model.llama import check_supported

log = logging.getLogger(__name__)


class EngineCore:
    """The engine over its own model of the checkpoint (spear/serve/model/llama.py).

    ``EngineCore(model)`` takes a transformers causal LM in memory (with spear's QuantLinears and
    compensators where it has them) and reads its weights into the engine's model, on ``device``
    and in ``dtype`` (default: the model's); ``from_pretrained`` reads a checkpoint from disk.
    A request ends on the end-of-sequence ids the model's configs name and those ``stop_on`` adds
    (a tokenizer's, which the frontend knows). ``load_report`` lists the quantized layers that run
    off the kernel path on CUDA.

    With ``EngineConfig.tensor_parallel_size`` N > 1 (``from_pretrained`` only), this process is
    rank 0 and starts ranks 1..N-1 as worker processes (spear/serve/model/workers.py), each loading
    its share of the checkpoint; every rank, this one too, is built by spear/serve/model/rank.py;
    ``close()`` stops them."""

    def __init__(self, model: nn.Module, config: EngineConfig | None = None,
                 device: str | torch.device | None = None, dtype: torch.dtype | None = None):
        if config is not None and config.tensor_parallel_size > 1:
            raise SpearError("a tensor-parallel engine loads each rank's share from disk: use "
                             "LLMEngine.from_pretrained(<folder>, config) or save the model first")
        check_supported(model.config)
        ref = model.get_input_embeddings().weight
        cfg, quantized, tensors = loader.from_module(model)
        self._close = None
        self._setup(cfg, quantized, tensors, getattr(model, "generation_config", None), config,
                    torch.device(device) if device is not None else ref.device, dtype or ref.dtype)

    @classmethod
    def from_pretrained(cls, model: str = "smollm2-135m", config: EngineConfig | None = None,
                        dtype: torch.dtype | None = None, device: str | None = None,
                        verify: bool = False) -> "EngineCore":
        """Load the default model, an HF folder or a spear checkpoint; fp32 on CPU, fp16 on CUDA by
        default (``verify``: a checkpoint's tensors checked against their recorded digests)."""
        from spear.models.loading import resolve_model_path

        config = config or EngineConfig()
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = dtype or (torch.float16 if device.type == "cuda" else torch.float32)
        path = resolve_model_path(model)
        self = cls.__new__(cls)
        self._close = None
        tp = TPRank(0, config.tensor_parallel_size)
        try:
            if tp.size > 1:
                device = self._start_ranks(path, config, device, dtype, verify)
            cfg, quantized, tensors = loader.from_folder(path, verify)
            check_supported(cfg)
            self._setup(cfg, quantized, tensors, loader.generation_config(path), config, device, dtype,
                        source=path, tp=tp)
        except BaseException:
            self.close()
            raise
        return self

    def _start_ranks(self, path, config: EngineConfig, device: torch.device, dtype, verify: bool) -> torch.device:
        """Start ranks 1..N-1 and form the process group with them; this process's device (rank 0)."""
        from spear.serve.model import workers

        pool, device = workers.spawn_ranks(path, config, device, dtype, verify)
        self._pool = pool
        self._close = weakref.finalize(self, pool.shutdown)  # from here on, close() stops them
        pool.form_group(device, config.tp_timeout_s)
        return device

    def close(self) -> None:
        """Stop the other tensor-parallel ranks and leave the process group (nothing with one rank)."""
        if getattr(self, "_close", None) is not None:
            self._close()

    def __enter__(self) -> "EngineCore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _setup(self, model_config, quantized, tensors, generation_config, config, device, dtype,
               source=None, tp: TPRank = TPRank()) -> None:
        from spear.serve.latency.deployment import deployment_of
        from spear.serve.latency.table import given_table
        from spear.serve.model.rank import alone, build_rank, max_model_len

        self.config = config = config or EngineConfig()
        pool = getattr(self, "_pool", None) if tp.size > 1 else None
        # before build_rank, which takes the tensors over
        self.deployment = deployment_of(model_config, quantized, tensors, source, device, dtype, policy=config.kernels,
                                        block_size=config.block_size,
                                        cuda_graphs=config.cuda_graphs and device.type == "cuda",
                                        tensor_parallel=tp.size, tp_reduce=config.tp_reduce)
        table = given_table(config.latency_table, self.deployment)  # a wrong table fails before the weights load
        agree = alone(model_config, config)
        if pool is not None:
            def agree(blocks: int) -> tuple[int, int]:
                # every rank holds the same blocks: the fewest any rank can
                blocks = min([blocks] + pool.wait("its KV cache capacity"))
                decided = (blocks, max_model_len(model_config, config, blocks))
                pool.send(decided)
                return decided

        rank = build_rank(model_config, quantized, tensors, config, tp, device, dtype, agree)
        if rank.comm is not None:
            pool.comms.append(rank.comm)
        self.model, self.load_report, self.runner = rank.model, rank.load_report, rank.runner
        self.max_model_len, num_blocks = rank.max_model_len, rank.num_blocks
        for layer, reason in self.load_report:
            log.warning("%s runs off the kernel path: %s", layer, reason)
        if device.type == "cuda":  # which kernel each W4 layer class takes by token count (the planner's)
            for line in self.runner.kernel_report():
                log.info("%s", line)
        self.block_manager = BlockManager(num_blocks, config.block_size)
        # a mixed step replayed as a graph costs its padded size: the chunks fill one
        chunk, chunk_alone = config.prefill_chunks(device)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens, max_waiting=config.max_waiting,
                                   token_sizes=self.runner.mixed and tuple(self.runner.mixed.graphs),
                                   max_prefill_chunk=chunk, max_prefill_chunk_alone=chunk_alone,
                                   chunk_context=config.chunk_context(device, model_config),
                                   newcomers_first=config.first_steps_for_newcomers(device),
                                   interleave_decodes=config.decodes_interleaved(device))
        if pool is not None:
            pool.wait("that it is ready")
            self.runner.workers = pool
        self.eos_ids = loader.eos_token_ids(model_config, generation_config)
        self._seqs: dict[str, Sequence] = {}
        self._generators: dict[str, torch.Generator | None] = {}
        self.num_preemptions = 0
        self.num_failed_steps = 0  # steps in a row that failed every request they ran, or raised
        self.num_steps = 0
        self.last_step: StepRecord | None = None
        self.last_failure: str | None = None   # the message of the last failed request or step
        self.step_started: float | None = None  # time.monotonic() when the running step began
        self._went_on_at: float | None = None  # the last step's end, while it left requests unfinished
        torch.manual_seed(config.seed)
        log.info("engine: %d KV blocks of %d tokens, max_model_len %d, %s %s", num_blocks, config.block_size,
                 self.max_model_len, device, dtype)
        if table is not None:
            self._set_latency(table)
        elif config.itl_slo_ms is not None:
            self.prepare_latency()

    def _set_latency(self, table) -> None:
        cfg = self.config
        self.scheduler.set_latency(table, itl_slo_ms=cfg.itl_slo_ms, min_chunk_tokens=cfg.min_chunk_tokens,
                                   correct=cfg.latency_correction)

    def stop_on(self, eos_token_ids) -> None:
        """End requests on these ids too (a tokenizer's end of sequence, which the model's configs
        may not name)."""
        self.eos_ids |= set(eos_token_ids)

    def prepare_latency(self, progress: bool = False):
        """Give the scheduler a latency table if it has none: the one cached for this deployment, else
        one profiled now on a quick grid and cached (spear/serve/latency/profiler.py). Returns the table."""
        if self.scheduler.latency is None:
            from spear.serve.latency.profiler import table_for

            self._set_latency(table_for(self, progress=progress))
        return self.scheduler.latency

    def warmup(self) -> float:
        """Compile every kernel variant a step can meet (one prefill step per distinct kernel
        signature up to the token budget; the decode graphs are captured at construction), so that
        no request pays a compilation. Seconds taken; nothing to do off CUDA."""
        if self.runner.device.type != "cuda":
            return 0.0
        t0 = time.perf_counter()
        counts = self.runner.warmup_token_counts(self.config.max_num_batched_tokens)
        self.runner.warmup(counts)
        seconds = time.perf_counter() - t0
        log.info("warm-up: %d step shapes (%s tokens) in %.1f s", len(counts), counts, seconds)
        return seconds

    def facts(self) -> CoreFacts:
        """What requests are checked against, and what a server reports of the engine."""
        sched, latency = self.scheduler, None
        if sched.itl_slo_ms is not None:
            t = sched.latency
            latency = LatencyFacts(created=str(t.created), device=str(t.deployment.device), margin=t.margin)
        return CoreFacts(max_model_len=self.max_model_len, vocab_size=self.model.config.vocab_size,
                         eos_ids=sorted(int(i) for i in self.eos_ids), num_blocks=self.block_manager.num_blocks,
                         block_size=self.config.block_size, tensor_parallel_size=self.config.tensor_parallel_size,
                         load_report=[tuple(r) for r in self.load_report], itl_slo_ms=sched.itl_slo_ms,
                         min_chunk_tokens=self.config.min_chunk_tokens, latency=latency,
                         torch_threads=torch.get_num_threads())

    # ------------------------------------------------------------------ requests
    def add(self, request: CoreRequest) -> None:
        """Queue a checked request. Raises QueueFull when the queue is full, SpearError for an id in
        use; either way nothing of the request stays in the engine."""
        rid = request.request_id
        if rid in self._seqs:
            raise SpearError(f"request id {rid!r} is already in use")
        # everything that can fail first; the scheduler (which may refuse with QueueFull) last
        seq = Sequence(rid, request.prompt_token_ids, request.params, arrival_time=request.arrival_time)
        gen = make_generator(request.params.seed)
        self.scheduler.add(seq)
        self._seqs[rid], self._generators[rid] = seq, gen

    def abort(self, request_ids) -> list[str]:
        """Drop requests and free their blocks; the ids it knew (unknown or finished ones are skipped)."""
        dropped = []
        for rid in request_ids:
            seq = self._seqs.get(rid)
            if seq is not None:
                self.scheduler.finish(seq, "abort")
                self._forget(rid)
                dropped.append(rid)
        return dropped

    def abort_all(self) -> list[str]:
        """Drop every request (the engine's last resort when a step failed outside any request)."""
        return self.abort(list(self._seqs))

    def _forget(self, rid: str) -> None:
        self._seqs.pop(rid, None)
        self._generators.pop(rid, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        correction = self.scheduler.correction
        return EngineStats(num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
                           kv_usage=self.block_manager.usage, num_free_blocks=self.block_manager.num_free_blocks,
                           num_preemptions=self.num_preemptions, num_failed_steps=self.num_failed_steps,
                           num_steps=self.num_steps, last_step=self.last_step, itl_slo_ms=self.scheduler.itl_slo_ms,
                           latency_correction=dict(correction.residual) if correction else {})

    # ------------------------------------------------------------------ one step
    def step(self) -> list[CoreOutput]:
        """Schedule, run the model, sample: one output per request that got a token or failed. A step
        that raises outside any request (the engine isolates theirs) fails every request and counts
        as a failed step; the engine goes on."""
        self.step_started = time.monotonic()
        try:
            return self._step()
        except Exception as exc:
            log.exception("engine step failed; failing every request")
            self.num_failed_steps += 1
            self.last_failure = repr(exc)
            message = f"the engine step failed: {exc!r}"
            return [CoreOutput(rid, [], "error", message) for rid in self.abort_all()]
        finally:
            self.step_started = None

    def _step(self) -> list[CoreOutput]:
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        self.num_preemptions += len(sched.preempted)
        if not sched:
            return []
        sampled, logits, failed = self._execute(sched)
        self.scheduler.advance(sched)
        outputs = [self._fail(seq, f"the model failed on this request: {exc!r}") for seq, exc in failed]
        tokens = [] if logits is None else sample(
            logits, [s.params for s in sampled], [self._generators[s.request_id] for s in sampled])
        for seq, tok in zip(sampled, tokens):
            if tok is None:
                outputs.append(self._fail(seq, "the model produced non-finite logits for this request"))
                continue
            seq.append_token(tok)
            reason = self._stop_reason(seq, tok)
            if reason is not None:
                self.scheduler.finish(seq, reason)
                self._forget(seq.request_id)
            outputs.append(CoreOutput(seq.request_id, [tok], reason))
        # the model raised on every chunk of the step (a broken device, not one request's rows)
        everyone_failed = bool(failed) and logits is None
        self.num_failed_steps = self.num_failed_steps + 1 if everyone_failed else 0
        self.num_steps += 1
        end = time.perf_counter()
        self.last_step = StepRecord(
            num_tokens=sched.num_tokens, num_seqs=len(sched.chunks), decode_only=sched.is_decode_only,
            seconds=end - t0, index=self.num_steps, num_decodes=sched.num_decodes,
            prefill_tokens=sched.prefill_tokens, decode_context=sched.decode_context, chunk_budget=sched.chunk_budget,
            predicted_ms=sched.predicted_ms, interval_s=None if self._went_on_at is None else end - self._went_on_at)
        self._went_on_at = end if self.has_unfinished() else None
        self.scheduler.observe(sched, self.last_step.interval_ms)
        return outputs

    def _execute(self, sched: SchedulerOutput) -> tuple[list[Sequence], torch.Tensor | None,
                                                         list[tuple[Sequence, BaseException]]]:
        """(sequences that sample, their logits rows, (sequence, error) of chunks the model failed on)."""
        try:
            return [c.seq for c in sched.chunks if c.samples], self.runner.execute(sched), []
        except Exception as exc:
            if self.runner.workers is not None:
                # the other ranks may hold this step's collectives open: no retry in parts, every
                # chunk fails (the runner refuses later steps: ModelRunner.broken)
                log.error("tensor-parallel step of %d chunks failed: %r", len(sched.chunks), exc)
                return [], None, [(c.seq, exc) for c in sched.chunks]
            if len(sched.chunks) == 1:
                log.exception("engine step failed on request %s", sched.chunks[0].seq.request_id)
                return [], None, [(sched.chunks[0].seq, exc)]
            log.warning("engine step of %d chunks failed (%r); running them in parts to find the cause",
                        len(sched.chunks), exc)
        rows, failed = self._execute_parts(sched.chunks)
        if not rows:
            return [], None, failed
        return [seq for seq, _ in rows], torch.stack([r for _, r in rows]), failed

    def _execute_parts(self, chunks: list[ScheduledChunk]) -> tuple[list, list]:
        try:
            logits = self.runner.execute(SchedulerOutput(list(chunks)))
            # cloned: the decode graph's output is a buffer the next call overwrites
            return list(zip([c.seq for c in chunks if c.samples], logits.clone())), []
        except Exception as exc:
            if len(chunks) == 1:
                log.error("request %s fails the model step on its own: %r", chunks[0].seq.request_id, exc)
                return [], [(chunks[0].seq, exc)]
        mid = len(chunks) // 2
        rows_a, failed_a = self._execute_parts(chunks[:mid])
        rows_b, failed_b = self._execute_parts(chunks[mid:])
        return rows_a + rows_b, failed_a + failed_b

    def _fail(self, seq: Sequence, message: str) -> CoreOutput:
        """Finish ``seq`` as failed, free everything it holds; its output carries ``message``."""
        if not seq.is_finished:
            self.scheduler.finish(seq, "error")
        self._forget(seq.request_id)
        self.last_failure = message
        return CoreOutput(seq.request_id, [], "error", message)

    def _stop_reason(self, seq: Sequence, tok: int) -> str | None:
        p = seq.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_ids):
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None
