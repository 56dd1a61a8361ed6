"""Token ids to text as they arrive, with stop strings.

Decoding one token at a time is wrong for byte-level BPE (a character may span
tokens) and for SentencePiece (the leading space depends on the previous token).
So each new token is decoded together with a few tokens before it and only the
text beyond their decoding is new; text ending in an incomplete character (U+FFFD)
waits for the next token. A few prompt tokens seed the context so the first output
token gets its spacing right.

Stop strings: the output ends just before the first occurrence of any of them.
While streaming, only the longest end of the text that begins some stop string is held
back, since the next token may complete it; everything before it is released at once (a
1,024-character stop string used to hold back 1,023 characters, the whole of a short answer,
whatever the text). Each stop string is followed by a Knuth-Morris-Pratt matcher over the
text as it grows: how much of the stop string the text ends with, O(1) amortized per
character however long the stop string (``StopMatcher``).

Fast tokenizers (a ``tokenizers.Tokenizer`` behind them) step a ``DecodeStream`` of the
tokenizers library, which runs the same prefix/read-offset scheme in Rust: one call per token
instead of two full ``decode`` calls through transformers (0.8 against 6.9 µs per token for
the default model's tokenizer on a 2-core x86-64 CPU; at 64 sequences that is most of an
engine step's host time, see benchmarks/bench_engine_host.py). Other tokenizers take the
same scheme in Python.
"""

from __future__ import annotations

try:
    from tokenizers import Tokenizer as _RustTokenizer
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers without DecodeStream: the Python scheme only
    _RustTokenizer = DecodeStream = None

_PROMPT_CONTEXT = 5


class StopMatcher:
    """Where a growing text first contains one of ``stops``, and how many characters at its end
    could still begin one: for each stop string, the length of its longest prefix the text ends
    with (its matcher's state), kept across ``feed`` calls."""

    def __init__(self, stops: tuple[str, ...]):
        if any(not s for s in stops):
            raise ValueError("a stop string must not be empty")
        self.stops = stops
        self._fail = [_prefix_function(s) for s in stops]
        self._state = [0] * len(stops)

    def feed(self, text: str, start: int) -> int | None:
        """Read ``text[start:]``, the characters appended since the last call; the index in ``text``
        where the earliest stop string now begins, or None."""
        best = None
        for i, (stop, fail) in enumerate(zip(self.stops, self._fail)):
            k, n = self._state[i], len(stop)
            for j in range(start, len(text)):
                c = text[j]
                while k and stop[k] != c:
                    k = fail[k - 1]
                if stop[k] == c:
                    k += 1
                if k == n:
                    best = j - n + 1 if best is None else min(best, j - n + 1)
                    k = fail[k - 1]
                    break
            self._state[i] = k
        return best

    @property
    def hold(self) -> int:
        """Characters at the text's end that begin some stop string (all of them shorter than it)."""
        return max(self._state, default=0)


def _prefix_function(s: str) -> list[int]:
    """pi[i]: the longest proper prefix of ``s[:i + 1]`` that is also its suffix."""
    pi = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = pi[k - 1]
        if s[i] == s[k]:
            k += 1
        pi[i] = k
    return pi


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: tuple[str, ...] = (), stream: bool = True):
        """``stream=False`` forces the Python scheme (the reference for the Rust stream)."""
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self.prefix_offset, self.read_offset = 0, len(self.ids)
        self.stop = stop
        self._matcher = StopMatcher(stop) if stop else None
        self.text = ""
        self.emitted = 0
        self.stopped = False
        self._backend, self._stream = self._rust_stream() if stream else (None, None)

    def _rust_stream(self):
        """(the Rust tokenizer, a DecodeStream seeded with the prompt context), or (None, None)
        where the Python scheme must run."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if DecodeStream is None or not isinstance(backend, _RustTokenizer):
            return None, None
        if self._decode(self.ids).endswith("\ufffd"):
            # a prompt ending inside a character: the stream would hand that character's
            # replacement out as output, the Python scheme does not
            return None, None
        try:
            return backend, DecodeStream(ids=list(self.ids), skip_special_tokens=True)
        except TypeError:  # a tokenizers release whose DecodeStream takes no prompt ids
            return None, None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> bool:
        """Append one token's text; True when a stop string now ends the output (text cut before it)."""
        self.ids.append(token_id)
        if self._stream is None or self.stopped:
            return self._commit(force=False)
        chunk = self._stream.step(self._backend, token_id)  # None: an incomplete character so far
        if not chunk:
            return False
        return self._append(chunk)

    def _commit(self, force: bool) -> bool:
        if self.stopped:
            return True
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not force):
            return False
        return self._append(full[len(prefix):])

    def _append(self, new: str) -> bool:
        start = len(self.text)
        self.text += new
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        if self._matcher is not None:
            hit = self._matcher.feed(self.text, start)
            if hit is not None:  # the earliest match wins
                self.text = self.text[:hit]
                self.stopped = True
        return self.stopped

    @property
    def hold(self) -> int:
        """Characters at the text's end held back: those that could still begin a stop string."""
        return 0 if self._matcher is None or self.stopped else self._matcher.hold

    def delta(self, final: bool) -> str:
        """Text not yet handed out: all of it when ``final`` (an incomplete character included),
        else all but the held-back tail."""
        if final:
            self._commit(force=True)
        end = len(self.text) if final else max(self.emitted, len(self.text) - self.hold)
        out = self.text[self.emitted:end]
        self.emitted = end
        return out
