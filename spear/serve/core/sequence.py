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
from dataclasses import dataclass, field

from spear.errors import SpearError
from spear.serve.core.messages import SamplingParams


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
    finish_reason: str | None = None   # "stop" | "length" | "abort" | "error"
    num_preemptions: int = 0

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
