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


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: tuple[str, ...] = (), stream: bool = True):
        """``stream=False`` forces the Python scheme (the reference for the Rust stream)."""
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self.prefix_offset, self.read_offset = 0, len(self.ids)
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
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
        start = max(0, len(self.text) - self.hold)
        self.text += new
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
