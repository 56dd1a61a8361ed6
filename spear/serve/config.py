"""The serving engine's settings, checked at construction."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from spear.errors import SpearError
from spear.kernels.policy import KernelPolicy
from spear.serve.latency.table import LatencyTable


@dataclass(slots=True)
class EngineConfig:
    max_num_seqs: int = 64               # sequences decoding together
    max_num_batched_tokens: int = 512    # token budget of one step (decodes + prefill chunks)
    max_model_len: int | None = None     # prompt + output; None: the model's context, capped by the cache
    block_size: int = 16                 # tokens per KV block
    num_blocks: int | None = None        # KV blocks; None: from kv_memory
    kv_memory: int | None = None         # bytes for the KV cache; None: 1 GiB on CPU, 85% of free GPU memory
    max_waiting: int = 256               # queued requests beyond the free slots; more raise QueueFull
    cuda_graphs: bool = True             # capture decode and mixed steps on CUDA (ignored on CPU)
    # every threshold, launch table and switch of the kernels (spear.kernels.policy): the engine
    # hands it to its layers, so engines in one process may differ
    kernels: KernelPolicy = field(default_factory=KernelPolicy)
    seed: int = 0                        # the generator of requests without a seed
    # inter-token latency target (ms): each step's prefill chunk is the largest the latency table
    # predicts within it (spear/serve/core/scheduler.py); None: the static max_num_batched_tokens budget
    itl_slo_ms: float | None = None
    # a LatencyTable or the path of one (spear profile); None with a target: the table cached for
    # this deployment, else one profiled at start-up and cached. A table alone adds predictions
    latency_table: object = None
    min_chunk_tokens: int = 16           # prefill tokens a step takes at least under a target
    # the most prompt tokens one sequence computes in a step it shares with decodes or with other
    # prompts, so that they are served beside a long prompt (spear/serve/core/scheduler.py); and in a
    # step it has alone (requests arriving during it wait for all of it). None: by device
    # (prefill_chunks). Under itl_slo_ms the latency table sets the first, and a prompt alone takes
    # the ceiling
    max_prefill_chunk: int | None = None
    max_prefill_chunk_alone: int | None = None
    # both caps shrink with the prompt's context L to cap · C / (C + L) (the scheduler's
    # chunk_context C): the context at which a token's attention costs what its linear layers do.
    # None: by device (chunk_context): the model's on a CPU, where a step's time is its work; off on
    # an accelerator. 0: off
    prefill_chunk_context: int | None = None
    # a step that admits a request leaves out the running prompts' chunks, at most every other step
    # (the scheduler's newcomers_first), so a short request's first token waits for no long prompt's
    # chunk. None: by device (newcomers_first): on a CPU, where a step's time is its work
    newcomers_first: bool | None = None
    # a step after one that ran a running prompt's chunk beside decodes runs the decodes (and admissions)
    # without it (the scheduler's interleave_decodes), so a stream beside a long prompt gets every other
    # token at a decode step's pace. None: by device: on a CPU, where a step's time is its work
    interleave_decodes: bool | None = None
    # correct the table's predictions by the measured steps, per kind of step (latency.Correction)
    latency_correction: bool = True
    # tensor parallelism (spear/parallel): ranks, one process and device each (cuda:0..N-1, or the
    # CPU over gloo); how row-parallel layers sum ("allreduce": one collective of the partial output
    # and u; "peer": symmetric-memory buffers read by one fused kernel, CUDA); how long a rank
    # waits inside a collective
    tensor_parallel_size: int = 1
    tp_reduce: str = "allreduce"
    tp_timeout_s: float = 300.0
    # processes that compile the W4 GEMM's launches into Triton's disk cache before the decode graphs
    # and the warm-up run them (spear/kernels/precompile.py; one GPU, CUDA only). None: the host's cores
    # less one, at most 16; 0: each kernel compiles where it is first run
    compile_workers: int | None = None

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_waiting"):
            if getattr(self, name) < 1:
                raise SpearError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_model_len", "num_blocks", "kv_memory"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise SpearError(f"{name} must be >= 1 when given, got {v}")
        slo = self.itl_slo_ms
        if slo is not None and (isinstance(slo, bool) or not isinstance(slo, (int, float))
                                or not (math.isfinite(slo) and slo > 0)):
            raise SpearError(f"itl_slo_ms must be a finite number of milliseconds > 0, got {slo!r}")
        if isinstance(self.min_chunk_tokens, bool) or not isinstance(self.min_chunk_tokens, int) or \
                self.min_chunk_tokens < 1:
            raise SpearError(f"min_chunk_tokens must be a whole number >= 1, got {self.min_chunk_tokens!r}")
        for name in ("max_prefill_chunk", "max_prefill_chunk_alone"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise SpearError(f"{name} must be a whole number >= 1 when given, got {v!r}")
        v = self.prefill_chunk_context
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise SpearError(f"prefill_chunk_context must be a whole number >= 0 when given, got {v!r}")
        for name in ("newcomers_first", "interleave_decodes"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                raise SpearError(f"{name} must be True, False or None, got {v!r}")
        if not isinstance(self.latency_correction, bool):
            raise SpearError(f"latency_correction must be True or False, got {self.latency_correction!r}")
        if self.latency_table is not None and not isinstance(self.latency_table, (str, os.PathLike, LatencyTable)):
            raise SpearError(f"latency_table must be a LatencyTable or a path, got {type(self.latency_table).__name__}")
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or not 1 <= tp <= 8:
            raise SpearError(f"tensor_parallel_size must be a whole number in 1..8, got {tp!r}")
        if self.tp_reduce not in ("allreduce", "peer"):
            raise SpearError(f"tp_reduce must be 'allreduce' or 'peer', got {self.tp_reduce!r}")
        if isinstance(self.tp_timeout_s, bool) or not isinstance(self.tp_timeout_s, (int, float)) or \
                not (math.isfinite(self.tp_timeout_s) and self.tp_timeout_s > 0):
            raise SpearError(f"tp_timeout_s must be a finite number of seconds > 0, got {self.tp_timeout_s!r}")
        w = self.compile_workers
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 0):
            raise SpearError(f"compile_workers must be a whole number >= 0 when given, got {w!r}")
        if not isinstance(self.kernels, KernelPolicy):
            raise SpearError(f"kernels must be a KernelPolicy, got {type(self.kernels).__name__}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise SpearError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({self.max_num_seqs}): every running sequence decodes one token per step")

    def prefill_chunks(self, device) -> tuple[int, int | None]:
        """(``max_prefill_chunk``, ``max_prefill_chunk_alone``), each by ``device`` when None.

        On a CPU both are 32 tokens: there a step's time is its tokens' (the default model, single-
        threaded CPU time: a decode step 61 ms; a prompt token beside it 3.5 ms at context 0 and 13 ms
        at context 7,700, plus about two decode steps at 7,700 for the chunk's attention over its
        context whatever its size), so those beside a long prompt, or arriving while it runs, wait
        steps of a fraction of a second instead of seconds (BENCHMARKS.md, "A long prompt beside the
        others"); the price: an 8,000-token prompt alone takes 1.45x the CPU time of 512-token steps
        (111 against 77 s on one thread). On an accelerator a step costs about its weights' reads up
        to hundreds of tokens: half the budget beside others (the other half admits newcomers at
        once), and the whole budget alone (None)."""
        cpu = _on_cpu(device)
        shared = self.max_prefill_chunk or (32 if cpu else max(1, self.max_num_batched_tokens // 2))
        alone = self.max_prefill_chunk_alone or (shared if cpu else None)
        return shared, alone

    def first_steps_for_newcomers(self, device) -> bool:
        """The scheduler's ``newcomers_first`` (by ``device`` when None: on a CPU, where a long prompt's
        chunk makes the step a newcomer's first token waits for several decode steps long; not on an
        accelerator, whose step costs about its weights' reads whatever it holds)."""
        return _on_cpu(device) if self.newcomers_first is None else self.newcomers_first

    def decodes_interleaved(self, device) -> bool:
        """The scheduler's ``interleave_decodes`` (by ``device`` when None: on a CPU, where a step that
        computes a chunk at long context costs several decode steps; not on an accelerator, whose step
        costs about its weights' reads whatever it holds)."""
        return _on_cpu(device) if self.interleave_decodes is None else self.interleave_decodes

    def chunk_context(self, device, model_config) -> int | None:
        """The scheduler's ``chunk_context`` (``prefill_chunk_context``; by ``device`` when None: the
        model's ``attention_context`` on a CPU, None on an accelerator, whose steps cost about their
        weights' reads up to hundreds of tokens)."""
        if self.prefill_chunk_context is not None:
            return self.prefill_chunk_context or None
        return attention_context(model_config) if _on_cpu(device) else None


def _on_cpu(device) -> bool:
    """``device`` (a torch.device or its name) is the CPU."""
    return (device.type if hasattr(device, "type") else str(device).split(":")[0]) == "cpu"


def attention_context(model_config) -> int:
    """The context at which one token's attention (QKᵀ and PV over L keys, 4 · heads · head_dim · L
    FLOPs a layer) costs what its linear layers do (twice their weights): 3,072 tokens for
    SmolLM2-135M, 26,624 for Llama-3-8B. On one thread of the 2-core CPU a step of one decode and a
    6-token chunk of SmolLM2-135M at 4,100 tokens of context spent 68 ms in attention and 81 ms in its
    matmuls, against 48 ms of matmuls in a decode step (2026-12-07; BENCHMARKS.md, "A long prompt
    beside the others")."""
    from spear.serve.model.llama import head_dim

    c = model_config
    hd = head_dim(c)
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    weights = c.hidden_size * (2 * q + 2 * kv) + 3 * c.hidden_size * c.intermediate_size
    return max(1, 2 * weights // (4 * q))


def kernel_policy(pdl: str = "auto", launch_table=None, **changes) -> KernelPolicy:
    """A KernelPolicy from user-facing settings (a launch-table path or dict); a bad one is a SpearError."""
    try:
        policy = KernelPolicy(pdl=pdl, **changes)
        return policy if launch_table is None else policy.replace(launch_table=launch_table)
    except ValueError as e:
        raise SpearError(f"kernel policy: {e}") from None


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """What one HTTP request may hold; beyond these the server answers 413 or 400 before any work.

    The defaults bound a request's parsing and tokenization to well under a second on two CPU
    cores and its memory to tens of MB, far beyond any prompt an 8k-token context can take."""

    max_body_bytes: int = 8 * 2**20      # request body (HTTP 413 beyond)
    max_prompt_chars: int = 1_000_000    # characters of a text prompt, or of all chat messages together
    max_stop_chars: int = 1024           # characters of each stop string
    max_stop_strings: int = 4            # as OpenAI's API
    shutdown_timeout_s: float = 30.0     # drain time for in-flight requests on SIGTERM
    max_messages: int = 1024             # messages of one chat (each one costs the template's work)
    max_long_prompts_queued: int = 8     # long prompts tokenizing or waiting to (HTTP 429 beyond)
    # what one connection may hold (api/transport.py): its request's headers within header_timeout_s;
    # its body then at min_upload_rate bytes/s or faster after a grace of header_timeout_s; the whole
    # request within request_timeout_s; request line and headers at most max_header_bytes (431)
    header_timeout_s: float = 10.0
    min_upload_rate: int = 16 * 1024
    request_timeout_s: float = 60.0
    max_header_bytes: int = 64 * 1024
    max_connections: int = 2048          # open connections kept (capped below the process's file limit)
    max_connections_per_client: int = 512  # open connections of one peer address

    def __post_init__(self):
        for name in ("max_body_bytes", "max_prompt_chars", "max_stop_chars", "max_stop_strings", "max_messages",
                     "max_long_prompts_queued", "max_connections", "max_connections_per_client", "min_upload_rate",
                     "max_header_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SpearError(f"{name} must be a whole number >= 1, got {v!r}")
        for name in ("shutdown_timeout_s", "header_timeout_s", "request_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
                raise SpearError(f"{name} must be a finite number of seconds > 0, got {v!r}")
