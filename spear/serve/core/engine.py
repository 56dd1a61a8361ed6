"""``LLMEngine``: requests in, tokens out, one scheduled step at a time.

    engine = LLMEngine.from_pretrained("smollm2-135m")
    outs = engine.generate(["The capital of France is"], SamplingParams(max_tokens=16, temperature=0))

``add_request`` queues a prompt, ``step`` runs the scheduler, the model and the
sampler once and returns a :class:`RequestOutput` (new tokens and text) for every
request that produced a token, ``abort`` drops a request and frees its KV blocks.
The engine is single-threaded; :mod:`spear.serve.frontend.async_engine` drives it from one
background thread for the HTTP server.

Failure isolation: a request is checked whole before anything of it is queued, and a
step that fails fails only the requests that cause it. When the model raises on a step,
its chunks run again in halves (recomputing a chunk rewrites the same K/V at the same
slots, so a retry is exact) until the chunks that fail on their own are found; a row of
non-finite logits fails its request alone. A failed request finishes with
``finish_reason == "error"`` and the message in ``RequestOutput.error``.
"""

from __future__ import annotations

import itertools
import logging
import time
import weakref

import torch
from torch import nn

from spear.errors import SpearError
from spear.serve.core.block_manager import BlockManager
from spear.serve.model import loader
from spear.serve.config import EngineConfig
from spear.serve.frontend.detokenizer import IncrementalDetokenizer
from spear.serve.model.llama import check_supported
from spear.parallel.shard import TPRank
from spear.serve.core.outputs import EngineStats, RequestOutput, StepRecord
from spear.serve.core.sampling import make_generator, sample
from spear.serve.core.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from spear.serve.core.sequence import SamplingParams, Sequence, check_prompt

log = logging.getLogger(__name__)

