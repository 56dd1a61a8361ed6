"""What `spear run`'s saved report says: how the text was split, and, for each calibrated row, the
held-out validation KL at the start beside the end and whether the start was kept."""

import json

import pytest

from spear.cli import main


def test_run_report_on_text_without_article_markers(sharp_tiny_llama_path, article_text, tmp_path, monkeypatch):
    """`spear run` on a file with one article per line and no blank lines, at near-minimal sizes
    (one 16-token window each, one training and one held-out self-sample, one step, rank 1; the
    self-samples are 8 tokens, not the allowed 2, with which the gated row's step also helps).

    The header's text_split says the text was split by window (the end evaluated, the start kept
    for calibration). Both SPEAR rows report the validation KL of their static start, checked
    against that KL computed here from the same self-samples and the QERA-approx start; the
    ungated row's one step improves on it ("trained", a lower end), while the gate's learning rate
    of 10 makes the gated row's step worse, so its start is kept and its end equals its start.

    Catches: `"initial_val_kl": report.best_val_kl` in run_job's row details (the start reads as
    the end), `"kept": "trained"` written for every row, or the header's text_split written as
    `split.text_name` (the file name without how it was split)."""
    from spear.compensate.calib_config import CalibrationConfig
    from spear.compensate.calibrate import val_kl
    from spear.compensate.workflow import attach_ecs, prepare_calibration, uniform_plan
    from spear.config import QuantConfig
    from spear.data.text import split_articles
    from spear.models.loading import load_model
    from spear.quant import quantize_model_rtn

    # one article per line, no blank lines and no headings: nothing to split by article
    lines = [" ".join(a.split()) for a in split_articles(article_text)[:3]]
    text = tmp_path / "one_per_line.txt"
    text.write_text("\n".join(lines) + "\n")
    out = tmp_path / "run"
    monkeypatch.setenv("SPEAR_CACHE", str(tmp_path / "cache"))  # self-samples of this run only
    assert main(["-q", "run", "--model", str(sharp_tiny_llama_path), "--text", str(text), "--seq-len", "16",
                 "--eval-windows", "1", "--calib-windows", "1", "--baselines", "none", "--spear", "both",
                 "--rank", "1", "--steps", "1", "--samples", "1", "--val-samples", "1", "--sample-len", "8",
                 "--calib-batch", "1", "--gate-lr", "10", "--no-tune-scales", "--no-tune-norms",
                 "--out", str(out)]) == 0  # the ECs alone: their start is checked against an independent one
    run = json.loads((out / "run.json").read_text())

    assert run["text"] == "one_per_line.txt (file)"
    assert run["text_split"] == ("one_per_line.txt (file): split by window (no article markers): "
                                 "eval the last 1 x 16 tokens, calibration the first 1 x 16")
    assert run["tokens_scored"] == 15
    # the step timing: every step the job ran, inside the total, which opens the header's line
    steps = run["step_seconds"]
    assert list(steps)[0] == "total"
    assert {"load", "perplexity", "self-samples + teacher", "quantization", "KL calibration"} <= set(steps)
    assert sum(s["wall"] for k, s in steps.items() if k != "total") <= steps["total"]["wall"]
    assert run["time"].startswith(f"{steps['total']['wall']:.0f} s ({steps['total']['cpu']:.0f} s CPU): load ")

    # the start, independently: the same self-samples and teacher, RTN W4, QERA-approx rank 1 everywhere
    model, tok = load_model(sharp_tiny_llama_path)
    cfg = CalibrationConfig(n_samples=1, val_samples=1, sample_len=8, batch_size=1, steps=1)
    data = prepare_calibration(model, tok, cfg, progress=False)
    mods = quantize_model_rtn(model, QuantConfig(), progress=False)
    attach_ecs(mods, data.fp_weights, uniform_plan(mods, 1), cfg, data.stats)
    start = val_kl(model, data.val_ids, data.val_teacher, cfg.batch_size)

    fp, w4, ec, gated = run["rows"]
    assert [ec["method"], gated["method"]] == ["SPEAR EC (KL, no gate) r1", "SPEAR gated EC r1"]
    assert "initial_val_kl" not in fp["details"] and "initial_val_kl" not in w4["details"]
    for row in (ec, gated):  # the gate starts as the identity: both rows start from the same state
        assert row["details"]["initial_val_kl"] == pytest.approx(start, rel=1e-5), row
    assert ec["details"]["kept"] == "trained"
    assert ec["details"]["val_kl"] < ec["details"]["initial_val_kl"]
    assert gated["details"]["kept"] == "init"
    assert gated["details"]["val_kl"] == gated["details"]["initial_val_kl"]

    md = (out / "run.md").read_text()
    assert f"- text_split: {run['text_split']}\n" in md
    for row in (ec, gated):
        d = row["details"]
        kept = " (start kept)" if row is gated else ""
        assert f"| {d['initial_val_kl']:.4f} → {d['val_kl']:.4f}{kept} |" in md
