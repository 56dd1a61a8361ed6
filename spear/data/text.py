"""Text sources and the calibration / evaluation split.

Every number spear reports names its text. A text is a list of articles: the
embedded Wikipedia sample (default), a local WikiText-2 (``wiki.test.raw`` or a
cached ``datasets`` copy) or any plain text file. Articles are found by WikiText's
top-level headings (`` = Title = ``); a file without them is split at blank lines.

The split is by article, so calibration and evaluation never share an article:
evaluation takes the trailing articles that hold the requested windows,
calibration the articles before them. Perplexity then scores the *last*
``eval_windows`` windows of the evaluation part and activation statistics use the
*first* ``calib_windows`` windows of the calibration part (SPEAR.md §4).

A file with neither headings nor blank lines (one document per line, say) has no
article boundaries to honour; it is split by window instead: evaluation takes the last
``eval_windows`` windows of its tokens and calibration the first ``calib_windows``,
which never overlap. The split says which rule it used.

Only what the windows come from is tokenized: a stretch at the start and one at the end
of the text, each a margin (1,024 tokens) longer than the windows it holds, so
tokenizing costs the memory of the windows whatever the text's length (tokenizing a
20 MB file whole held ~3.8 GB). The tokens next to a cut may differ from the whole
text's (a word cut in two); the margin keeps them out of every window, so the windows
are the whole text's tokens.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from spear.errors import SpearError

DEFAULT_TEXT = "wikipedia"
_HEADING = re.compile(r"^ = [^=].* = $", re.MULTILINE)
_SPACE = re.compile(r"\s")
# Tokens tokenized beyond the windows at a cut in the text, never used: tokenization near a cut
# can differ from the whole text's, over a word or so for the BPE tokenizers of causal LMs.
_CUT_MARGIN = 1024
_CHARS_PER_TOKEN = 6  # the first guess of a stretch's length (English BPE: ~4); doubled while short


@dataclass(frozen=True)
class TextSource:
    """A named text as a list of articles (each a string, heading included)."""

    name: str
    articles: tuple[str, ...]
    # False: the text had no article markers (headings, blank lines); split it by window
    by_article: bool = True

    @property
    def text(self) -> str:
        return "".join(self.articles)


@dataclass(frozen=True)
class TokenSplit:
    """Token windows for calibration and evaluation, drawn from disjoint articles."""

    text_name: str
    seq_len: int
    calib: torch.Tensor  # (n_calib, seq_len) int64
    eval: torch.Tensor  # (n_eval, seq_len) int64
    calib_articles: int
    eval_articles: int
    by_article: bool = True  # False: no article markers; calibration from the start, evaluation from the end

    @property
    def how(self) -> str:
        """How the text was split, for reports."""
        return "by article" if self.by_article else "by window (no article markers)"

    def describe(self) -> str:
        if not self.by_article:
            return (f"{self.text_name}: split by window (no article markers): eval the last {self.eval.shape[0]} x "
                    f"{self.seq_len} tokens, calibration the first {self.calib.shape[0]} x {self.seq_len}")
        return (
            f"{self.text_name}: eval {self.eval.shape[0]} x {self.seq_len} tokens "
            f"(last windows of {self.eval_articles} articles), calibration {self.calib.shape[0]} x "
            f"{self.seq_len} (first windows of {self.calib_articles} other articles)"
        )


def has_article_markers(text: str) -> bool:
    """Whether ``text`` has WikiText headings or blank lines between paragraphs."""
    return bool(_HEADING.search(text)) or bool(re.search(r"\n\s*\n", text.strip()))


def split_articles(text: str) -> tuple[str, ...]:
    """Split at WikiText top-level headings, else at blank lines."""
    starts = [m.start() for m in _HEADING.finditer(text)]
    if starts:
        if starts[0] != 0:
            starts.insert(0, 0)
        bounds = starts + [len(text)]
        parts = [text[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    else:
        parts = [p + "\n\n" for p in re.split(r"\n\s*\n", text)]
    return tuple(p for p in parts if p.strip())


def _atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _wikipedia() -> TextSource:
    from spear.data.wikipedia import format_articles, sample_path, wikipedia_articles
    from spear.models.loading import cache_dir

    sample = sample_path()
    key = hashlib.sha1(f"{sample}:{sample.stat().st_size}:v1".encode()).hexdigest()[:12]
    cached = cache_dir() / "text" / f"wikipedia-gensim-{key}.txt"
    if cached.is_file():
        text = cached.read_text(encoding="utf-8")
    else:
        text = format_articles(wikipedia_articles(sample))
        _atomic_write_text(cached, text)
    return TextSource("wikipedia (gensim sample, mwparserfromhell)", split_articles(text))


def _wikitext2_cached() -> TextSource:
    """WikiText-2 test split from a cached ``datasets`` copy (never downloads)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        import datasets
    except ImportError as exc:
        raise SpearError("--text wikitext2 needs the 'datasets' package and a cached copy; "
                         "or pass the path of a local wiki.test.raw") from exc
    try:
        ds = datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split="test")
    except Exception as exc:  # datasets raises many types when the cache is missing
        raise SpearError(f"no cached WikiText-2 found by datasets ({type(exc).__name__}); "
                         "pass the path of a local wiki.test.raw instead") from exc
    return TextSource("wikitext-2 test (datasets cache)", split_articles("".join(ds["text"])))


