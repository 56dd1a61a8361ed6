"""A request's state inside the engine: its sampling parameters and its tokens.

Token accounting follows one rule for prompts, chunked prefill, decode and
recompute after preemption: a sequence holds ``token_ids`` (prompt then output)
and ``num_computed_tokens``, how many of them already have K/V in the cache. A
step computes the next ``n`` uncomputed tokens; when that reaches the end of
``token_ids`` the step's last logits give the next token. A decode is simply the
case ``n == 1``; a preempted sequence drops its cache and starts again from
``num_computed_tokens = 0`` with its output so far as part of the prompt.
"""

from __future__ import annotations

import enum
import itertools
import math
from dataclasses import dataclass, field

from spear.errors import SpearError


# The seeds a torch.Generator takes: manual_seed accepts [-2**63, 2**64 - 1] and raises on
# anything beyond (an OverflowError deep in the engine, once the request is already queued).
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
# Temperatures below this sample as greedy: logits / T overflows fp32 for T of order 1e-38, and a
# distribution that sharp is the argmax anyway (vLLM uses the same cut).
GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop. ``temperature`` below ``GREEDY_BELOW_TEMPERATURE``
    (0 included) is greedy decoding. Every field is checked here, so a request that was
    accepted can always be sampled."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0              # 0 = no top-k cut
    seed: int | None = None     # per-request generator; None = the engine's shared one
    stop: tuple[str, ...] = ()  # the output ends before the first occurrence of any of these
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop, self.stop_token_ids = tuple(self.stop), tuple(self.stop_token_ids)
        for name in ("max_tokens", "top_k"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise SpearError(f"{name} must be a whole number, got {v!r}")
        if self.max_tokens < 1:
            raise SpearError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) or not (
                math.isfinite(self.temperature) and self.temperature >= 0):
            raise SpearError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise SpearError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise SpearError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not SEED_MIN <= self.seed <= SEED_MAX):
            raise SpearError(f"seed must be a whole number in [-2**63, 2**64 - 1], got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise SpearError("stop strings must be non-empty strings")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise SpearError(f"stop_token_ids must be whole numbers >= 0, got {list(self.stop_token_ids)}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE


def check_prompt(prompt_token_ids: list[int], params: SamplingParams, max_model_len: int, vocab_size: int) -> None:
    """Raise SpearError when a request cannot run: an empty prompt, ids outside the vocabulary, or
    a prompt that with ``params.max_tokens`` does not fit the context."""
    n = len(prompt_token_ids)
    if n == 0:
        raise SpearError("the prompt is empty")
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size for t in prompt_token_ids):
        raise SpearError(f"prompt token ids must be whole numbers in [0, {vocab_size})")
    if n >= max_model_len:
        raise SpearError(f"the prompt has {n} tokens; the context is {max_model_len} tokens "
                         "and at least one must be left for the output")
    if n + params.max_tokens > max_model_len:
        raise SpearError(f"the prompt ({n} tokens) plus max_tokens ({params.max_tokens}) exceeds the context "
                         f"of {max_model_len} tokens; lower max_tokens to at most {max_model_len - n}")


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One request. ``block_table`` lists the KV blocks holding its tokens, in order."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0
    seq_id: int = field(default_factory=lambda: next(_ids))
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None   # "stop" | "length" | "abort"
    num_preemptions: int = 0
    # timing, filled by the engine (seconds, time.monotonic())
    first_token_time: float | None = None
    last_token_time: float | None = None

    def __post_init__(self):
        if not self.prompt_token_ids:
            raise SpearError("a request needs at least one prompt token")
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decode(self) -> bool:
        """Only the last sampled token lacks K/V: the step is a one-token decode."""
        return self.num_output_tokens > 0 and self.num_uncomputed_tokens == 1

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})")
