"""OpenAI-compatible request bodies, validated strictly.

Unknown fields and wrong types are errors (``extra="forbid"``, strict types: the
string "5" is not a number), so a typo never silently changes what runs. Fields
that OpenAI defines but this server does not implement are accepted only at their
neutral value (``n=1``, no logprobs, zero penalties, ``logit_bias`` empty or null,
``response_format`` text, ``store`` false, no ``tools``) and otherwise refused with a
message that names them; ``metadata``, ``user`` and ``parallel_tool_calls`` change
nothing and are accepted as sent. ``top_p`` 0 is greedy decoding, as OpenAI treats it.
``top_k`` and ``ignore_eos`` are extensions (as in vLLM).

A chat may carry the turns of a tool-using conversation: an assistant message whose
``tool_calls`` stand for its content (``content`` null) and ``tool`` messages with the
calls' results. They go to the model's chat template as transformers' templates take
them; whether the template can render them is frontend/chat.py's to say.

A body becomes ``SamplingParams``, which the input processor (frontend/processor.py)
checks against the engine with the prompt; its errors name ``SamplingParams``' fields,
which ``as_sent`` maps back to the fields the body used (``max_completion_tokens``,
``messages``).
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

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
    top_p: float = Field(1.0, ge=0, le=1)  # 0: greedy (OpenAI's reading; SamplingParams takes > 0)
    top_k: int = Field(0, ge=-1)  # -1 or 0: no top-k cut
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: Text | None = None
    logit_bias: dict[Text, float] | None = None
    ignore_eos: bool = False

    def _check_unsupported(self) -> None:
        if self.n != 1:
            raise InvalidRequest("only n=1 is supported", "n")
        if self.logit_bias:
            raise InvalidRequest("logit_bias is not supported (only {} or null): this server does not bias tokens",
                                 "logit_bias")
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
        greedy = self.top_p == 0  # the nucleus of the most likely token alone
        return SamplingParams(max_tokens=max_tokens, temperature=0.0 if greedy else self.temperature,
                              top_p=1.0 if greedy else self.top_p, top_k=max(self.top_k, 0), seed=self.seed,
                              stop=tuple(stop), ignore_eos=self.ignore_eos)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _renames(self) -> dict[str, str]:
        """The input processor's field names -> the body's fields that set them, where they differ."""
        return {}

    def as_sent(self, exc: InvalidRequest) -> InvalidRequest:
        """``exc`` (the input processor's, which names SamplingParams' fields) naming the field
        this body sent instead: a chat's ``max_completion_tokens`` is no ``max_tokens``. The
        message says a field's name where it names one; "the prompt" it says as a word, which
        holds of a chat's prompt too."""
        sent = self._renames().get(exc.param or "")
        if sent is None:
            return exc
        message = exc.message if exc.param == "prompt" else re.sub(rf"\b{re.escape(exc.param)}\b", sent, exc.message)
        return InvalidRequest(message, sent)


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


class FunctionCall(_Strict):
    name: Text
    arguments: Text  # JSON text, as the model wrote it


class ToolCall(_Strict):
    id: Text
    type: Literal["function"]
    function: FunctionCall

    def template_form(self) -> dict:
        """The call as transformers' chat templates take it: ``arguments`` an object where the text
        is a JSON object (templates write it with ``tojson``), else the text as sent."""
        try:
            args = json.loads(self.function.arguments)
            json.dumps(args, ensure_ascii=False).encode("utf-8")  # "\\ud800" decodes to a lone surrogate
        except (ValueError, RecursionError):  # UnicodeEncodeError is a ValueError
            args = None
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name,
                             "arguments": args if isinstance(args, dict) else self.function.arguments}}


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None  # None: an assistant message that only calls tools
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages
    tool_call_id: Text | None = None          # tool messages: the call they answer

    def text(self) -> str | None:
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def check(self, i: int) -> None:
        """What OpenAI requires of the message's role (pydantic checks each field alone)."""
        at, role = f"messages.{i}", self.role
        if self.content is None and not (role == "assistant" and self.tool_calls):
            who = "an assistant message without tool_calls" if role == "assistant" else f"a {role} message"
            raise InvalidRequest(f"{at}.content: content is required in {who}", f"{at}.content")
        if self.tool_calls is not None and role != "assistant":
            raise InvalidRequest(f"{at}.tool_calls: only an assistant message calls tools, not a {role} one",
                                 f"{at}.tool_calls")
        if role == "tool" and self.tool_call_id is None:
            raise InvalidRequest(f"{at}.tool_call_id: a tool message requires tool_call_id (the call it answers)",
                                 f"{at}.tool_call_id")
        if role != "tool" and self.tool_call_id is not None:
            raise InvalidRequest(f"{at}.tool_call_id: only a tool message answers a tool call, not a {role} one",
                                 f"{at}.tool_call_id")

    def template_form(self) -> dict:
        m = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            m["tool_calls"] = [c.template_form() for c in self.tool_calls]
        if self.tool_call_id is not None:
            m["tool_call_id"] = self.tool_call_id
        return m

    def chars(self) -> int:
        """Characters of every field the template renders, so that a chat of empty messages is not free."""
        calls = sum(len(c.id) + len(c.function.name) + len(c.function.arguments) for c in self.tool_calls or ())
        return len(self.text() or "") + len(self.role) + 1 + calls + len(self.tool_call_id or "")


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    store: bool = False
    metadata: dict[Text, Text] | None = None  # kept by OpenAI with stored completions; nothing to do here
    parallel_tool_calls: bool | None = None   # a setting of tool calls, which no request here makes
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None

    def max_tokens_requested(self) -> int | None:
        if self.logprobs:
            raise InvalidRequest("logprobs are not supported (only false)", "logprobs")
        if self.top_logprobs not in (None, 0):
            raise InvalidRequest("top_logprobs is not supported (only 0 or null): this server returns no logprobs",
                                 "top_logprobs")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise InvalidRequest("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
        self._check_chat_unsupported()
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def _check_chat_unsupported(self) -> None:
        if self.response_format is not None and self.response_format.type != "text":
            raise InvalidRequest(f"response_format {self.response_format.type} is not supported (only "
                                 '{"type": "text"}): this server does not constrain the output to JSON',
                                 "response_format")
        if self.store:
            raise InvalidRequest("store is not supported (only false): this server keeps no completions", "store")
        if self.tools:
            raise InvalidRequest("tools are not supported (only [] or null): this server returns the model's text "
                                 "and never parses tool calls out of it", "tools")
        if self.tool_choice not in (None, "none", "auto"):  # with no tools, "auto" calls none either
            raise InvalidRequest(f"tool_choice {self.tool_choice!r:.80} is not supported (only \"none\" or \"auto\"): "
                                 "tools are not", "tool_choice")

    def _renames(self) -> dict[str, str]:
        names = {"prompt": "messages"}  # the prompt is the messages under the chat template
        if self.max_completion_tokens is not None:
            names["max_tokens"] = "max_completion_tokens"
        return names

    def chat(self) -> list[dict]:
        """The messages as transformers' chat templates take them (a developer message is a system one)."""
        for i, m in enumerate(self.messages):
            m.check(i)
        return [m.template_form() for m in self.messages]

    def chars(self) -> int:
        return sum(m.chars() for m in self.messages)
