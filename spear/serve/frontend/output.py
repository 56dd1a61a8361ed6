"""The one place outputs are made: ``OutputProcessor.process`` turns one message of the core
(``CoreOutputs``: a step's new token ids of every request) into every request's ``RequestOutput``
in one pass: the tokens appended, the text detokenized (frontend/detokenizer.py), stop strings
applied (a request whose text reached one ends here, and the core is told to drop it), the
timings kept.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from spear.serve.core.messages import CoreOutput, CoreOutputs, CoreRequest
from spear.serve.frontend.detokenizer import IncrementalDetokenizer

log = logging.getLogger(__name__)


@dataclass(slots=True, kw_only=True)
class RequestOutput:
    """One request's progress after a step. ``output_token_ids`` and ``text`` (everything so far)
    are built on access from the request's token list and the detokenizer's text as they stood at
    that step (the list only grows by appends, the text is an immutable string), so a step costs
    O(1) per request however long the outputs are."""

    request_id: str
    new_token_ids: list[int]      # tokens of this step (all of them for generate())
    new_text: str                 # text of this step that is safe to show (stop strings held back)
    finished: bool
    finish_reason: str | None     # "stop" | "length" | "abort" | "error" once finished
    num_prompt_tokens: int
    arrival_time: float
    first_token_time: float | None
    error: str | None = None      # why the request failed (finish_reason "error")
    _output_ids: list[int] = field(repr=False)  # the request's output tokens (append-only)
    _num_output: int = field(repr=False)        # how many of them at this step
    _text: str = field(repr=False)              # the detokenizer's text at this step
    _text_end: int = field(repr=False)          # characters of it handed out

    @property
    def output_token_ids(self) -> list[int]:
        """Every output token so far."""
        return self._output_ids[:self._num_output]

    @property
    def text(self) -> str:
        """Every output character handed out so far."""
        return self._text[:self._text_end]

    @property
    def num_output_tokens(self) -> int:
        return self._num_output


class _State:
    """One request as the output processor follows it."""

    __slots__ = ("request_id", "num_prompt", "output_ids", "detok", "arrival", "first_token_time")

    def __init__(self, request: CoreRequest, tokenizer):
        self.request_id, self.num_prompt = request.request_id, len(request.prompt_token_ids)
        self.output_ids: list[int] = []
        self.detok = IncrementalDetokenizer(tokenizer, request.prompt_token_ids, request.params.stop)
        self.arrival = request.arrival_time
        self.first_token_time: float | None = None


class OutputProcessor:
    """The requests of one frontend, from ``add`` until their final output (or ``drop``)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._states: dict[str, _State] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def __len__(self) -> int:
        return len(self._states)

    def add(self, request: CoreRequest) -> None:
        self._states[request.request_id] = _State(request, self.tokenizer)

    def drop(self, request_id: str) -> bool:
        """Forget a request (aborted, refused); False when it was not followed."""
        return self._states.pop(request_id, None) is not None

    def process(self, outputs: CoreOutputs) -> tuple[list[RequestOutput], list[str]]:
        """(the RequestOutput of every followed request in ``outputs``, the ids of requests that
        ended here although the core still runs them: a stop string, a token the tokenizer cannot
        decode; the caller aborts those in the core)."""
        made, ended_here = [], []
        for out in outputs.outputs:
            state = self._states.get(out.request_id)
            if state is None:  # dropped here, or ended here on a stop string: the rest is not wanted
                continue
            result = self._advance(state, out, outputs.timestamp)
            made.append(result)
            if result.finished:
                del self._states[out.request_id]
                if out.finish_reason is None:
                    ended_here.append(out.request_id)
        return made, ended_here

    def fail(self, request_id: str, message: str) -> RequestOutput | None:
        """End a followed request as failed (``message`` in its output's ``error``); None if unknown."""
        state = self._states.pop(request_id, None)
        return None if state is None else self._output(state, [], "", "error", message)

    def _advance(self, state: _State, out: CoreOutput, now: float) -> RequestOutput:
        if out.error is not None:
            return self._output(state, [], "", "error", out.error)
        if state.first_token_time is None and out.new_token_ids:
            state.first_token_time = now
        reason, taken = out.finish_reason, out.new_token_ids
        try:
            for i, tok in enumerate(taken):
                state.output_ids.append(tok)
                if state.detok.add(tok):  # the text reached a stop string: the request ends at this token
                    reason, taken = "stop", taken[:i + 1]
                    break
            new_text = state.detok.delta(final=reason is not None)
        except Exception as exc:  # e.g. a tokenizer that cannot decode a sampled id: this request only
            log.exception("request %s failed after sampling", state.request_id)
            return self._output(state, [], "", "error", f"the request failed after sampling: {exc!r}")
        return self._output(state, taken, new_text, reason)

    @staticmethod
    def _output(state: _State, new_ids: list[int], new_text: str, reason: str | None,
                error: str | None = None) -> RequestOutput:
        return RequestOutput(request_id=state.request_id, new_token_ids=new_ids, new_text=new_text,
                             finished=reason is not None, finish_reason=reason, num_prompt_tokens=state.num_prompt,
                             arrival_time=state.arrival, first_token_time=state.first_token_time, error=error,
                             _output_ids=state.output_ids, _num_output=len(state.output_ids),
                             _text=state.detok.text, _text_end=state.detok.emitted)
