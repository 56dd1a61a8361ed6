"""Ranks and gate widths at attach time: a rank a module cannot hold is an error, and a compensator
the fused kernels cannot take is a warning naming the module."""

import logging
import subprocess
import sys

import pytest
import torch

from spear.cli import main
from spear.compensate.calib_config import CalibrationConfig
from spear.compensate.static import attach_static
from spear.compensate.workflow import attach_ecs
from spear.config import QuantConfig, StaticCompensationConfig
from spear.errors import SpearError
from spear.models.modules import quantizable_linears
from spear.quant import quantize_model_rtn
from spear.quant.rtn import rtn_quantize_linear

K_PROJ = "model.layers.0.self_attn.k_proj"  # 64 -> 32 in the tiny Llama: the smallest module


def _quantized(model):
    fp = {n: lin.weight.detach().clone() for n, lin in quantizable_linears(model).items()}
    return quantize_model_rtn(model, QuantConfig(), progress=False), fp


def test_uniform_rank_above_a_module_limit_raises_before_attaching(tiny_llama):
    """Catches: the rank clamped to min(in, out) again (k_proj would silently get rank 32), or the
    check made per module inside the loop (q_proj, ahead of k_proj, would keep a compensator)."""
    mods, fp = _quantized(tiny_llama[0])
    with pytest.raises(SpearError, match=rf"{K_PROJ}: compensator rank 33 exceeds .* = 32$"):
        attach_static(mods, fp, StaticCompensationConfig(method="identity", rank=33), None, progress=False)
    with pytest.raises(SpearError, match=rf"{K_PROJ}: compensator rank 33 exceeds .* = 32$"):
        attach_ecs(mods, fp, dict.fromkeys(mods, 33), CalibrationConfig(init="identity"), None)
    assert all(m.compensator is None for m in mods.values())


def test_rank_equal_to_the_module_limit_is_attached(tiny_llama):
    """Catches: the check written as ``rank >= limit`` (a full-rank compensator is legal)."""
    mods, fp = _quantized(tiny_llama[0])
    assert attach_ecs(mods, fp, {K_PROJ: 32}, CalibrationConfig(init="identity"), None) == {K_PROJ: 32}
    assert mods[K_PROJ].compensator.rank == 32


def test_calibrate_cli_rejects_the_rank_before_sampling(tiny_llama_path, tmp_path, monkeypatch, capsys):
    """Catches: the CLI's early check removed, so the error only comes after the self-samples and
    the teacher (here the stubbed preparation would fail the test first)."""
    import spear.compensate.workflow as workflow

    def no_preparation(*a, **k):
        raise AssertionError("calibration data prepared for a plan that cannot be attached")

    monkeypatch.setattr(workflow, "prepare_calibration", no_preparation)
    monkeypatch.setenv("SPEAR_CACHE", str(tmp_path / "cache"))
    rc = main(["-q", "calibrate", "--model", str(tiny_llama_path), "--out", str(tmp_path / "o"), "--rank", "33"])
    err = capsys.readouterr().err
    assert rc == 2 and K_PROJ in err and "= 32" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_quantize_cli_rejects_the_rank_before_quantizing(tiny_llama_path, tmp_path, monkeypatch, capsys):
    """Catches: spear quantize reaching quantization (stubbed to fail) with a rank no module holds."""
    import spear.pipeline  # noqa: F401  imported first: a first import under the stub would bind it for good
    import spear.quant.api as api

    def no_quantization(*a, **k):
        raise AssertionError("quantized for a rank that cannot be attached")

    monkeypatch.setattr(api, "quantize_model", no_quantization)
    rc = main(["-q", "quantize", "--model", str(tiny_llama_path), "--out", str(tmp_path / "o"),
               "--compensator", "identity", "--rank", "33"])
    err = capsys.readouterr().err
    assert rc == 2 and K_PROJ in err and "= 32" in err
    assert not (tmp_path / "o").exists()


def test_run_rejects_the_rank_before_quantizing(tiny_llama_path, tmp_path, monkeypatch, capsys):
    """Catches: spear run's check in run_job removed, so the error only comes after the activation
    statistics and quantization (stubbed here to fail the test first)."""
    import spear.pipeline as pipeline

    def no_quantization(*a, **k):
        raise AssertionError("quantized for a rank that cannot be attached")

    monkeypatch.setattr(pipeline, "quantize_for_compensation", no_quantization)
    rc = main(["-q", "run", "--model", str(tiny_llama_path), "--baselines", "identity", "--spear", "none",
               "--rank", "33", "--seq-len", "32", "--eval-windows", "1", "--calib-windows", "0",
               "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 2 and K_PROJ in err and "= 32" in err


def test_gate_wider_than_the_kernels_warns_naming_the_module(tiny_llama, caplog):
    """Catches: attach_ecs not checking the attached compensator's spec against the kernels' limit."""
    mods, fp = _quantized(tiny_llama[0])
    with caplog.at_level(logging.WARNING, logger="spear.compensate.spec"):
        attach_ecs(mods, fp, {K_PROJ: 2}, CalibrationConfig(init="identity", gated=True, hidden=16), None)
        assert not caplog.records  # within the limit: silent
        attach_ecs(mods, fp, {K_PROJ: 2}, CalibrationConfig(init="identity", gated=True, hidden=129), None)
    assert [r.getMessage() for r in caplog.records] == [
        f"{K_PROJ}: gate width 129 exceeds the kernels' 128; the module will run off the fused kernel path "
        "when served"]


def test_static_rank_above_the_kernels_warns_naming_the_module(caplog):
    """Catches: attach_static not checking the attached compensator's spec against the kernels' limit."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(160, 144, bias=False)
    fp = {"wide": lin.weight.detach().clone()}
    mods = {"wide": rtn_quantize_linear(lin, QuantConfig())}
    with caplog.at_level(logging.WARNING, logger="spear.compensate.spec"):
        assert attach_static(mods, fp, StaticCompensationConfig(method="identity", rank=130), None,
                             progress=False) == {"wide": 130}
    assert [r.getMessage() for r in caplog.records] == [
        "wide: rank 130 exceeds the kernels' 128; the module will run off the fused kernel path when served"]


def test_the_kernel_limit_is_read_without_importing_a_triton_kernel():
    """Catches: the limit taken from a kernel module (ops, w4a16, ...) whose import decorates Triton kernels."""
    code = ("import sys, torch\n"
            "from spear.compensate.lowrank import LowRankCompensator\n"
            "from spear.compensate.spec import warn_off_kernel\n"
            "assert warn_off_kernel('m', LowRankCompensator(torch.zeros(200, 8), torch.zeros(8, 200)))\n"
            "print(sorted(m for m in sys.modules if m.startswith('spear.kernels') or m.split('.')[0] == 'triton'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['spear.kernels', 'spear.kernels.layout']"
