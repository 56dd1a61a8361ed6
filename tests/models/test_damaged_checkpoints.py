"""A damaged checkpoint or model folder is a one-line error and exit code 2, never a traceback,
random weights or non-finite values loaded silently.

Each case damages a fresh copy of one small spear checkpoint (a tiny random Llama, RTN W4
per-channel, rank-2 SVD compensators on five modules) or of a plain HF folder, then
runs ``spear generate`` on it in-process and checks the exit code and stderr.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from spear.cli import main
from spear.compensate.static import attach_static
from spear.config import QuantConfig, StaticCompensationConfig
from spear.errors import SpearError
from spear.fileio import clean_stale_temporaries
from spear.models.checkpoint import CONFIG_NAME, WEIGHTS_NAME, save_checkpoint
from spear.models.loading import load_model
from spear.models.modules import quantizable_linears
from spear.quant import quantize_model_rtn


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, tiny_llama_path):
    model, tok = load_model(tiny_llama_path)
    fp = {n: lin.weight.detach().clone() for n, lin in quantizable_linears(model).items()}
    cfg = QuantConfig(bits=4, group_size=0)
    mods = quantize_model_rtn(model, cfg, progress=False)
    attach_static(mods, fp, StaticCompensationConfig(method="identity", plan={n: 2 for n in list(mods)[:5]}),
                  None, progress=False)
    return save_checkpoint(model, tok, tmp_path_factory.mktemp("ckpt") / "ckpt", cfg, "tiny")


@pytest.fixture()
def ckpt(pristine, tmp_path):
    return shutil.copytree(pristine, tmp_path / "ckpt")


def run(path, capsys, *extra) -> tuple[int, str]:
    code = main(["-q", "generate", "--model", str(path), "--prompt", "Hi", "--max-tokens", "2", *extra])
    return code, capsys.readouterr().err


def assert_one_line_error(code, err, fragment):
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("spear generate: error: "), err
    assert "Traceback" not in err and fragment in lines[0], lines[0]


def _header_len(path) -> int:
    with open(path, "rb") as fh:
        return struct.unpack("<Q", fh.read(8))[0]


def _rewrite(path, fn):
    tensors = load_file(str(path / WEIGHTS_NAME))
    fn(tensors)
    save_file(tensors, str(path / WEIGHTS_NAME))


def _tensor_offset(path, name) -> int:
    """Byte offset of tensor ``name``'s data in the file."""
    n = _header_len(path / WEIGHTS_NAME)
    with open(path / WEIGHTS_NAME, "rb") as fh:
        fh.seek(8)
        header = json.loads(fh.read(n))
    return 8 + n + header[name]["data_offsets"][0]


def _patch_bytes(path, offset, data: bytes):
    with open(path / WEIGHTS_NAME, "r+b") as fh:
        fh.seek(offset)
        fh.write(data)


def _truncate(p):
    f = p / WEIGHTS_NAME
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _bad_header_json(p):
    n = _header_len(p / WEIGHTS_NAME)
    _patch_bytes(p, 8, b"{" * n)


def _huge_header(p):
    _patch_bytes(p, 0, struct.pack("<Q", 2**62))


def _pickle(p):
    torch.save({"x": torch.zeros(3)}, p / WEIGHTS_NAME)


def _config(value):
    return lambda p: (p / CONFIG_NAME).write_text(json.dumps(value) if not isinstance(value, str) else value)


def _edit_config(fn):
    def edit(p):
        cfg = json.loads((p / CONFIG_NAME).read_text())
        fn(cfg)
        (p / CONFIG_NAME).write_text(json.dumps(cfg))
    return edit


Q = "model.layers.0.self_attn.q_proj"
DEEP = "[" * 100_000 + "]" * 100_000  # json.loads raises RecursionError on it

