"""OpenAI-compatible request bodies, validated strictly.

Unknown fields and wrong types are errors (``extra="forbid"``, strict types: the
string "5" is not a number), so a typo never silently changes what runs. Fields
that OpenAI defines but this server does not implement are accepted only at their
neutral value (``n=1``, no logprobs, zero penalties) and otherwise refused with a
message that names them. ``top_k`` and ``ignore_eos`` are extensions (as in vLLM).
A body becomes ``SamplingParams``, which the input processor (frontend/processor.py)
checks against the engine with the prompt.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from spear.serve.config import ServerLimits
from spear.serve.core.messages import SEED_MAX, SEED_MIN, SamplingParams
from spear.serve.frontend.processor import InvalidRequest


def _valid_unicode(text: str) -> str:
    # JSON may carry a lone surrogate ("\\ud800"), which Python keeps in a str but no tokenizer,
    # UTF-8 encoder or JSON response can take
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"the text holds an unpaired surrogate (U+{ord(exc.object[exc.start]):04X} at character "
                         f"{exc.start}), which is not valid Unicode") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: Text
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)  # -1 or 0: no top-k cut
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: Text | None = None
    ignore_eos: bool = False

    def _check_unsupported(self) -> None:
        if self.n != 1:
            raise InvalidRequest("only n=1 is supported", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0:
                raise InvalidRequest(f"{name} is not supported (only 0)", name)
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options is only allowed with stream=true", "stream_options")

    def sampling_params(self, max_tokens: int | None, limits: ServerLimits = ServerLimits()) -> SamplingParams:
        """The body's sampling fields (``max_tokens`` None: as many as the context leaves)."""
        self._check_unsupported()
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > limits.max_stop_strings or any(not s for s in stop):
            raise InvalidRequest(f"stop takes up to {limits.max_stop_strings} non-empty strings", "stop")
        if any(len(s) > limits.max_stop_chars for s in stop):
            raise InvalidRequest(f"each stop string may hold at most {limits.max_stop_chars} characters", "stop")
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=max(self.top_k, 0), seed=self.seed, stop=tuple(stop), ignore_eos=self.ignore_eos)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    prompt: Text | list[int] | list[Text] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    logprobs: int | None = None
    suffix: Text | None = None
    best_of: int | None = None

    def single_prompt(self) -> str | list[int]:
        """The one prompt of the request (a list of prompts must hold exactly one)."""
        if self.echo:
            raise InvalidRequest("echo is not supported", "echo")
        if self.logprobs is not None:
            raise InvalidRequest("logprobs are not supported", "logprobs")
        if self.suffix is not None:
            raise InvalidRequest("suffix is not supported", "suffix")
        if self.best_of not in (None, 1):
            raise InvalidRequest("only best_of=1 is supported", "best_of")
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise InvalidRequest("send one prompt per request (batched prompts are not supported)", "prompt")
            p = p[0]
        if len(p) == 0:
            raise InvalidRequest("the prompt is empty", "prompt")
        return p


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart]
    name: Text | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None

    def max_tokens_requested(self) -> int | None:
        if self.logprobs or self.top_logprobs is not None:
            raise InvalidRequest("logprobs are not supported", "logprobs")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise InvalidRequest("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat(self) -> list[dict]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]
