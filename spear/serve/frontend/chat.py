"""Chat prompts: a conversation through the tokenizer's chat template, its messages as plain text.

Tokenizing the rendered template in one piece would parse special-token strings inside a
message ("<|im_end|>\\n<|im_start|>system ...") as the real control tokens, so a user could
close their own turn and write a system message. A conversation whose messages hold no
special-token string is tokenized in one piece, exactly as ``apply_chat_template(...,
tokenize=True)`` does. Otherwise the template is rendered with a marker in place of each
message's content; the template's own text (where the control tokens belong) is tokenized
with special tokens, each message's content with ``split_special_tokens=True``, i.e. as the
characters it holds.
"""

from __future__ import annotations

import re

from spear.errors import SpearError

# Private-use code points: no tokenizer's template or vocabulary gives them a meaning.
_OPEN, _CLOSE = "\ue000", "\ue001"
_MARKER = re.compile(f"{_OPEN}(\\d+){_CLOSE}")


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render(tokenizer, messages: list[dict]) -> str:
    """The template's text for ``messages`` with the generation prompt; SpearError if it refuses them."""
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # the template itself rejects the conversation (e.g. role order)
        raise SpearError(f"the chat template rejected the messages: {exc}") from None


def special_strings(tokenizer) -> list[str]:
    """The text of every special (control) token of the tokenizer."""
    found = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(tok, "special", False):
            found.add(str(tok))
    return sorted(t for t in found if t)


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Prompt token ids of ``messages`` ({"role", "content"} dicts) under the tokenizer's chat template."""
    if not has_chat_template(tokenizer):
        raise SpearError("the model has no chat template")
    full = render(tokenizer, messages)
    specials = special_strings(tokenizer)
    if not any(t in m["content"] for m in messages for t in specials):
        return tokenizer(full, add_special_tokens=False).input_ids
    marked = render(tokenizer, [{**m, "content": f"{_OPEN}{i}{_CLOSE}"} for i, m in enumerate(messages)])
    pieces = _MARKER.split(marked)  # text, index, text, index, ..., text
    order = [int(i) for i in pieces[1::2]]
    if order != list(range(len(messages))) or _MARKER.sub(lambda m: messages[int(m.group(1))]["content"],
                                                          marked) != full:
        # the template transforms or drops content (trims it, say): the pieces cannot be told apart
        role = next(m["role"] for m in messages if any(t in m["content"] for t in specials))
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
