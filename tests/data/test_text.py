import pytest
import torch

from spear.data.text import load_text, make_split, split_articles
from spear.errors import SpearError


def test_split_articles_by_wikitext_headings():
    text = " = A = \n\nalpha text\n\n = = Sub = = \n\nmore\n = B = \n\nbeta\n"
    arts = split_articles(text)
    assert len(arts) == 2
    assert arts[0].startswith(" = A = ") and " = = Sub = = " in arts[0]
    assert arts[1].startswith(" = B = ")
    assert "".join(arts) == text


def test_split_articles_by_paragraphs_without_headings():
    assert len(split_articles("one\n\ntwo\n\n\nthree")) == 3


def test_wikipedia_sample_is_cleaned_into_articles():
    src = load_text("wikipedia")
    assert len(src.articles) == 103
    assert src.articles[0].startswith(" = Anarchism = \n\n")
    text = src.text
    assert 2_800_000 < len(text) < 3_100_000
    # Markup is stripped; a handful of remnants survive in malformed wikitext.
    for markup in ("{{", "[[", "<ref", "<math", "[http"):
        assert text.count(markup) < 15, markup
    assert not any(line.startswith(("thumb|", "left|", "right|")) for line in text.split("\n"))


def test_split_is_by_article_and_never_overlaps(tokenizer, article_text, tmp_path):
    path = tmp_path / "wiki.test.raw"
    path.write_text(article_text)
    src = load_text(path)
    assert src.name.startswith("wikitext-2 wiki.test.raw")
    sp = make_split(src, tokenizer, seq_len=256, eval_windows=3, calib_windows=2)
    assert sp.eval.shape == (3, 256) and sp.calib.shape == (2, 256)
    assert sp.calib_articles + sp.eval_articles == len(src.articles)
    # Evaluation windows are the tail of the evaluation articles' tokens.
    eval_ids = tokenizer("".join(src.articles[-sp.eval_articles:]), add_special_tokens=False)["input_ids"]
    assert sp.eval.reshape(-1).tolist() == eval_ids[-3 * 256:]
    calib_ids = tokenizer("".join(src.articles[:sp.calib_articles]), add_special_tokens=False)["input_ids"]
    assert sp.calib.reshape(-1).tolist() == calib_ids[: 2 * 256]


def test_split_errors(tokenizer, tmp_path):
    small = tmp_path / "small.txt"
    small.write_text(" = A = \n\nshort text.\n")
    with pytest.raises(SpearError, match="evaluation windows of 512 need"):
        make_split(load_text(small), tokenizer, 512, 24, 16)
    with pytest.raises(SpearError, match="is not 'wikipedia'"):
        load_text(tmp_path / "missing.txt")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(SpearError, match="empty"):
        load_text(empty)
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe\x00abc")
    with pytest.raises(SpearError, match="not UTF-8"):
        load_text(bad)


def test_calibration_shortfall_is_reported(tokenizer, article_text, tmp_path):
    path = tmp_path / "t.txt"
    path.write_text(article_text)
    with pytest.raises(SpearError, match="calibration windows"):
        make_split(load_text(path), tokenizer, seq_len=256, eval_windows=3, calib_windows=10_000)


def test_selfsample_is_seeded_cached_and_full_length(tiny_llama, tmp_path, monkeypatch):
    from spear.data.selfsample import SampleConfig, sample_sequences

    monkeypatch.setenv("SPEAR_CACHE", str(tmp_path))
    model, tok = tiny_llama
    cfg = SampleConfig(n=3, length=12, seed=7, batch_size=2)
    a = sample_sequences(model, tok, cfg, progress=False)
    assert a.shape == (3, 12) and a.dtype == torch.long
    assert (a[:, 0] == tok.bos_token_id).all()
    assert (a[:, 1:] != tok.eos_token_id).all()
    assert len(list((tmp_path / "selfsample").glob("*.safetensors"))) == 1
    b = sample_sequences(model, tok, cfg, cache=False, progress=False)
    assert torch.equal(a, b)
    c = sample_sequences(model, tok, SampleConfig(n=3, length=12, seed=8, batch_size=2), cache=False, progress=False)
    assert not torch.equal(a, c)


