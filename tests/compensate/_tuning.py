"""Shared pieces of the zero-memory tuning tests (test_tune_scales.py, test_tune_norms.py)."""

import spear.compensate.calibrate as calibrate_mod
from spear.cli import main


def fail_kl_on_call(monkeypatch, n: int) -> list:
    """Make the n-th KL evaluation raise RuntimeError("boom"); returns the list of calls so far."""
    real, calls = calibrate_mod.kl_loss, []

    def failing(*a, **k):
        calls.append(1)
        if len(calls) == n:
            raise RuntimeError("boom")
        return real(*a, **k)

    monkeypatch.setattr(calibrate_mod, "kl_loss", failing)
    return calls


def cli_calibrate(model_path, out, *flags) -> int:
    """``spear calibrate`` on the tiny model: W3, no ECs, four short steps, plus ``flags``."""
    return main(["-q", "calibrate", "--model", str(model_path), "--out", str(out), "--bits", "3", "--rank", "0",
                 "--steps", "4", "--samples", "4", "--val-samples", "2", "--sample-len", "16", *flags])


def cli_refuses_blockwise(model_path, out, flag, capsys) -> None:
    rc = main(["-q", "calibrate", "--model", str(model_path), "--out", str(out), "--rank", "1", "--blockwise", flag])
    assert rc == 2 and flag in capsys.readouterr().err
