import json

import pytest

from spear.cli import main
from spear.compensate.ec import GatedCompensator
from spear.models.loading import load_model


def test_spear_calibrate_writes_checkpoint_and_gate_report(sharp_tiny_llama_path, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPEAR_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "ck"
    rc = main(["-q", "calibrate", "--model", str(sharp_tiny_llama_path), "--out", str(out), "--bits", "3",
               "--rank", "2", "--gate", "--steps", "6", "--samples", "4", "--val-samples", "2", "--sample-len", "16",
               "--gate-report", str(tmp_path / "gates"), "--train-dtype", "bfloat16"])
    assert rc == 0
    assert "14 ECs (gated)" in capsys.readouterr().out
    cfg = json.loads((out / "spear_config.json").read_text())
    assert cfg["meta"]["calibration"]["steps"] == 6 and len(cfg["meta"]["plan"]) == 14
    assert cfg["meta"]["calibration"]["train_dtype"] == "bfloat16"
    # by default the scales and the norm weights train too
    assert cfg["meta"]["calibration"]["tune_scales"] is True and cfg["meta"]["calibration"]["tune_norms"] is True
    model, _ = load_model(out)
    ec = model.model.layers[1].self_attn.o_proj.compensator
    assert isinstance(ec, GatedCompensator) and ec.rank == 2
    stats = json.loads((tmp_path / "gates" / "gate_stats.json").read_text())
    s = stats["model.layers.0.mlp.down_proj"]
    assert s["gamma_min"] <= s["gamma_mean"] <= s["gamma_max"] and 0 < s["gamma_min"] and s["gamma_max"] < 2
    assert (tmp_path / "gates" / "gate_vs_error.png").stat().st_size > 1000


def test_plan_with_unknown_module_is_rejected(sharp_tiny_llama_path, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPEAR_CACHE", str(tmp_path / "cache"))
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"model.layers.9.mlp.up_proj": 2}))
    rc = main(["-q", "calibrate", "--model", str(sharp_tiny_llama_path), "--out", str(tmp_path / "o"),
               "--plan", str(plan), "--steps", "2", "--samples", "2", "--val-samples", "1", "--sample-len", "8"])
    assert rc == 2 and "model.layers.9.mlp.up_proj" in capsys.readouterr().err


