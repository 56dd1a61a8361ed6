import json
import os
import re
import socket
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file

from spear.compensate.static import attach_static
from spear.config import QuantConfig, StaticCompensationConfig
from spear.errors import SpearError
from spear.fileio import check_output_folder
from spear.models.checkpoint import (WEIGHTS_NAME, check_checkpoint_out, read_generation_config, read_spear_config,
                                     save_checkpoint)
from spear.models.loading import load_model
from spear.models.modules import quantizable_linears
from spear.quant import quantize_model_rtn, quantized_modules


@pytest.fixture()
def saved(tiny_llama, tmp_path):
    model, tok = tiny_llama
    fp = {n: l.weight.detach().clone() for n, l in quantizable_linears(model).items()}
    cfg = QuantConfig(bits=3, group_size=32, symmetric=False)
    mods = quantize_model_rtn(model, cfg, progress=False)
    plan = {n: 2 for n in list(mods)[:5]}
    attach_static(mods, fp, StaticCompensationConfig(method="identity", plan=plan), None, progress=False)
    out = save_checkpoint(model, tok, tmp_path / "ckpt", cfg, "tiny", meta={"note": "test"})
    return model, out


def test_roundtrip_gives_identical_outputs(saved):
    model, path = saved
    loaded, tok = load_model(path)
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(model(input_ids=ids).logits, loaded(input_ids=ids).logits)
    mods = quantized_modules(loaded)
    assert len(mods) == 14 and sum(m.compensator is not None for m in mods.values()) == 5
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    cfg = json.loads((path / "spear_config.json").read_text())
    assert cfg["quant"]["bits"] == 3 and cfg["meta"] == {"note": "test"}
    assert not list(path.glob("*.bin")) and not list(path.glob("*.pt"))  # never pickle


def test_config_json_names_the_method(saved):
    """config.json carries quantization_config with quant_method "spear" (vLLM picks the plugin
    from it without --quantization), and transformers still reads the folder's config."""
    from transformers import AutoConfig

    _, path = saved
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    assert qc == {"quant_method": "spear", "format": "spear-checkpoint", "version": 1, "config_file": "spear_config.json",
                  "bits": 3, "group_size": 32, "sym": False}
    hf = AutoConfig.from_pretrained(path)
    assert hf.quantization_config["quant_method"] == "spear" and hf.num_hidden_layers >= 1


