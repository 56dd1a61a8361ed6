"""The ``spear`` command: help, one-line errors, and a real quantize -> eval round trip."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from spear.cli import main
from spear.errors import SpearError


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
    (["run", "--device", "tpu"], "--device 'tpu' is not a torch device"),
    (["quantize", "--out", "x", "--method", "awq", "--awq-rounding", "nearest"], "argument --awq-rounding: invalid choice"),
])
def test_bad_arguments_give_one_line_errors(argv, message):
    res = _run(*argv)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("command", ["run", "calibrate", "select"])
def test_device_is_resolved_and_checked_before_the_model_loads(command, monkeypatch):
    """``auto`` is cuda where torch sees a GPU, else cpu; a device that is not there, or no device at all,
    is one line naming it."""
    from spear.cli import build_parser
    from spear.cli.common import device_from

    parse = build_parser().parse_args
    out = [] if command == "run" else ["--out", "x"]
    assert parse([command, *out]).device == "auto"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert device_from(parse([command, *out])) == "cpu"
    assert device_from(parse([command, *out, "--device", "cpu"])) == "cpu"
    with pytest.raises(SpearError, match="asked for, but torch sees 0 CUDA device"):
        device_from(parse([command, *out, "--device", "cuda:1"]))
    with pytest.raises(SpearError, match="is not a torch device"):
        device_from(parse([command, *out, "--device", "gpu0"]))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert device_from(parse([command, *out])) == "cuda"
    assert device_from(parse([command, *out, "--device", "cuda:1"])) == "cuda:1"
    with pytest.raises(SpearError, match="torch sees 2 CUDA"):
        device_from(parse([command, *out, "--device", "cuda:2"]))


def test_awq_rounding_reaches_the_quant_config():
    from spear.cli import build_parser
    from spear.cli.common import quant_config_from

    parse = build_parser().parse_args
    assert quant_config_from(parse(["quantize", "--out", "x", "--method", "awq"])).awq.rounding == "rtn"
    cfg = quant_config_from(parse(["quantize", "--out", "x", "--method", "awq", "--awq-rounding", "gptq",
                                   "--gptq-damp", "0.05"]))
    assert cfg.awq.rounding == "gptq" and cfg.gptq.damp == 0.05 and cfg.label.startswith("AWQ+GPTQ")
    assert not cfg.awq.fold_kv_heads
    assert quant_config_from(parse(["quantize", "--out", "x", "--method", "awq", "--awq-fold-kv-heads"])).awq.fold_kv_heads


def test_quantize_then_eval(tiny_llama_path, article_text, tmp_path, capsys):
    """``spear eval`` on the checkpoint reports exp(mean NLL) of the evaluation windows, computed
    here from the loaded checkpoint's logits in float64.

    Catches: ``perplexity`` scoring ``logits[:, 1:]`` against ``ids[:, 1:]`` (no next-token shift),
    which the old ``ppl > 1`` passed."""
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
    assert res["tokens"] == 2 * 127 and res["memory_pct"] > 0
    from spear.config import EvalConfig
    from spear.models.loading import load_model
    from spear.pipeline import load_split

    model, tok = load_model(out)
    ids = load_split(tok, EvalConfig(text=str(text), seq_len=128, eval_windows=2, calib_windows=2)).eval
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits.double(), -1)
    nll = -logp[:, :-1].gather(-1, ids[:, 1:, None]).mean()
    assert res["ppl"] == pytest.approx(math.exp(nll), rel=1e-4)
    # Writing over an existing checkpoint needs --overwrite.
    assert main(["-q", "quantize", "--model", str(tiny_llama_path), "--out", str(out), *common]) == 2
    assert "--overwrite" in capsys.readouterr().err


def test_bad_plan_file(tiny_llama_path, tmp_path, capsys):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"a": -1}))
    assert main(["-q", "quantize", "--model", str(tiny_llama_path), "--out", str(tmp_path / "o"),
                 "--compensator", "identity", "--plan", str(plan)]) == 2
    assert "non-negative integer ranks" in capsys.readouterr().err


@pytest.fixture()
def unloadable_model(tiny_llama_path, tmp_path):
    """A model folder whose weights file is truncated: a command that loads it fails naming it, so
    an error about --out shows that --out was checked first."""
    import shutil

    folder = shutil.copytree(tiny_llama_path, tmp_path / "model")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    return folder


def _one_line_error(capsys, command) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"spear {command}: error: ") and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("command", ["quantize", "calibrate", "run", "select"])
@pytest.mark.parametrize("where", ["under a file", "under /proc"])
def test_an_out_no_folder_can_be_made_at_fails_before_the_model_loads(unloadable_model, tmp_path, capsys,
                                                                      command, where):
    """Catches: the --out check by permission bits, which root passes for /proc/x and for a path
    under a file; the command then worked for minutes and ended in a traceback."""
    if where == "under a file":
        (tmp_path / "file").write_text("x")
        out, fragment = tmp_path / "file" / "x", f"{tmp_path / 'file'} is not a folder"
    else:
        if not Path("/proc").is_dir():
            pytest.skip("no /proc here")
        out, fragment = Path("/proc/x"), "no folder can be created in /proc"
    assert main(["-q", command, "--model", str(unloadable_model), "--out", str(out)]) == 2
    line = _one_line_error(capsys, command)
    assert f"cannot write {out}" in line and fragment in line and "safetensors" not in line, line


@pytest.mark.parametrize("command", ["quantize", "calibrate"])
def test_overwrite_refuses_a_folder_that_is_not_a_checkpoint(unloadable_model, tmp_path, capsys, command):
    """Catches: --overwrite deleting any folder --out names, not only a spear checkpoint."""
    out = tmp_path / "home"
    (out / "docs").mkdir(parents=True)
    (out / "docs" / "thesis.tex").write_text("years of work")
    assert main(["-q", command, "--model", str(unloadable_model), "--out", str(out), "--overwrite"]) == 2
    line = _one_line_error(capsys, command)
    assert "holds no spear_config.json" in line and "safetensors" not in line, line
    assert (out / "docs" / "thesis.tex").read_text() == "years of work"


def test_overwrite_replaces_a_checkpoints_own_files_and_never_a_users(tiny_llama_path, unloadable_model, tmp_path,
                                                                      capsys):
    """--overwrite replaces a checkpoint holding only the files spear wrote; a checkpoint beside
    notes.txt, or a copied spear_config.json beside mine.txt, is refused in one line before the
    model loads, and every file stays. Catches: the replace deleting the user's files with the
    folder (the check once read spear_config.json alone)."""
    import shutil

    ckpt = tmp_path / "ckpt"
    assert main(["-q", "quantize", "--model", str(tiny_llama_path), "--out", str(ckpt)]) == 0
    files = json.loads((ckpt / "spear_config.json").read_text())["files"]
    assert files == sorted(p.name for p in ckpt.iterdir()) and "model.safetensors" in files

    def contents(folder):
        return {p.name: p.read_bytes() for p in folder.iterdir()}

    def refused(out, extra):
        before = contents(out)
        assert main(["-q", "quantize", "--model", str(unloadable_model), "--out", str(out), "--overwrite"]) == 2
        line = _one_line_error(capsys, "quantize")
        assert f"holds files spear did not write there ({extra}): --overwrite replaces the whole folder and never " \
               "deletes them" in line and "safetensors" not in line, line
        assert contents(out) == before

    (ckpt / "notes.txt").write_text("keep me")
    refused(ckpt, "notes.txt")
    mine = tmp_path / "mine"
    mine.mkdir()
    shutil.copy(ckpt / "spear_config.json", mine)
    (mine / "mine.txt").write_text("mine")
    refused(mine, "mine.txt")

    (ckpt / "notes.txt").unlink()
    (ckpt / "plan.json").write_text("{}")  # spear calibrate writes its plan after the checkpoint
    capsys.readouterr()
    assert main(["-q", "quantize", "--model", str(tiny_llama_path), "--out", str(ckpt), "--overwrite",
                 "--bits", "8"]) == 0
    cfg = json.loads((ckpt / "spear_config.json").read_text())
    assert cfg["quant"]["bits"] == 8 and sorted(p.name for p in ckpt.iterdir()) == cfg["files"]

    # a checkpoint written before spear_config.json listed its files: the names a checkpoint may hold
    del cfg["files"]
    (ckpt / "spear_config.json").write_text(json.dumps(cfg))
    (ckpt / "notes.txt").write_text("keep me")
    refused(ckpt, "notes.txt")
    (ckpt / "notes.txt").unlink()
    assert main(["-q", "quantize", "--model", str(tiny_llama_path), "--out", str(ckpt), "--overwrite"]) == 0
    assert json.loads((ckpt / "spear_config.json").read_text())["quant"]["bits"] == 4


@pytest.mark.parametrize("where", ["under a file", "under /proc", "a folder"])
def test_eval_json_that_cannot_be_written_fails_before_the_model_loads(unloadable_model, tmp_path, capsys, where):
    """Catches: --json opened only after the whole evaluation, then a traceback (--out refused in
    seconds). Now one line and exit 2 before loading, as --out's check."""
    if where == "under a file":
        (tmp_path / "file").write_text("x")
        path, fragment = tmp_path / "file" / "r.json", f"{tmp_path / 'file'} is not a folder"
    elif where == "a folder":
        path, fragment = tmp_path, "it is a folder"
    else:
        if not Path("/proc").is_dir():
            pytest.skip("no /proc here")
        path, fragment = Path("/proc/x/r.json"), "no folder can be created in /proc"
    assert main(["-q", "eval", "--model", str(unloadable_model), "--json", str(path)]) == 2
    line = _one_line_error(capsys, "eval")
    assert f"cannot write {path}" in line and fragment in line and "safetensors" not in line, line


def test_eval_json_goes_into_a_new_folder(tiny_llama_path, article_text, tmp_path):
    text = tmp_path / "wiki.test.raw"
    text.write_text(article_text)
    out = tmp_path / "new" / "r.json"
    assert main(["-q", "eval", "--model", str(tiny_llama_path), "--json", str(out), "--text", str(text),
                 "--seq-len", "64", "--eval-windows", "1", "--calib-windows", "0"]) == 0
    assert json.loads(out.read_text())["windows"] == 1
