"""The embedded default text: the Wikipedia sample shipped inside the ``gensim`` wheel.

``gensim/test/test_data/enwiki-...-shortened.bz2`` is real MediaWiki XML (206 pages).
It becomes plain text article by article with mwparserfromhell, the standard
wikitext parser, following the recipe the reference numbers were measured with:
skip redirects and pages with < 2000 characters of wikitext; remove top-level
templates and ``ref``/``gallery``/``math``/``table``/``references`` tags;
``strip_code(normalize=True, collapse=True)``; collapse 3+ newlines to 2; drop
image-caption lines (``thumb|``, ``left|``, ``right|``); write each article as
`` = Title = `` + blank line + text + blank line (the WikiText layout, so the same
article splitter serves both texts). Result: 103 articles, about 2.96 MB.
"""

from __future__ import annotations

import bz2
import importlib.util
import re
import xml.etree.ElementTree as ET
from pathlib import Path

from spear.errors import SpearError

_SAMPLE = "test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
_DROP_TAGS = {"ref", "gallery", "math", "table", "references"}
_CAPTION = re.compile(r"^(thumb|left|right)\|")
_MIN_WIKITEXT = 2000


def sample_path() -> Path:
    # Located without importing gensim (its import pulls scipy and is slow); only
    # the data file inside the wheel is used.
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise SpearError("the default text needs the PyPI package 'gensim' (it ships the Wikipedia sample)")
    path = Path(spec.submodule_search_locations[0]) / _SAMPLE
    if not path.is_file():
        raise SpearError(f"gensim is installed but its Wikipedia sample {path} is missing")
    return path


def _pages(path: Path):
    """Yield ``(title, wikitext, is_redirect)`` from a MediaWiki XML dump."""
    with bz2.open(path, "rb") as fh:
        for _, elem in ET.iterparse(fh, events=("end",)):
            if not elem.tag.endswith("}page"):
                continue
            ns = elem.tag[: -len("page")]
            title = elem.findtext(f"{ns}title") or ""
            text = elem.findtext(f"{ns}revision/{ns}text") or ""
            redirect = elem.find(f"{ns}redirect") is not None
            yield title, text, redirect
            elem.clear()


def clean_wikitext(wikitext: str) -> str:
    """Plain text of one article (markup stripped, headings and punctuation kept)."""
    import mwparserfromhell

    code = mwparserfromhell.parse(wikitext)
    for node in code.filter_templates(recursive=False):
        try:
            code.remove(node)
        except ValueError:  # already gone with an enclosing node
            pass
    for node in code.filter_tags(recursive=True):
        if str(node.tag).strip().lower() in _DROP_TAGS:
            try:
                code.remove(node)
            except ValueError:
                pass
    text = code.strip_code(normalize=True, collapse=True)
    lines = [ln for ln in text.split("\n") if not _CAPTION.match(ln.strip())]
    text = "\n".join(lines)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()


def wikipedia_articles(path: Path | None = None) -> list[tuple[str, str]]:
    """``[(title, plain text)]`` for the articles kept from the dump, in dump order."""
    out = []
    for title, wikitext, redirect in _pages(path or sample_path()):
        if redirect or wikitext.lstrip().lower().startswith("#redirect"):
            continue
        if len(wikitext) < _MIN_WIKITEXT:
            continue
        out.append((title, clean_wikitext(wikitext)))
    return out


def format_articles(articles: list[tuple[str, str]]) -> str:
    """WikiText layout: `` = Title = ``, blank line, text, blank line."""
    return "".join(f" = {title} = \n\n{text}\n\n" for title, text in articles)
