"""The ``spear`` command: help, one-line errors, and a real quantize -> eval round trip."""

import json
import subprocess
import sys

import pytest

from spear.cli import main


def _run(*argv):
    return subprocess.run([sys.executable, "-m", "spear", *argv], capture_output=True, text=True, timeout=300)


def test_help_lists_commands():
    res = _run("--help")
    assert res.returncode == 0
    for cmd in ("run", "quantize", "eval"):
        assert cmd in res.stdout


@pytest.mark.parametrize("argv,message", [
    (["quantize", "--out", "x", "--bits", "5"], "argument --bits: invalid choice"),
    (["eval", "--seq-len", "0"], "expected a number >= 1"),
    (["eval", "--model", "/does/not/exist"], "neither 'smollm2-135m' nor an existing local folder"),
    (["run", "--baselines", "magic"], "unknown baseline(s) ['magic']"),
    (["nosuchcommand"], "invalid choice"),
])
def test_bad_arguments_give_one_line_errors(argv, message):
    res = _run(*argv)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], res.stderr
    assert "Traceback" not in res.stderr


def test_quantize_then_eval(tiny_llama_path, article_text, tmp_path, capsys):
    text = tmp_path / "wiki.test.raw"
    text.write_text(article_text)
    out = tmp_path / "ckpt"
    common = ["--text", str(text), "--seq-len", "128", "--eval-windows", "2", "--calib-windows", "2"]
    assert main(["-q", "quantize", "--model", str(tiny_llama_path), "--out", str(out), "--group-size", "32",
                 "--compensator", "qera-approx", "--rank", "2", *common]) == 0
    assert "14 modules" in capsys.readouterr().out
    cfg = json.loads((out / "spear_config.json").read_text())
    assert cfg["meta"]["compensation"]["method"] == "qera-approx"
    assert main(["-q", "eval", "--model", str(out), "--json", str(tmp_path / "r.json"), *common]) == 0
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["tokens"] == 2 * 127 and res["memory_pct"] > 0 and res["ppl"] > 1
    # Writing over an existing checkpoint needs --overwrite.
    assert main(["-q", "quantize", "--model", str(tiny_llama_path), "--out", str(out), *common]) == 2
    assert "--overwrite" in capsys.readouterr().err


def test_bad_plan_file(tiny_llama_path, tmp_path, capsys):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"a": -1}))
    assert main(["-q", "quantize", "--model", str(tiny_llama_path), "--out", str(tmp_path / "o"),
                 "--compensator", "identity", "--plan", str(plan)]) == 2
    assert "non-negative integer ranks" in capsys.readouterr().err
