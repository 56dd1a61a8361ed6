"""The quantize_model entry point, calibration sources, and the CLI/pipeline paths for GPTQ/AWQ."""

import json

import pytest
import torch

from spear.config import CalibConfig, QuantConfig
from spear.errors import SpearError
from spear.quant.api import calibration_ids, quantize_model

from spear.quant import quantized_modules
from tests.conftest import sqnr_db

from .conftest import make_tiny_llama


def make_fp(path):
    from spear.models.loading import load_model

    return load_model(path)[0]


def test_calibration_source_rules():
    model = make_tiny_llama()
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    text = QuantConfig(method="gptq", calib=CalibConfig(source="text"))
    assert calibration_ids(model, text, ids) is ids
    assert calibration_ids(model, QuantConfig(method="awq"), ids) is ids  # given ids (e.g. self-samples) win
    with pytest.raises(SpearError, match="source 'text' needs"):
        quantize_model(model, text, calib=None, progress=False)
    with pytest.raises(SpearError, match="non-empty"):
        quantize_model(model, text, calib=ids[:0], progress=False)
    with pytest.raises(SpearError, match="needs the model's tokenizer"):
        quantize_model(model, QuantConfig(method="gptq"), progress=False)


def test_model_without_layer_list_is_refused():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(SpearError, match="no list of layers"):
        quantize_model(model, QuantConfig(method="gptq", calib=CalibConfig(source="text")),
                       calib=torch.zeros(1, 4, dtype=torch.long), progress=False)


def test_cli_quantize_gptq_self_sampled_and_awq_with_compensator(tiny_llama_path, article_text, tmp_path,
                                                                  monkeypatch, capsys):
    """Catches: GPTQ's act-order codes written in the permuted column order (``unperm[:, perm] = codes``
    in spear/quant/gptq.py turned into ``unperm[:] = codes``): the old check only asked for finite logits."""
    from spear.cli import main
    from spear.models.checkpoint import load_checkpoint, read_spear_config

    monkeypatch.setenv("SPEAR_CACHE", str(tmp_path / "cache"))
    text = tmp_path / "wiki.test.raw"
    text.write_text(article_text)
    common = ["--text", str(text), "--seq-len", "64", "--eval-windows", "2", "--calib-windows", "2"]
    out = tmp_path / "gptq"
    assert main(["-q", "quantize", "--model", str(tiny_llama_path), "--out", str(out), "--method", "gptq",
                 "--group-size", "32", "--act-order", "--calib-samples", "2", "--calib-seq-len", "16", *common]) == 0
    quant = QuantConfig.from_dict(read_spear_config(out)["quant"])
    assert quant.method == "gptq" and quant.gptq.act_order and quant.calib.source == "self"
    assert list((tmp_path / "cache" / "selfsample").glob("*.safetensors"))  # shared sample cache
    model, _ = load_checkpoint(out)
    # Against the FP model: every GPTQ W4 g32 weight (lowest seen on this CPU, 2026-12-01: 14.8 dB,
    # q_proj) and the logits stay close to FP but are not FP; a checkpoint whose codes, scales or
    # column order were lost fails both, which the old isfinite check let through.
    fp = make_fp(tiny_llama_path)
    for name, m in quantized_modules(model).items():
        s = sqnr_db(fp.get_submodule(name).weight, m.dequantized_weight(torch.float32))
        assert 12 < s < 40, (name, s)
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        s = sqnr_db(fp(ids).logits, model(ids).logits)
    assert 15 < s < 60, s

    out = tmp_path / "awq"
    assert main(["-q", "quantize", "--model", str(tiny_llama_path), "--out", str(out), "--method", "awq",
                 "--calib-source", "text", "--compensator", "qera-approx", "--rank", "2", *common]) == 0
    cfg = read_spear_config(out)
    assert cfg["quant"]["method"] == "awq" and cfg["meta"]["compensation"]["method"] == "qera-approx"
    assert "14 modules" in capsys.readouterr().out


def test_pipeline_awq_static_rows_use_the_scaled_reference(tiny_llama_path, article_text, tmp_path):
    from spear.config import EvalConfig
    from spear.pipeline import run_job

    text = tmp_path / "wiki.test.raw"
    text.write_text(article_text)
    eval_cfg = EvalConfig(text=str(text), seq_len=64, eval_windows=2, calib_windows=2)
    quant = QuantConfig(method="awq", group_size=32, calib=CalibConfig(source="text"))
    result = run_job(str(tiny_llama_path), quant, eval_cfg, ["qera-approx"], rank=8, progress=False, log=lambda *_: None,
                     spear_variants=())
    fp, base, qera = (r.ppl for r in result.rows)
    # The static correction is built against W·diag(s) (the weights AWQ rounded) and moves toward FP.
    assert abs(qera - fp) < abs(base - fp)
    json.dumps(result.header)


def test_head_at_its_own_width(tiny_llama_path, article_text, tmp_path):
    """--lm-head-bits 8: the body with its method, the head RTN W8 per-channel symmetric; the
    checkpoint keeps both widths, and the W8 head is far closer to the fp head than a W4 one."""
    from spear.cli import main
    from spear.models.checkpoint import load_checkpoint, read_spear_config
    from spear.quant.linear import QuantLinear

    with pytest.raises(SpearError, match="head_bits needs include_lm_head"):
        QuantConfig(head_bits=8)
    with pytest.raises(SpearError, match="head_bits must be"):
        QuantConfig(head_bits=5, include_lm_head=True)
    assert QuantConfig(include_lm_head=True, head_bits=8).label == "RTN W4 per-channel sym + head W8"
    assert not QuantConfig(include_lm_head=True, head_bits=4).separate_head  # as bits: the body's path

    model = make_tiny_llama()
    fp_head = model.lm_head.weight.detach().clone()
    mods = quantize_model(model, QuantConfig(group_size=32, include_lm_head=True, head_bits=8), progress=False)
    head = mods["lm_head"]
    assert isinstance(model.lm_head, QuantLinear) and head is model.lm_head
    assert (head.bits, head.group_size, head.symmetric) == (8, 0, True)
    assert all((m.bits, m.group_size) == (4, 32) for n, m in mods.items() if n != "lm_head")
    err8 = (head.dequantized_weight(torch.float32) - fp_head).pow(2).mean()
    model4 = make_tiny_llama()
    head4 = quantize_model(model4, QuantConfig(group_size=32, include_lm_head=True), progress=False)["lm_head"]
    err4 = (head4.dequantized_weight(torch.float32) - fp_head).pow(2).mean()
    assert err8 < err4 / 50  # ~2^8 smaller step: the error falls by far more than 50x

    text = tmp_path / "wiki.test.raw"
    text.write_text(article_text)
    out = tmp_path / "w8head"
    assert main(["-q", "quantize", "--model", str(tiny_llama_path), "--out", str(out), "--lm-head-bits", "8",
                 "--text", str(text), "--seq-len", "64", "--eval-windows", "2", "--calib-windows", "2"]) == 0
    quant = QuantConfig.from_dict(read_spear_config(out)["quant"])
    assert quant.include_lm_head and quant.head_bits == 8
    loaded, _ = load_checkpoint(out)
    assert loaded.lm_head.bits == 8 and loaded.model.layers[0].mlp.down_proj.bits == 4
