"""What the engine hands out: a request's progress after a step, a step's record, the engine's state."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestOutput:
    """One request's progress after a step. ``output_token_ids`` and ``text`` (everything so far)
    are built on access from the sequence's token list and the detokenizer's text as they stood
    at that step (the list only grows by appends, the text is an immutable string), so a step
    costs O(1) per request however long the outputs are."""

    request_id: str
    new_token_ids: list[int]      # tokens of this step (all of them for generate())
    new_text: str                 # text of this step that is safe to show (stop strings held back)
    finished: bool
    finish_reason: str | None     # "stop" | "length" | "abort" | "error" once finished
    num_prompt_tokens: int
    arrival_time: float
    first_token_time: float | None
    _token_ids: list[int] = field(repr=False)  # the sequence's prompt + output tokens (append-only)
    _num_tokens: int = field(repr=False)       # its length at this step
    _text: str = field(repr=False)             # the detokenizer's text at this step
    _text_end: int = field(repr=False)         # characters of it handed out
    error: str | None = None      # why the request failed (finish_reason "error")

    @property
    def output_token_ids(self) -> list[int]:
        """Every output token so far."""
        return self._token_ids[self.num_prompt_tokens:self._num_tokens]

    @property
    def text(self) -> str:
        """Every output character handed out so far."""
        return self._text[:self._text_end]

    @property
    def num_output_tokens(self) -> int:
        return self._num_tokens - self.num_prompt_tokens


@dataclass(frozen=True, slots=True)
class StepRecord:
    """What a step ran, the latency table's prediction for it, its wall time (schedule, model,
    sampling and outputs) and its interval: the time since the previous step's end when the engine
    went straight on (it left requests unfinished), else the wall time. The interval is what the
    decodes' next tokens waited for, the caller's work between steps included (admitting requests,
    streaming outputs); the latency target and its correction are on it."""

    num_tokens: int                      # scheduled tokens
    num_seqs: int                        # scheduled sequences
    decode_only: bool
    seconds: float                       # wall time
    index: int = 0                       # steps run so far, this one included
    num_decodes: int = 0
    prefill_tokens: int = 0
    decode_context: float = 0.0          # the decodes' mean context in tokens (0 without decodes)
    chunk_budget: int | None = None      # prefill tokens the latency target allowed (None: no target)
    predicted_ms: float | None = None    # None without a table or without decodes
    interval_s: float | None = None      # None: the wall time (the first step, or one after idling)

    @property
    def measured_ms(self) -> float:
        return 1e3 * self.seconds

    @property
    def interval_ms(self) -> float:
        return 1e3 * (self.seconds if self.interval_s is None else self.interval_s)


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float               # fraction of KV blocks in use
    num_free_blocks: int
    num_preemptions: int
    num_failed_steps: int = 0     # steps in a row in which every request failed (0 after a good one)
    num_steps: int = 0
    last_step: StepRecord | None = None
    itl_slo_ms: float | None = None
    # the latency table's online correction: kind of step -> running (measured / predicted - 1)
    latency_correction: dict[int, float] = field(default_factory=dict)