def test_spear_calibrate_blockwise(sharp_tiny_llama_path, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPEAR_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "ck"
    rc = main(["-q", "calibrate", "--model", str(sharp_tiny_llama_path), "--out", str(out), "--bits", "3",
               "--rank", "2", "--blockwise", "--layer-steps", "5", "--samples", "4", "--val-samples", "2",
               "--sample-len", "16"])
    assert rc == 0
    assert "blockwise: mean layer output error" in capsys.readouterr().out
    meta = json.loads((out / "spear_config.json").read_text())["meta"]
    assert meta["calibration"]["mode"] == "blockwise" and len(meta["report"]["layers"]) == 2
    assert meta["calibration"]["tune_scales"] is False and meta["calibration"]["tune_norms"] is False
    model, _ = load_model(out)
    assert model.model.layers[0].mlp.down_proj.compensator.rank == 2


def test_spear_calibrate_with_a_w8_head(sharp_tiny_llama_path, tmp_path, monkeypatch, capsys):
    """--lm-head-bits 8: the body at --bits, the head W8 per-channel; the head is one more module the
    compensators may be placed on, and the checkpoint keeps both widths."""
    monkeypatch.setenv("SPEAR_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "ck"
    rc = main(["-q", "calibrate", "--model", str(sharp_tiny_llama_path), "--out", str(out), "--bits", "3",
               "--lm-head-bits", "8", "--rank", "2", "--steps", "4", "--samples", "4", "--val-samples", "2",
               "--sample-len", "16"])
    assert rc == 0
    assert "15 ECs" in capsys.readouterr().out
    quant = json.loads((out / "spear_config.json").read_text())["quant"]
    assert quant["include_lm_head"] and quant["head_bits"] == 8
    model, _ = load_model(out)
    assert model.lm_head.bits == 8 and model.model.layers[0].mlp.down_proj.bits == 3
    assert model.lm_head.compensator is not None and dict(model.lm_head.named_parameters(recurse=False)) == {}


def test_diverged_calibration_exits_2_with_one_line_and_writes_nothing(sharp_tiny_llama_path, tmp_path,
                                                                      monkeypatch, capsys):
    """A learning rate that blows the ECs up makes the KL non-finite: exit code 2, one line on stderr
    naming the step, and neither --out nor a temporary folder beside it.

    Catches: the training loop's ``raise _diagnose(...)`` on a non-finite loss turned into ``break``
    (the CLI then saves the initial ECs and exits 0; the old CLI tests never diverged), and, before
    ``-q`` silenced transformers' weight-loading bar, a second stderr line."""
    monkeypatch.setenv("SPEAR_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "runs" / "ck"
    out.parent.mkdir()
    rc = main(["-q", "calibrate", "--model", str(sharp_tiny_llama_path), "--out", str(out), "--bits", "3",
               "--rank", "2", "--lr", "1e30", "--steps", "6", "--samples", "4", "--val-samples", "2",
               "--sample-len", "16"])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, captured.err
    assert lines[0].startswith("spear calibrate: error: calibration diverged at step ") and "Traceback" not in lines[0]
    assert not out.exists() and list(out.parent.iterdir()) == []


def test_scales_and_norms_train_unless_told_or_blockwise(capsys):
    """Catches: the CLI's default of tuning scales and norms lost, --no-tune-* ignored, --blockwise asked to tune
    them accepted (it trains the ECs only)."""
    from spear.cli import build_parser
    from spear.cli.calibrate import calibration_config_from

    def cfg(*extra):
        return calibration_config_from(build_parser().parse_args(["calibrate", "--model", "m", "--out", "o", *extra]))

    assert (cfg().tune_scales, cfg().tune_norms) == (True, True)
    assert (cfg("--no-tune-scales").tune_scales, cfg("--no-tune-scales").tune_norms) == (False, True)
    assert (cfg("--no-tune-norms").tune_scales, cfg("--no-tune-norms").tune_norms) == (True, False)
    assert (cfg("--blockwise").tune_scales, cfg("--blockwise").tune_norms) == (False, False)
    run = calibration_config_from(build_parser().parse_args(["run"]))
    assert (run.tune_scales, run.tune_norms) == (True, True)
    assert main(["-q", "calibrate", "--model", "m", "--out", "o", "--blockwise", "--tune-norms"]) == 2
    assert "need end-to-end KL calibration" in capsys.readouterr().err


def test_the_cli_and_the_library_run_one_default_job(sharp_tiny_llama_path, article_text, tmp_path, monkeypatch):
    """`spear run` with no options and ``pipeline.run_job`` with its defaults (no calibration config) run the
    same job: the same static rows, SPEAR variants, placement and calibration settings, which tune the scales
    and norms. Catches: a default kept in the CLI only (the CLI turning scale and norm tuning on where the
    library's CalibrationConfig leaves it off, as before), or run_job defaulting to no SPEAR row."""
    import inspect

    import spear.pipeline as pipeline
    from spear.cli import build_parser
    from spear.cli.calibrate import calibration_config_from
    from spear.cli.common import eval_config_from, quant_config_from
    from spear.cli.run import SPEAR_VARIANTS, parse_methods
    from spear.compensate.calib_config import CalibrationConfig
    from spear.config import EvalConfig, QuantConfig

    args = build_parser().parse_args(["run"])
    cli_cfg = calibration_config_from(args)
    assert cli_cfg == CalibrationConfig() and cli_cfg.tune_scales and cli_cfg.tune_norms
    assert quant_config_from(args) == QuantConfig() and eval_config_from(args) == EvalConfig()
    lib = inspect.signature(pipeline.run_job).parameters
    assert tuple(parse_methods(args.baselines)) == tuple(lib["static_methods"].default) == ("lqer", "qera-approx")
    assert SPEAR_VARIANTS[args.spear] == lib["spear_variants"].default == ("nogate",)
    assert lib["calib_cfg"].default is None and (args.rank, args.plan) == (None, None)
    for name in ("budget", "placement", "damage_samples", "tp"):
        assert getattr(args, name) == lib[name].default, name

    # what run_job hands the calibration when given no config: the CLI's, resolved for the model
    seen = []

    class Stop(Exception):
        pass

    def record(model, tokenizer, cfg, *a, **k):
        seen.append(cfg)
        raise Stop

    monkeypatch.setattr(pipeline, "prepare_calibration", record)
    text = tmp_path / "wiki.test.raw"
    text.write_text(article_text)
    with pytest.raises(Stop):
        pipeline.run_job(str(sharp_tiny_llama_path), QuantConfig(), EvalConfig(text=str(text), seq_len=32,
                                                                                eval_windows=1, calib_windows=1),
                         progress=False, log=lambda *_: None)
    model, _ = load_model(sharp_tiny_llama_path)
    assert seen == [cli_cfg.for_model(model)]
