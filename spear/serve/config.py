"""The serving engine's settings, checked at construction."""

from __future__ import annotations

from dataclasses import dataclass

from spear.errors import SpearError

# EngineConfig.pdl: the levels of spear.kernels._common.set_pdl, and "auto" ("wait" on the decode
# graphs of up to PDL_AUTO_MAX_BATCH sequences on a Hopper-or-newer GPU, "off" elsewhere)
PDL_MODES = ("off", "wait", "trigger", "auto")
# "wait" against "off" on the H200 (BENCHMARKS.md, "Serving: decode", eighth run): faster for every
# variant at 1 and 8 sequences and within 0.3% at 32, but 2-4% slower at 64 with compensators
PDL_AUTO_MAX_BATCH = 32


@dataclass(slots=True)
class EngineConfig:
    max_num_seqs: int = 64               # sequences decoding together
    max_num_batched_tokens: int = 512    # token budget of one step (decodes + prefill chunks)
    max_model_len: int | None = None     # prompt + output; None: the model's context, capped by the cache
    block_size: int = 16                 # tokens per KV block
    num_blocks: int | None = None        # KV blocks; None: from kv_memory
    kv_memory: int | None = None         # bytes for the KV cache; None: 1 GiB on CPU, 85% of free GPU memory
    max_waiting: int = 256               # queued requests beyond the free slots; more raise QueueFull
    cuda_graphs: bool = True             # capture decode steps on CUDA (ignored on CPU)
    weight_layout: str = "kmajor"        # packed W4 layout on CUDA: "kmajor" (faster decode) or "nmajor"
    fuse_projections: bool = True        # on CUDA: q/k/v and gate/up as one GEMM each (spear.serve.fusion)
    # programmatic dependent launch of the decode kernels on CUDA (Hopper or newer): "off", "wait"
    # or "trigger" (spear.kernels._common.set_pdl), or "auto" (PDL_MODES). Process-wide: the runner
    # sets it for every kernel launched in this process. "wait" was faster at batch 1 on the H200
    # (BENCHMARKS.md, "Serving: decode", eighth run) but slower at 64 sequences with ECs; "auto"
    # (the default) takes it only where it was faster (eleventh run) and is "off" on the CPU
    pdl: str = "auto"
    # launch shapes of the W4 kernel on CUDA: the path of a JSON table (benchmarks/bench_gemv.py or
    # bench_kernels.py --tune write one) or a dict; None: the built-in table, chosen on an H200.
    # Process-wide, like pdl (spear.kernels.launch.use_table); checked here, applied by the runner
    launch_table: str | dict | None = None
    seed: int = 0                        # the generator of requests without a seed

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_waiting"):
            if getattr(self, name) < 1:
                raise SpearError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_model_len", "num_blocks", "kv_memory"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise SpearError(f"{name} must be >= 1 when given, got {v}")
        if self.pdl not in PDL_MODES:
            raise SpearError(f"pdl must be 'off', 'wait', 'trigger' or 'auto', got {self.pdl!r}")
        if self.launch_table is not None:
            from spear.kernels import launch

            try:
                self.launch_table = launch.read_table(self.launch_table)
            except ValueError as e:
                raise SpearError(f"launch_table: {e}") from None
        if self.weight_layout not in ("nmajor", "kmajor"):
            raise SpearError(f"weight_layout must be 'nmajor' or 'kmajor', got {self.weight_layout!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise SpearError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({self.max_num_seqs}): every running sequence decodes one token per step")


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

    def __post_init__(self):
        for name in ("max_body_bytes", "max_prompt_chars", "max_stop_chars", "max_stop_strings"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SpearError(f"{name} must be a whole number >= 1, got {v!r}")
        if not self.shutdown_timeout_s > 0:
            raise SpearError(f"shutdown_timeout_s must be > 0, got {self.shutdown_timeout_s!r}")