def test_text_without_article_markers_is_split_by_window(tokenizer, article_text, tmp_path):
    # one article per line and no blank lines: nothing to split by article
    lines = [" ".join(a.split()) for a in load_text("wikipedia").articles[:12]]
    path = tmp_path / "one_per_line.txt"
    path.write_text("\n".join(lines) + "\n")
    src = load_text(path)
    assert not src.by_article and len(src.articles) == 1
    sp = make_split(src, tokenizer, seq_len=256, eval_windows=4, calib_windows=3)
    assert not sp.by_article and sp.how == "by window (no article markers)"
    assert "split by window" in sp.describe()
    ids = tokenizer(path.read_text(), add_special_tokens=False)["input_ids"]
    assert sp.eval.reshape(-1).tolist() == ids[-4 * 256:]  # evaluation: the end of the text
    assert sp.calib.reshape(-1).tolist() == ids[: 3 * 256]  # calibration: its start
    assert len(ids) >= 7 * 256  # so the two never overlap
    # the same text with blank lines between the articles is still split by article
    marked = tmp_path / "marked.txt"
    marked.write_text("\n\n".join(lines) + "\n")
    assert load_text(marked).by_article and make_split(load_text(marked), tokenizer, 256, 4, 3).by_article


def test_window_split_refuses_overlap(tokenizer, tmp_path):
    path = tmp_path / "short.txt"
    path.write_text(" ".join(["word"] * 300))  # ~300 tokens, one line
    src = load_text(path)
    assert make_split(src, tokenizer, seq_len=64, eval_windows=2, calib_windows=2).calib.shape == (2, 64)
    with pytest.raises(SpearError, match=r"split by window.*calibration windows of 64 need"):
        make_split(src, tokenizer, seq_len=64, eval_windows=3, calib_windows=3)


class _CountingTokenizer:
    """The tokenizer, recording how many characters each call is given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.chars = tokenizer, []

    def __call__(self, text, **kwargs):
        self.chars.append(len(text))
        return self.tokenizer(text, **kwargs)


def _whole_text_windows(tokenizer, src, seq_len, eval_windows, calib_windows):
    """(calibration ids, evaluation ids) by the protocol's definition, from tokenizations of the
    whole text or of whole groups of articles."""
    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    need, need_calib = eval_windows * seq_len, calib_windows * seq_len
    if not src.by_article:
        whole = ids(src.text)
        return whole[:need_calib], whole[-need:]
    counts = [len(ids(a)) for a in src.articles]
    n_eval, acc = 0, 0
    while acc < need + seq_len:
        n_eval += 1
        acc += counts[-n_eval]
    return ids("".join(src.articles[:-n_eval]))[:need_calib], ids("".join(src.articles[-n_eval:]))[-need:]


@pytest.mark.parametrize("layout", ["articles", "one line per article"])
def test_windows_are_the_whole_texts_tokens_though_only_stretches_are_tokenized(tokenizer, article_text, tmp_path,
                                                                                layout):
    """On a text long enough that only a stretch at each end is tokenized, every window is token
    for token the whole text's. Catches: the whole text tokenized to cut a few windows out of it,
    and windows taken next to a cut, where tokens can differ from the whole text's."""
    path = tmp_path / "text.txt"
    if layout == "articles":
        path.write_text(article_text)
    else:
        path.write_text("\n".join(" ".join(a.split()) for a in load_text("wikipedia").articles[:12]) + "\n")
    src = load_text(path)
    counting = _CountingTokenizer(tokenizer)
    sp = make_split(src, counting, seq_len=128, eval_windows=4, calib_windows=3)
    assert max(counting.chars) < len(src.text) // 10, counting.chars
    calib, eval_ids = _whole_text_windows(tokenizer, src, 128, 4, 3)
    assert sp.eval.reshape(-1).tolist() == eval_ids
    assert sp.calib.reshape(-1).tolist() == calib


@pytest.mark.parametrize("separator", ["\n\n", " "], ids=["paragraphs", "one line"])
def test_a_20_mb_text_is_tokenized_only_where_the_windows_come_from(tokenizer, tmp_path, separator):
    """20 MB of text and the default protocol (24 + 16 windows of 512 tokens, ~200 kB of text):
    the tokenizer sees a bounded stretch at each end, not the file. Catches: the whole text (or
    its calibration part) tokenized at once, which held ~3.8 GB for a 20 MB file."""
    paragraph = " ".join(["the quick brown fox jumps over the lazy dog"] * 20)
    path = tmp_path / "big.txt"
    path.write_text(separator.join([paragraph] * (20_000_000 // len(paragraph))))
    src = load_text(path)
    assert src.by_article == (separator == "\n\n")
    counting = _CountingTokenizer(tokenizer)
    sp = make_split(src, counting, seq_len=512, eval_windows=24, calib_windows=16)
    assert sp.eval.shape == (24, 512) and sp.calib.shape == (16, 512)
    assert sum(counting.chars) < 1_000_000, f"{sum(counting.chars)} characters tokenized in {len(counting.chars)} calls"
    # the text repeats one paragraph: calibration starts where it does
    first = tokenizer(paragraph, add_special_tokens=False)["input_ids"]
    assert sp.calib[0, :len(first) - 1].tolist() == first[:-1]