def load_text(spec: str | os.PathLike = DEFAULT_TEXT) -> TextSource:
    """``'wikipedia'`` (default), ``'wikitext2'`` (cached datasets) or a text file path."""
    name = str(spec)
    if name == DEFAULT_TEXT:
        return _wikipedia()
    if name == "wikitext2":
        return _wikitext2_cached()
    path = Path(name).expanduser()
    if not path.is_file():
        raise SpearError(f"text '{name}' is not 'wikipedia', 'wikitext2' or an existing file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise SpearError(f"text file {path} is not UTF-8 ({exc.reason} at byte {exc.start})") from exc
    if not text.strip():
        raise SpearError(f"text file {path} is empty")
    label = "wikitext-2 " + path.name if path.name.startswith("wiki.") else path.name
    if not has_article_markers(text):  # one stream of tokens, split by window as it is
        return TextSource(f"{label} (file)", (text,), by_article=False)
    return TextSource(f"{label} (file)", split_articles(text))


def _tokenize(tokenizer, text: str) -> torch.Tensor:
    # Tokenizer-level protocol: the raw text, no special tokens added.
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def _stretch(pieces: Sequence[str], chars: int, at_end: bool) -> tuple[str, bool]:
    """About ``chars`` characters from the start (or the end) of ``"".join(pieces)``, cut at a
    white space when one is near, and whether that is the whole text. Only the pieces the
    stretch reaches are joined."""
    taken, size = [], 0
    for piece in reversed(pieces) if at_end else pieces:
        taken.append(piece)
        size += len(piece)
        if size > chars:
            break
    else:
        return "".join(pieces), True
    if at_end:
        text = "".join(reversed(taken))
        space = _SPACE.search(text, len(text) - chars, len(text) - chars + 256)
        # from a white space: the first word keeps the space before it, as in the whole text
        return text[space.start() if space else len(text) - chars:], False
    text = "".join(taken)
    space = _SPACE.search(text, chars, chars + 256)
    return text[:space.start() if space else chars], False


def _edge_ids(tokenizer, pieces: Sequence[str], n: int, at_end: bool = False) -> tuple[torch.Tensor, bool]:
    """The tokens of the shortest stretch at the start (or ``at_end``) of ``"".join(pieces)`` that
    holds ``n`` tokens and ``_CUT_MARGIN`` more at the cut, and whether that stretch is the whole
    text. Either way its first (last) ``n`` tokens are the whole text's; when the whole text is
    shorter, they are all of its tokens."""
    chars = (n + _CUT_MARGIN) * _CHARS_PER_TOKEN
    while True:
        text, whole = _stretch(pieces, chars, at_end)
        ids = _tokenize(tokenizer, text)
        if whole or ids.numel() >= n + _CUT_MARGIN:
            return ids, whole
        chars *= 2


def make_split(source: TextSource, tokenizer, seq_len: int = 512, eval_windows: int = 24,
               calib_windows: int = 16) -> TokenSplit:
    """Cut ``source`` by article into evaluation (trailing) and calibration (leading) windows."""
    if seq_len < 2:
        raise SpearError(f"--seq-len must be at least 2, got {seq_len}")
    if eval_windows < 1:
        raise SpearError(f"--eval-windows must be at least 1, got {eval_windows}")
    if calib_windows < 0:
        raise SpearError(f"--calib-windows must be >= 0, got {calib_windows}")
    need = eval_windows * seq_len
    if not source.by_article:
        return _split_by_window(source, tokenizer, seq_len, eval_windows, calib_windows)
    articles = source.articles
    # Walk back from the end until the evaluation articles hold enough tokens; a margin of one
    # window absorbs tokenization differences at article joins. An article is counted only as far
    # as the walk needs: the one that completes it may be most of the text.
    n_eval, acc = 0, 0
    while n_eval < len(articles) and acc < need + seq_len:
        n_eval += 1
        acc += _edge_ids(tokenizer, (articles[-n_eval],), need + seq_len - acc)[0].numel()
    eval_ids, _ = _edge_ids(tokenizer, articles[-n_eval:], need, at_end=True)
    if eval_ids.numel() < need:
        raise SpearError(f"text '{source.name}' has {eval_ids.numel()} tokens; {eval_windows} "
                         f"evaluation windows of {seq_len} need {need}")
    calib_ids, _ = _edge_ids(tokenizer, articles[:-n_eval], calib_windows * seq_len)
    n_calib_avail = calib_ids.numel() // seq_len
    if n_calib_avail < calib_windows:
        raise SpearError(
            f"text '{source.name}' leaves {calib_ids.numel()} calibration tokens before its "
            f"{eval_windows} evaluation windows; {calib_windows} calibration windows of {seq_len} "
            f"need {calib_windows * seq_len} (use a longer text or fewer windows)"
        )
    return TokenSplit(
        text_name=source.name,
        seq_len=seq_len,
        calib=calib_ids[: calib_windows * seq_len].view(calib_windows, seq_len),
        eval=eval_ids[-need:].view(eval_windows, seq_len),
        calib_articles=len(articles) - n_eval,
        eval_articles=n_eval,
    )


def _split_by_window(source: TextSource, tokenizer, seq_len: int, eval_windows: int,
                     calib_windows: int) -> TokenSplit:
    """Evaluation from the end of the token stream, calibration from its start, never overlapping."""
    need_eval, need_calib = eval_windows * seq_len, calib_windows * seq_len
    # the start of the text, as far as both parts need: when it is not all of it, the text holds
    # more tokens than both parts and they cannot overlap
    ids, whole = _edge_ids(tokenizer, source.articles, need_eval + need_calib)
    if whole and ids.numel() < need_eval:
        raise SpearError(f"text '{source.name}' has {ids.numel()} tokens; {eval_windows} "
                         f"evaluation windows of {seq_len} need {need_eval}")
    if whole and ids.numel() < need_eval + need_calib:
        raise SpearError(
            f"text '{source.name}' (split by window: no article markers) leaves {ids.numel() - need_eval} "
            f"calibration tokens before its {eval_windows} evaluation windows; {calib_windows} calibration "
            f"windows of {seq_len} need {need_calib} (use a longer text or fewer windows)")
    tail = ids if whole else _edge_ids(tokenizer, source.articles, need_eval, at_end=True)[0]
    return TokenSplit(text_name=source.name, seq_len=seq_len,
                      calib=ids[:need_calib].view(calib_windows, seq_len),
                      eval=tail[tail.numel() - need_eval:].view(eval_windows, seq_len),
                      calib_articles=0, eval_articles=0, by_article=False)