class LLMEngine:
    """The engine over its own model of the checkpoint (spear/serve/model/llama.py).

    ``LLMEngine(model, tokenizer)`` takes a transformers causal LM in memory (with spear's
    QuantLinears and compensators where it has them) and reads its weights into the engine's
    model, on ``device`` and in ``dtype`` (default: the model's); ``from_pretrained`` reads a
    checkpoint from disk. ``load_report`` lists the quantized layers that run off the kernel
    path on CUDA, with the reason.

    With ``EngineConfig.tensor_parallel_size`` N > 1 (``from_pretrained`` only), this process is
    rank 0 and starts ranks 1..N-1 as worker processes (spear/serve/model/workers.py), each loading
    its share of the checkpoint; every rank, this one too, is built by spear/serve/model/rank.py;
    ``close()`` stops them."""

    def __init__(self, model: nn.Module, tokenizer, config: EngineConfig | None = None,
                 device: str | torch.device | None = None, dtype: torch.dtype | None = None,
                 detokenize: bool = True):
        if config is not None and config.tensor_parallel_size > 1:
            raise SpearError("a tensor-parallel engine loads each rank's share from disk: use "
                             "LLMEngine.from_pretrained(<folder>, config) or save the model first")
        check_supported(model.config)
        ref = model.get_input_embeddings().weight
        cfg, quantized, tensors = loader.from_module(model)
        self.detokenize = detokenize
        self._setup(cfg, quantized, tensors, getattr(model, "generation_config", None), tokenizer, config,
                    torch.device(device) if device is not None else ref.device, dtype or ref.dtype)

    @classmethod
    def from_pretrained(cls, model: str = "smollm2-135m", config: EngineConfig | None = None,
                        dtype: torch.dtype | None = None, device: str | None = None,
                        verify: bool = False, tokenizer=None, detokenize: bool = True) -> "LLMEngine":
        """Load the default model, an HF folder or a spear checkpoint; fp32 on CPU, fp16 on CUDA by default
        (``verify``: a checkpoint's tensors checked against their recorded digests; ``tokenizer``: use
        this one instead of the folder's; ``detokenize`` False: outputs carry token ids only, no
        text, and stop strings are left to the caller, as the HTTP server's engine core runs)."""
        from spear.models.checkpoint import load_folder_tokenizer
        from spear.models.loading import resolve_model_path
        config = config or EngineConfig()
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = dtype or (torch.float16 if device.type == "cuda" else torch.float32)
        path = resolve_model_path(model)
        self = cls.__new__(cls)
        self._close = None
        self.detokenize = detokenize
        tp = TPRank(0, config.tensor_parallel_size)
        try:
            if tp.size > 1:
                device = self._start_ranks(path, config, device, dtype, verify)
            cfg, quantized, tensors = loader.from_folder(path, verify)
            check_supported(cfg)
            self._setup(cfg, quantized, tensors, loader.generation_config(path),
                        tokenizer if tokenizer is not None else load_folder_tokenizer(path), config, device, dtype,
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

    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _setup(self, model_config, quantized, tensors, generation_config, tokenizer, config, device, dtype,
               source=None, tp: TPRank = TPRank()) -> None:
        from spear.serve.latency.deployment import deployment_of
        from spear.serve.latency.table import given_table
        from spear.serve.model.rank import alone, build_rank, max_model_len

        self.config = config = config or EngineConfig()
        pool = getattr(self, "_pool", None) if tp.size > 1 else None
        # before build_rank, which takes the tensors over
        self.deployment = deployment_of(model_config, quantized, tensors, source, device, dtype, config.kernels,
                                        config.block_size, config.cuda_graphs and device.type == "cuda", tp.size,
                                        config.tp_reduce)
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
            log.warning("%s runs off the W4 kernel path: %s", layer, reason)
        self.tokenizer = tokenizer
        self.block_manager = BlockManager(num_blocks, config.block_size)
        # a mixed step replayed as a graph costs its padded size: the chunks fill one
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_waiting, token_sizes=self.runner.mixed and tuple(self.runner.mixed.graphs))
        if pool is not None:
            pool.wait("that it is ready")
            self.runner.workers = pool
        self.eos_ids = loader.eos_token_ids(model_config, generation_config, tokenizer)
        self._seqs: dict[str, Sequence] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._generators: dict[str, torch.Generator | None] = {}
        self._ids = itertools.count()
        self.num_preemptions = 0
        self.num_failed_steps = 0  # steps in a row in which every request failed
        self.num_steps = 0
        self.last_step: StepRecord | None = None
        self._went_on_at: float | None = None  # the last step's end, while it left requests unfinished
        torch.manual_seed(config.seed)
        log.info("engine: %d KV blocks of %d tokens, max_model_len %d, %s %s", num_blocks, config.block_size,
                 self.max_model_len, device, dtype)
        if table is not None:
            self.scheduler.set_latency(table, config.itl_slo_ms, config.min_chunk_tokens, config.latency_correction)
        elif config.itl_slo_ms is not None:
            self.prepare_latency()

    def prepare_latency(self, progress: bool = False):
        """Give the scheduler a latency table if it has none: the one cached for this deployment, else
        one profiled now on a quick grid and cached (spear/serve/latency/profiler.py). Returns the table."""
        if self.scheduler.latency is None:
            from spear.serve.latency.profiler import table_for

            self.scheduler.set_latency(table_for(self, progress=progress), self.config.itl_slo_ms,
                                       self.config.min_chunk_tokens, self.config.latency_correction)
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

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as exc:  # a lone surrogate: no tokenizer takes it
                raise SpearError(f"the prompt is not valid Unicode text ({exc.reason} at character {exc.start})") \
                    from None
            return self.tokenizer(prompt).input_ids
        return list(prompt)

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise SpearError when the request cannot run (empty, too long, out-of-vocabulary ids)."""
        if not isinstance(params, SamplingParams):
            raise SpearError(f"params must be SamplingParams, got {type(params).__name__}")
        check_prompt(prompt_token_ids, params, self.max_model_len, self.model.config.vocab_size)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        """Queue a prompt (text or token ids). Raises SpearError for a bad request, QueueFull when full;
        either way nothing of the request stays in the engine."""
        params = params or SamplingParams()
        ids = self.tokenize(prompt)
        self.check_request(ids, params)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._seqs:
            raise SpearError(f"request id {rid!r} is already in use")
        # everything that can fail first; the scheduler (which may refuse with QueueFull) last
        seq = Sequence(rid, ids, params, arrival_time=arrival_time or time.monotonic())
        detok = IncrementalDetokenizer(self.tokenizer, ids, params.stop) if self.detokenize else None
        gen = make_generator(params.seed)
        self.scheduler.add(seq)
        self._seqs[rid], self._detok[rid], self._generators[rid] = seq, detok, gen
        return rid

    def abort(self, request_id: str) -> bool:
        """Drop a request and free its blocks; False when it is unknown or already finished."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return False
        self.scheduler.finish(seq, "abort")
        self._forget(request_id)
        return True

    def abort_all(self) -> list[str]:
        """Drop every request (the engine's last resort when a step failed outside any request)."""
        rids = list(self._seqs)
        for rid in rids:
            self.abort(rid)
        return rids

    def _forget(self, rid: str) -> None:
        self._seqs.pop(rid, None)
        self._detok.pop(rid, None)
        self._generators.pop(rid, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), self.block_manager.usage,
                           self.block_manager.num_free_blocks, self.num_preemptions, self.num_failed_steps,
                           self.num_steps, self.last_step, self.scheduler.itl_slo_ms,
                           dict(self.scheduler.correction.residual) if self.scheduler.correction else {})

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, sample; one output per request that got a token or failed."""
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
        now = time.monotonic()
        for seq, tok in zip(sampled, tokens):
            if tok is None:
                outputs.append(self._fail(seq, "the model produced non-finite logits for this request"))
                continue
            try:
                seq.append_token(tok)
                if seq.first_token_time is None:
                    seq.first_token_time = now
                seq.last_token_time = now
                reason = self._stop_reason(seq, tok)
                if reason is not None:
                    self.scheduler.finish(seq, reason)
                outputs.append(self._output(seq, [tok]))
            except Exception as exc:  # e.g. a tokenizer that cannot decode a sampled id: this request only
                log.exception("request %s failed after sampling", seq.request_id)
                if not seq.is_finished:
                    outputs.append(self._fail(seq, f"the request failed after sampling: {exc!r}"))
                continue
            if reason is not None:
                self._forget(seq.request_id)
        # the model raised on every chunk of the step (a broken device, not one request's rows)
        everyone_failed = bool(failed) and logits is None
        self.num_failed_steps = self.num_failed_steps + 1 if everyone_failed else 0
        self.num_steps += 1
        end = time.perf_counter()
        self.last_step = StepRecord(sched.num_tokens, len(sched.chunks), sched.is_decode_only,
                                    end - t0, self.num_steps, sched.num_decodes,
                                    sched.prefill_tokens, sched.decode_context, sched.chunk_budget,
                                    sched.predicted_ms, None if self._went_on_at is None else end - self._went_on_at)
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

    def _fail(self, seq: Sequence, message: str) -> RequestOutput:
        """Finish ``seq`` as failed, free everything it holds; its final output carries ``message``."""
        if not seq.is_finished:
            self.scheduler.finish(seq, "error")
        out = self._output(seq, [], final_text=False)
        out.error = message
        self._forget(seq.request_id)
        return out

    def _stop_reason(self, seq: Sequence, tok: int) -> str | None:
        p = seq.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_ids):
            return "stop"
        detok = self._detok[seq.request_id]
        if detok is not None and detok.add(tok):
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _output(self, seq: Sequence, new_ids: list[int], final_text: bool = True) -> RequestOutput:
        detok = self._detok[seq.request_id]
        if detok is None:  # token ids only
            return RequestOutput(seq.request_id, new_ids, "", seq.is_finished, seq.finish_reason,
                                 seq.num_prompt_tokens, seq.arrival_time, seq.first_token_time, seq.token_ids,
                                 seq.num_tokens, "", 0)
        new_text = detok.delta(final=seq.is_finished) if final_text else ""
        return RequestOutput(seq.request_id, new_ids, new_text, seq.is_finished, seq.finish_reason,
                             seq.num_prompt_tokens, seq.arrival_time, seq.first_token_time,
                             seq.token_ids, seq.num_tokens, detok.text, detok.emitted)

    # ------------------------------------------------------------------ offline
    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Run prompts to completion (continuously batched); the final output of each, in order.

        The engine must hold no other request: ``generate`` steps until its own prompts finish, and
        the outputs of requests queued with ``add_request`` would be consumed here, lost to their
        caller (a SpearError says so; drain those with ``step`` first, or ``abort`` them)."""
        if self.has_unfinished():
            raise SpearError(f"generate() needs an idle engine; it holds {len(self._seqs)} request(s) added with "
                             "add_request: step() until they finish, or abort() them, first")
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise SpearError(f"{len(prompts)} prompts but {len(plist)} sampling parameter sets")
        pending = list(zip(prompts, plist))
        for p, sp in pending:  # fail fast, before any work, on a request that cannot run
            self.check_request(self.tokenize(p), sp)
        rids: list[str] = []
        final: dict[str, RequestOutput] = {}
        while len(final) < len(pending):
            while len(rids) < len(pending) and len(self.scheduler.waiting) < self.config.max_waiting:
                rids.append(self.add_request(*pending[len(rids)]))
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [self._as_whole(final[r]) for r in rids]

    @staticmethod
    def _as_whole(out: RequestOutput) -> RequestOutput:
        out.new_token_ids, out.new_text = list(out.output_token_ids), out.text
        return out