CASES = {  # name -> (damage, fragment of the one-line error)
    "truncated": (_truncate, "not a readable safetensors file"),
    "empty": (lambda p: (p / WEIGHTS_NAME).write_bytes(b""), "not a readable safetensors file"),
    "header json": (_bad_header_json, "not a readable safetensors file"),
    "header length 2**62": (_huge_header, "not a readable safetensors file"),
    "pickle": (_pickle, "not a readable safetensors file"),
    "no weights file": (lambda p: (p / WEIGHTS_NAME).unlink(), f"lacks {WEIGHTS_NAME}"),
    "no spear_config": (lambda p: (p / CONFIG_NAME).unlink(), "no spear_config.json"),
    "config is a list": (_config([1, 2, 3]), "expected a JSON object"),
    "config is not json": (_config("{nope"), "not valid JSON"),
    "config nested too deeply": (_config(DEEP), f"{CONFIG_NAME} is not valid JSON: nested too deeply"),
    "modules is a string": (_edit_config(lambda c: c.__setitem__("modules", "x")), "modules must be"),
    "version as a string": (_edit_config(lambda c: c.__setitem__("version", "1")), "version must be the whole number 1"),
    "version 2": (_edit_config(lambda c: c.__setitem__("version", 2)), "version 2 is not supported"),
    "dtype": (_edit_config(lambda c: c.__setitem__("dtype", "int8")), "dtype must be one of"),
    "bits": (_edit_config(lambda c: c["modules"][Q].__setitem__("bits", 5)), "bits must be 2, 3, 4 or 8"),
    "in_features": (_edit_config(lambda c: c["modules"][Q].__setitem__("in_features", "64")), "in_features"),
    "compensator spec": (_edit_config(lambda c: c["modules"][Q].__setitem__("compensator", {"kind": "lowrank",
                                                                                             "bogus": 1})), Q),
    "unknown compensator": (_edit_config(lambda c: c["modules"][Q].__setitem__("compensator", {"kind": "x"})),
                            "unknown compensator kind"),
    "quant": (_edit_config(lambda c: c["quant"].__setitem__("bits", "four")), "quant"),
    "no config.json": (lambda p: (p / "config.json").unlink(), "config.json"),
    "garbled config.json": (lambda p: (p / "config.json").write_text("]"), "config.json"),
    "config.json nested too deeply": (lambda p: (p / "config.json").write_text(DEEP), "config.json"),
    "missing tensor": (lambda p: _rewrite(p, lambda t: t.pop(f"{Q}.scales")), f"lacks tensor {Q}.scales"),
    "extra tensor": (lambda p: _rewrite(p, lambda t: t.__setitem__("stray", torch.zeros(2))), "tensor stray"),
    "NaN in scales": (lambda p: _rewrite(p, lambda t: t[f"{Q}.scales"].__setitem__(0, float("nan"))),
                      f"{Q}.scales holds non-finite"),
    "inf in embeddings": (lambda p: _rewrite(p, lambda t: t["model.embed_tokens.weight"].__setitem__((0, 0),
                                                                                                     float("inf"))),
                          "model.embed_tokens.weight holds non-finite"),
    "NaN bits flipped into scales": (lambda p: _patch_bytes(p, _tensor_offset(p, f"{Q}.scales"), b"\xff\xff"),
                                     f"{Q}.scales holds non-finite"),
    "no tokenizer": (lambda p: [f.unlink() for f in p.glob("tokenizer*")], "tokenizer"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_damaged_checkpoint_is_a_one_line_error(ckpt, capsys, case):
    """Through the serving engine's loader (spear generate) and transformers' (load_model, which
    spear eval and the quality pipeline use): both refuse, naming what is wrong."""
    damage, fragment = CASES[case]
    damage(ckpt)
    assert_one_line_error(*run(ckpt, capsys), fragment)
    with pytest.raises(SpearError, match=re.escape(fragment) if case != "extra tensor" else "tensor stray"):
        load_model(ckpt)


def test_eval_on_a_checkpoint_whose_config_nests_too_deeply_is_one_line(ckpt, capsys):
    """Catches: the RecursionError of json.loads escaping as a traceback from `spear eval`."""
    (ckpt / CONFIG_NAME).write_text(DEEP)
    code = main(["-q", "eval", "--model", str(ckpt)])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("spear eval: error: ") and f"{ckpt / CONFIG_NAME} is not valid JSON" in lines[0]


@pytest.mark.parametrize("text,fragment", [(DEEP, "is not valid JSON: nested too deeply"),
                                           ("{nope", "is not valid JSON")])
def test_a_damaged_generation_config_is_one_line(ckpt, capsys, text, fragment):
    """The engine reads generation_config.json for its end-of-sequence ids. Catches: a
    RecursionError traceback, and a malformed file dropped silently (generation would then run
    past the model's end-of-sequence token)."""
    (ckpt / "generation_config.json").write_text(text)
    assert_one_line_error(*run(ckpt, capsys), f"{ckpt / 'generation_config.json'} {fragment}")


def test_pristine_checkpoint_and_extra_files_load(ckpt, capsys):
    (ckpt / "README.md").write_text("notes")
    (ckpt / "extra.bin").write_bytes(b"\x00" * 16)
    code, err = run(ckpt, capsys, "--verify")
    assert code == 0, err


def test_finite_bit_flips_are_caught_by_verify(ckpt, capsys):
    """A flipped code byte stays a valid 4-bit code: only the recorded digest tells. Without
    --verify it loads (documented); with it, a one-line error. Catches: digests not recorded at
    save, or not compared."""
    off = _tensor_offset(ckpt, f"{Q}.qweight")
    with open(ckpt / WEIGHTS_NAME, "rb") as fh:
        fh.seek(off)
        b = fh.read(1)
    _patch_bytes(ckpt, off, bytes([b[0] ^ 0x11]))
    assert run(ckpt, capsys)[0] == 0
    assert_one_line_error(*run(ckpt, capsys, "--verify"), f"{Q}.qweight does not match its recorded SHA-256")


def test_out_of_range_zero_points_are_refused(tmp_path, tiny_llama_path):
    model, tok = load_model(tiny_llama_path)
    cfg = QuantConfig(bits=4, group_size=32, symmetric=False)
    quantize_model_rtn(model, cfg, progress=False)
    path = save_checkpoint(model, tok, tmp_path / "asym", cfg, "tiny")
    _rewrite(path, lambda t: t[f"{Q}.zeros"].__setitem__((0, 0), 200))
    with pytest.raises(SpearError, match="zero points beyond 4 bits"):
        load_model(path)


# ---------------------------------------------------------------------- plain HF folders
@pytest.fixture()
def hf_folder(tiny_llama_path, tmp_path):
    return shutil.copytree(tiny_llama_path, tmp_path / "hf")


HF_CASES = {
    "missing weight": (lambda p: _rewrite(p, lambda t: t.pop("model.layers.1.mlp.up_proj.weight")),
                       "model.layers.1.mlp.up_proj.weight"),
    "truncated": (_truncate, "not a readable safetensors file"),
    "no weights": (lambda p: (p / WEIGHTS_NAME).unlink(), "holds no weights"),
    "NaN": (lambda p: _rewrite(p, lambda t: t["model.norm.weight"].__setitem__(0, float("nan"))),
            "model.norm.weight holds non-finite"),
    "spear tensors without spear_config": (lambda p: _rewrite(p, lambda t: t.__setitem__("a.qweight",
                                                                                          torch.zeros(2, 2))),
                                           "no spear_config.json"),
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_damaged_hf_folder_is_a_one_line_error(hf_folder, capsys, case):
    damage, fragment = HF_CASES[case]
    damage(hf_folder)
    assert_one_line_error(*run(hf_folder, capsys), fragment)
    with pytest.raises(SpearError, match=re.escape(fragment)):
        load_model(hf_folder)


def test_hf_folder_json_nested_too_deeply_is_one_line(hf_folder, capsys):
    """generation_config.json (read by transformers when it loads the model for `spear eval`, and
    by the engine) and model.safetensors.index.json (read by the engine). Catches: the
    RecursionError of json.loads escaping as a traceback, or as an error naming no file."""
    gen = hf_folder / "generation_config.json"
    gen.write_text(DEEP)
    code = main(["-q", "eval", "--model", str(hf_folder)])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and f"spear eval: error: {gen} is not valid JSON" in lines[0], lines
    assert_one_line_error(*run(hf_folder, capsys), f"{gen} is not valid JSON")
    gen.unlink()
    index = hf_folder / "model.safetensors.index.json"
    index.write_text(DEEP)
    assert_one_line_error(*run(hf_folder, capsys), f"{index} is not valid JSON: nested too deeply")


# ---------------------------------------------------------------------- writers killed mid-write
def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_temporary_folders_of_killed_writers_are_removed(tmp_path):
    target = tmp_path / "ckpt"
    dead = tmp_path / ".ckpt.tmp-dead"
    live = tmp_path / ".ckpt.tmp-live"
    unrelated = tmp_path / ".other.tmp-x"
    for folder, pid in ((dead, _dead_pid()), (live, os.getpid()), (unrelated, _dead_pid())):
        folder.mkdir()
        (folder / ".spear-writer").write_text(f"{os.uname().nodename} {pid}")
        (folder / "model.safetensors").write_bytes(b"\x00" * 1024)
    assert clean_stale_temporaries(target) == [dead]
    assert not dead.exists() and live.exists() and unrelated.exists()


def test_quantize_checks_out_before_the_work(hf_folder, tmp_path, capsys):
    """The model folder is damaged and --out is taken: the --out error comes first, before any
    loading. Catches: --out refused only after loading and quantizing the model."""
    _truncate(hf_folder)
    out = tmp_path / "taken"
    out.mkdir()
    (out / "x").write_text("already here")
    code = main(["-q", "quantize", "--model", str(hf_folder), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "exists and is not empty" in err and "safetensors" not in err, err