def test_packed_codes_are_stored(saved):
    _, path = saved
    t = load_file(str(path / WEIGHTS_NAME))
    q = t["model.layers.0.self_attn.q_proj.qweight"]
    assert q.dtype == torch.uint8 and q.shape == (64, 64 * 3 // 8)
    assert t["model.layers.0.self_attn.q_proj.compensator.A"].dtype == torch.float16


def _tamper(path, fn):
    tensors = load_file(str(path / WEIGHTS_NAME))
    fn(tensors)
    save_file(tensors, str(path / WEIGHTS_NAME))


@pytest.mark.parametrize("change,message", [
    (lambda t: t.pop("model.layers.1.mlp.down_proj.scales"), "lacks tensor model.layers.1.mlp.down_proj.scales"),
    (lambda t: t.__setitem__("extra.weight", torch.zeros(2)), "unexpected tensor extra.weight"),
    (lambda t: t.__setitem__("model.norm.weight", torch.ones(3)), r"model.norm.weight: shape \(3,\), expected \(64,\)"),
    (lambda t: t.__setitem__("model.layers.0.mlp.up_proj.scales",
                             t["model.layers.0.mlp.up_proj.scales"].float()), "up_proj.scales: dtype torch.float32"),
])
def test_load_validates_names_shapes_dtypes(saved, change, message):
    _, path = saved
    _tamper(path, change)
    with pytest.raises(SpearError, match=message):
        load_model(path)


def test_bad_spear_config(saved):
    _, path = saved
    (path / "spear_config.json").write_text("{not json")
    with pytest.raises(SpearError, match="not valid JSON"):
        load_model(path)
    (path / "spear_config.json").write_text(json.dumps({"format": "spear-checkpoint", "version": 99}))
    with pytest.raises(SpearError, match="version 99"):
        load_model(path)


def test_write_is_atomic(tiny_llama, tmp_path, monkeypatch):
    model, tok = tiny_llama
    cfg = QuantConfig()
    quantize_model_rtn(model, cfg, progress=False)
    target = tmp_path / "out"
    save_checkpoint(model, tok, target, cfg, "tiny")
    before = (target / WEIGHTS_NAME).read_bytes()
    with pytest.raises(SpearError, match="exists and is not empty"):
        save_checkpoint(model, tok, target, cfg, "tiny")

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr("safetensors.torch.save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(model, tok, target, cfg, "tiny", overwrite=True)
    assert (target / WEIGHTS_NAME).read_bytes() == before  # the old checkpoint is untouched
    with pytest.raises(OSError):
        save_checkpoint(model, tok, tmp_path / "new", cfg, "tiny")
    assert not (tmp_path / "new").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary folders left


def test_refuses_non_finite(tiny_llama, tmp_path):
    model, tok = tiny_llama
    cfg = QuantConfig()
    quantize_model_rtn(model, cfg, progress=False)
    model.model.norm.weight.data[0] = float("nan")
    with pytest.raises(SpearError, match="model.norm.weight has non-finite"):
        save_checkpoint(model, tok, tmp_path / "x", cfg, "tiny")


def test_unquantized_model_cannot_be_saved(tiny_llama, tmp_path):
    model, tok = tiny_llama
    with pytest.raises(SpearError, match="no quantized modules"):
        save_checkpoint(model, tok, tmp_path / "x", QuantConfig(), "tiny")


def test_quantized_head_of_a_tied_model(tiny_llama, tmp_path):
    """The head quantized (W8 here) on a model whose head is tied to its input embeddings: after a
    round trip the embeddings stay full precision, the head holds no stray weight, and the
    memory count (the embeddings counted once, the head by its codes) is unchanged."""
    from spear.eval.memory import quantized_model_bytes
    from spear.quant.api import quantize_model

    model, tok = tiny_llama
    emb = model.model.embed_tokens.weight.detach().clone()
    cfg = QuantConfig(group_size=32, include_lm_head=True, head_bits=8)
    quantize_model(model, cfg, progress=False)
    nbytes = quantized_model_bytes(model)
    loaded, _ = load_model(save_checkpoint(model, tok, tmp_path / "ckpt", cfg, "tiny"))
    assert dict(loaded.lm_head.named_parameters()) == {} and loaded.lm_head.bits == 8
    assert torch.equal(loaded.model.embed_tokens.weight, emb)
    assert quantized_model_bytes(loaded) == nbytes
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(model(input_ids=ids).logits, loaded(input_ids=ids).logits)


def _writer_folders(parent, name):
    """A temporary folder of ``name`` left by a killed writer, and one of a writer still running."""
    dead_proc = subprocess.Popen(["true"])
    dead_proc.wait()
    folders = {}
    for kind, pid in (("dead", dead_proc.pid), ("live", os.getpid())):
        folder = parent / f".{name}.tmp-{kind}"
        folder.mkdir(parents=True)
        (folder / ".spear-writer").write_text(f"{socket.gethostname()} {pid}")
        (folder / WEIGHTS_NAME).write_bytes(b"\x00" * 1024)
        folders[kind] = folder
    return folders["dead"], folders["live"]


def test_the_out_check_removes_a_killed_writers_temporaries_even_when_it_fails(tmp_path):
    """The --out check, which every writing command runs first, removes a killed writer's
    temporaries even when it refuses the folder (and the run ends there). Catches: the cleanup
    done only by a save that gets to write."""
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "x").write_text("already here")
    dead, live = _writer_folders(tmp_path, "ckpt")
    with pytest.raises(SpearError, match="exists and is not empty"):
        check_output_folder(target, overwrite=False)
    assert not dead.exists() and live.exists() and (target / "x").exists()


def test_a_failed_save_still_removes_a_killed_writers_temporaries(tiny_llama, tmp_path, monkeypatch):
    """Catches: the cleanup after the write (a rerun that fails while writing keeps the old
    leftovers), and a cleanup that removes a running writer's folder."""
    model, tok = tiny_llama
    cfg = QuantConfig()
    quantize_model_rtn(model, cfg, progress=False)
    dead, live = _writer_folders(tmp_path, "out")

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr("safetensors.torch.save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(model, tok, tmp_path / "out", cfg, "tiny")
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name]


def test_using_the_default_model_removes_a_killed_conversions_temporaries(tmp_path, monkeypatch):
    """A conversion of the default model killed midway left its temporary folder; another one
    completed since. Resolving the default removes the leftover without converting again.
    Catches: the cleanup run only by a new conversion."""
    from spear.models import loading

    monkeypatch.setenv("SPEAR_CACHE", str(tmp_path))
    models = tmp_path / "models"
    target = models / loading.DEFAULT_MODEL
    target.mkdir(parents=True)
    (target / loading._COMPLETE_MARKER).write_text("{}")
    dead, live = _writer_folders(models, loading.DEFAULT_MODEL)
    monkeypatch.setattr(loading, "_convert_default", lambda t: pytest.fail("converted again"))
    assert loading.resolve_model_path(loading.DEFAULT_MODEL) == target
    assert not dead.exists() and live.exists()


DEEP = "[" * 100_000 + "]" * 100_000  # json.loads raises RecursionError on it


def test_a_spear_config_nested_too_deeply_is_a_spear_error_naming_it(tmp_path):
    """Catches: read_spear_config turning JSONDecodeError into a SpearError but letting the
    RecursionError of deep nesting end the command with a traceback."""
    (tmp_path / "spear_config.json").write_text(DEEP)
    with pytest.raises(SpearError, match=re.escape(f"{tmp_path / 'spear_config.json'} is not valid JSON: "
                                                   "nested too deeply")):
        read_spear_config(tmp_path)


@pytest.mark.parametrize("text,message", [
    (DEEP, "is not valid JSON: nested too deeply"),
    ('{"eos_token_id": 2, "x": ' + '{"a": ' * 600 + "1" + "}" * 600 + "}",
     "is not a generation config transformers accepts: maximum recursion depth"),  # parses; copying it recurses
    ("{nope", "is not valid JSON"),
    ("[2]", "expected a JSON object, got list"),
])
def test_a_damaged_generation_config_is_a_spear_error_naming_it(tmp_path, text, message):
    """Its end-of-sequence ids decide where generation stops. Catches: a RecursionError traceback,
    and a malformed file read as no generation config at all."""
    (tmp_path / "generation_config.json").write_text(text)
    with pytest.raises(SpearError, match=re.escape(f"{tmp_path / 'generation_config.json'}") + ".*" + message):
        read_generation_config(tmp_path)


def test_generation_config_is_read_and_optional(tmp_path):
    assert read_generation_config(tmp_path) is None
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 7], "max_new_tokens": 5}')
    assert read_generation_config(tmp_path).eos_token_id == [2, 7]


