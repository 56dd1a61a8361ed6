"""Token ids to text as they arrive, with stop strings.

Decoding one token at a time is wrong for byte-level BPE (a character may span
tokens) and for SentencePiece (the leading space depends on the previous token).
So each new token is decoded together with a few tokens before it and only the
text beyond their decoding is new; text ending in an incomplete character (U+FFFD)
waits for the next token. A few prompt tokens seed the context so the first output
token gets its spacing right.

Stop strings: the output ends just before the first occurrence of any of them.
While streaming, the last ``len(longest stop) - 1`` characters are held back,
since they may be the start of a stop string that the next token completes.
"""

from __future__ import annotations

_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self.prefix_offset, self.read_offset = 0, len(self.ids)
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> bool:
        """Append one token's text; True when a stop string now ends the output (text cut before it)."""
        self.ids.append(token_id)
        return self._commit(force=False)

    def _commit(self, force: bool) -> bool:
        if self.stopped:
            return True
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not force):
            return False
        start = max(0, len(self.text) - self.hold)
        self.text += full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i != -1]
        if hits:  # the earliest match wins
            self.text = self.text[:min(hits)]
            self.stopped = True
        return self.stopped

    def delta(self, final: bool) -> str:
        """Text not yet handed out: all of it when ``final`` (an incomplete character included),
        else all but the held-back tail."""
        if final:
            self._commit(force=True)
        end = len(self.text) if final else max(self.emitted, len(self.text) - self.hold)
        out = self.text[self.emitted:end]
        self.emitted = end
        return out
