"""The one place a request is checked: ``InputProcessor.process`` turns a prompt and its
``SamplingParams`` into the ``CoreRequest`` the engine core runs, or refuses it with
``InvalidRequest`` naming the field.

Every field is checked by type and range against its declaration in core/messages.py (msgspec
validates the whole struct in one call: a bool where a number belongs, NaN, a top_k beyond 64 bits,
an empty stop string are refused alike, whatever the field), then the prompt against the engine's
facts: token ids within the vocabulary, a prompt that leaves room in the context for ``max_tokens``
(None: as many as it leaves). Past this point nothing checks a request again: the core takes what
the processor made, and a request the wire could not carry never gets here.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from spear.errors import SpearError
from spear.serve.core.messages import SEED_MAX, SEED_MIN, CoreFacts, CoreRequest, SamplingParams


class InvalidRequest(SpearError):
    """A request that cannot run; ``param`` names the offending field (the HTTP server answers 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message, self.param = message, param


def encode_text(tokenizer, prompt: str) -> list[int]:
    """``prompt``'s token ids; a string that is not valid Unicode (a lone surrogate, which no
    tokenizer takes) is refused first."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequest(f"the prompt is not valid Unicode text ({exc.reason} at character {exc.start})",
                             "prompt") from None
    return tokenizer(prompt).input_ids


def _field(path: str) -> str | None:
    """'$.stop[0]' -> 'stop'."""
    name = path.removeprefix("$.").split("[")[0].split(".")[0]
    return name or None


def check_params(params: SamplingParams) -> SamplingParams:
    """``params`` with every field checked against its declared type and range (a copy: a single
    stop string becomes a one-element tuple); InvalidRequest naming the first bad field."""
    if not isinstance(params, SamplingParams):
        raise InvalidRequest(f"params must be SamplingParams, got {type(params).__name__}")
    fields = msgspec.structs.asdict(params)
    if isinstance(fields["stop"], str):
        fields["stop"] = (fields["stop"],)
    try:
        checked = msgspec.convert(fields, SamplingParams)
    except msgspec.ValidationError as exc:
        text = str(exc)
        reason, _, path = text.rpartition(" - at `")
        name = _field(path.rstrip("`")) if reason else None
        value = fields.get(name) if name else None
        raise InvalidRequest(f"{name}: {(reason or text)[0].lower()}{(reason or text)[1:]}, got {value!r}"
                             if name else f"sampling parameters: {text}", name) from None
    if checked.seed is not None and checked.seed > SEED_MAX:
        raise InvalidRequest(f"seed must be a whole number in [{SEED_MIN}, {SEED_MAX}], got {checked.seed}", "seed")
    for s in checked.stop:
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequest(f"stop string {s[:40]!r} is not valid Unicode text", "stop") from None
    return checked


class InputProcessor:
    """Checks requests against one engine's facts (``CoreFacts``: its context and vocabulary)."""

    def __init__(self, facts: CoreFacts):
        self.max_model_len, self.vocab_size = facts.max_model_len, facts.vocab_size
        self._ids = list[Annotated[int, msgspec.Meta(ge=0, lt=facts.vocab_size)]]

    def process(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                arrival_time: float) -> CoreRequest:
        """The request as the core runs it; InvalidRequest (a SpearError) when it cannot run."""
        params = check_params(params)
        try:
            ids = msgspec.convert(prompt_token_ids, self._ids)
        except msgspec.ValidationError:
            raise InvalidRequest(f"prompt token ids must be whole numbers in [0, {self.vocab_size})",
                                 "prompt") from None
        n, limit = len(ids), self.max_model_len
        if n == 0:
            raise InvalidRequest("the prompt is empty", "prompt")
        if n >= limit:
            raise InvalidRequest(f"the prompt has {n} tokens; this model's context is {limit} tokens and one must "
                                 "be left for the output", "prompt")
        if params.max_tokens is None:
            params = msgspec.structs.replace(params, max_tokens=limit - n)
        elif n + params.max_tokens > limit:
            raise InvalidRequest(f"max_tokens ({params.max_tokens}) plus the prompt ({n} tokens) exceeds the context "
                                 f"of {limit} tokens; at most {limit - n} tokens can be generated", "max_tokens")
        return CoreRequest(request_id, ids, params, arrival_time)
