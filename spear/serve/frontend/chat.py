"""Chat prompts: a conversation through the tokenizer's chat template, its messages as plain text.

Tokenizing the rendered template in one piece would parse special-token strings inside a
message ("<|im_end|>\\n<|im_start|>system ...") as the real control tokens, so a user could
close their own turn and write a system message. A conversation whose messages hold no
special-token string is tokenized in one piece, exactly as ``apply_chat_template(...,
tokenize=True)`` does. Otherwise the template is rendered with a marker in place of each
message's content; the template's own text (where the control tokens belong) is tokenized
with special tokens, each message's content with ``split_special_tokens=True``, i.e. as the
characters it holds. A tool call's fields (its name, arguments, id) and a tool message's
``tool_call_id`` have no marker: one holding a special-token string is refused.

Tool-using turns (an assistant message with ``tool_calls``, its ``content`` None or text, and
``tool`` messages with ``tool_call_id``) go to the template as transformers' templates take
them. A template that cannot render them is refused with that reason, never made to drop
them: one that raises on them (and not on the chat without them), or one that leaves a
call's name or a tool message's content out of its text.
"""

from __future__ import annotations

import re

from spear.errors import SpearError

# Private-use code points: no tokenizer's template or vocabulary gives them a meaning.
_OPEN, _CLOSE = "\ue000", "\ue001"
_MARKER = re.compile(f"{_OPEN}(\\d+){_CLOSE}")


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _render(tokenizer, messages: list[dict]) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def render(tokenizer, messages: list[dict]) -> str:
    """The template's text for ``messages`` with the generation prompt; SpearError if it refuses them."""
    try:
        return _render(tokenizer, messages)
    except Exception as exc:  # the template itself rejects the conversation (e.g. role order)
        raise SpearError(f"the chat template rejected the messages: {exc}") from None


def special_strings(tokenizer) -> list[str]:
    """The text of every special (control) token of the tokenizer."""
    found = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(tok, "special", False):
            found.add(str(tok))
    return sorted(t for t in found if t)


def _text(m: dict) -> str:
    return m.get("content") or ""


def _strings(value):
    """Every string inside ``value`` (dicts' keys and values, lists' items)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def _tool_turn(m: dict) -> bool:
    return m["role"] == "tool" or bool(m.get("tool_calls"))


def _what(m: dict, i: int) -> str:
    if m["role"] == "tool":
        return f"tool messages (messages.{i})"
    if m.get("content") is None:
        return f"an assistant message of content null that calls tools (messages.{i})"
    return f"tool calls (messages.{i})"


def _without_tools(messages: list[dict]) -> list[dict]:
    """The chat with its tool calls and tool messages left out (an assistant turn that only called
    tools, too)."""
    return [{k: v for k, v in m.items() if k != "tool_calls"} for m in messages
            if m["role"] != "tool" and m.get("content") is not None]


def _render_tools(tokenizer, messages: list[dict]) -> str:
    """``render``, where a chat with tool turns the template cannot take says so: the template
    raises on the chat, but renders it without its tool turns."""
    try:
        return _render(tokenizer, messages)
    except Exception as exc:
        first = next((i for i, m in enumerate(messages) if _tool_turn(m)), None)
        if first is not None:
            try:
                _render(tokenizer, _without_tools(messages))
            except Exception:
                pass  # it fails without them too: the tool turns are not what it refuses
            else:
                raise SpearError(f"the model's chat template cannot render {_what(messages[first], first)}: "
                                 f"{exc}") from None
        raise SpearError(f"the chat template rejected the messages: {exc}") from None


def _check_tools_rendered(tokenizer, messages: list[dict]) -> None:
    """Refuse a template that would drop a chat's tool calls or its tool messages' content: one
    render with a marker in place of each call's name and each tool message's content, every
    marker found in it."""
    marked, what = [], []

    def mark(description: str) -> str:
        what.append(description)
        return f"{_OPEN}{len(what) - 1}{_CLOSE}"

    for i, m in enumerate(messages):
        if m["role"] == "tool":
            m = {**m, "content": mark(f"tool messages: messages.{i}'s content")}
        if m.get("tool_calls"):
            m = {**m, "tool_calls": [{**c, "function": {**c["function"], "name": mark(f"tool calls: messages.{i}'s "
                                                                                       f"tool_calls.{k}")}}
                                     for k, c in enumerate(m["tool_calls"])]}
        marked.append(m)
    shown = {int(k) for k in _MARKER.findall(render(tokenizer, marked))}
    missing = next((k for k in range(len(what)) if k not in shown), None)
    if missing is not None:
        kind, _, which = what[missing].partition(": ")
        raise SpearError(f"the model's chat template does not render {kind}: {which} would be left out of the prompt")


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Prompt token ids of ``messages`` ({"role", "content"} dicts; an assistant's may carry
    ``tool_calls`` and content None, a tool message ``tool_call_id``) under the tokenizer's chat
    template."""
    if not has_chat_template(tokenizer):
        raise SpearError("the model has no chat template")
    full = _render_tools(tokenizer, messages)
    specials = special_strings(tokenizer)
    for i, m in enumerate(messages):
        fields = {k: v for k, v in m.items() if k not in ("role", "content")}
        if any(t in s for s in _strings(fields) for t in specials):
            raise SpearError(f"messages.{i}'s tool call fields hold a special-token string, which this server "
                             "cannot keep as text there")
    if any(_tool_turn(m) for m in messages):
        _check_tools_rendered(tokenizer, messages)
    if not any(t in _text(m) for m in messages for t in specials):
        return tokenizer(full, add_special_tokens=False).input_ids
    texts = [i for i, m in enumerate(messages) if isinstance(m.get("content"), str)]
    marked = render(tokenizer, [{**m, "content": f"{_OPEN}{i}{_CLOSE}"} if isinstance(m.get("content"), str) else m
                                for i, m in enumerate(messages)])
    pieces = _MARKER.split(marked)  # text, index, text, index, ..., text
    order = [int(i) for i in pieces[1::2]]
    if order != texts or _MARKER.sub(lambda m: messages[int(m.group(1))]["content"], marked) != full:
        # the template transforms or drops content (trims it, say): the pieces cannot be told apart
        role = next(m["role"] for m in messages if any(t in _text(m) for t in specials))
        raise SpearError(f"a {role} message holds a special-token string, which this model's chat template "
                         "cannot keep as text")
    ids: list[int] = []
    for j, piece in enumerate(pieces):
        if j % 2 == 0:
            if piece:
                ids += tokenizer(piece, add_special_tokens=False).input_ids
        else:
            content = messages[int(piece)]["content"]
            if content:
                ids += tokenizer(content, add_special_tokens=False, split_special_tokens=True).input_ids
    return ids