def test_overwrite_replaces_a_checkpoint_never_another_folder(tiny_llama, tmp_path):
    """Catches: --overwrite deleting whatever folder --out names (a home folder, a dataset)."""
    model, tok = tiny_llama
    cfg = QuantConfig()
    quantize_model_rtn(model, cfg, progress=False)
    other = tmp_path / "data"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(SpearError, match="holds no spear_config.json"):
        save_checkpoint(model, tok, other, cfg, "tiny", overwrite=True)
    with pytest.raises(SpearError, match="holds no spear_config.json"):
        check_checkpoint_out(other, overwrite=True)
    assert [p.name for p in other.iterdir()] == ["notes.txt"] and (other / "notes.txt").read_text() == "keep me"
    ckpt = save_checkpoint(model, tok, tmp_path / "ckpt", cfg, "first")
    save_checkpoint(model, tok, ckpt, cfg, "second", overwrite=True)
    assert json.loads((ckpt / "spear_config.json").read_text())["source_model"] == "second"
    (tmp_path / "empty").mkdir()
    assert check_checkpoint_out(tmp_path / "empty", overwrite=False) == tmp_path / "empty"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "data", "empty"]


@pytest.mark.parametrize("config", ["{}", '{"format": "spear"}', "not json", '["spear"]'])
def test_overwrite_needs_a_real_spear_config_not_a_file_of_its_name(tiny_llama, tmp_path, config):
    """Catches: --overwrite replacing any folder that holds a file named spear_config.json, even
    ``{}``: only a folder whose spear_config.json reads as a spear checkpoint's is replaced."""
    model, tok = tiny_llama
    cfg = QuantConfig()
    quantize_model_rtn(model, cfg, progress=False)
    other = tmp_path / "results"
    other.mkdir()
    (other / "spear_config.json").write_text(config)
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(SpearError, match="holds a spear_config.json that is not spear's"):
        check_checkpoint_out(other, overwrite=True)
    with pytest.raises(SpearError, match="holds a spear_config.json that is not spear's"):
        save_checkpoint(model, tok, other, cfg, "tiny", overwrite=True)
    assert sorted(p.name for p in other.iterdir()) == ["notes.txt", "spear_config.json"]
    assert (other / "spear_config.json").read_text() == config and (other / "notes.txt").read_text() == "keep me"
