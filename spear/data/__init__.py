"""Text sources (Wikipedia sample, WikiText-2, text files) and calibration data."""

from spear.data.text import DEFAULT_TEXT, TextSource, TokenSplit, load_text, make_split

__all__ = ["DEFAULT_TEXT", "TextSource", "TokenSplit", "load_text", "make_split"]
