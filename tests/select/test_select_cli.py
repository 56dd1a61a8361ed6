import json

import pytest

from spear.cli import main
from spear.models.loading import load_model


def test_select_writes_plan_and_picture_and_calibrate_consumes_it(sharp_tiny_llama_path, tmp_path, monkeypatch,
                                                                   capsys):
    monkeypatch.setenv("SPEAR_CACHE", str(tmp_path / "cache"))
    sel = tmp_path / "sel"
    assert main(["-q", "select", "--model", str(sharp_tiny_llama_path), "--out", str(sel), "--bits", "3",
                 "--budget", "4%", "--damage-samples", "2"]) == 0
    assert "plan.json" in capsys.readouterr().out
    data = json.loads((sel / "plan.json").read_text())
    assert data["placement"] == "cka-entropy-cost" and data["bytes"] <= data["budget_bytes"]
    assert set(data["damage"]) == {f"model.layers.{i}.{m}" for i in range(2) for m in
                                   ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert data["damage_tokens"] == 2 * 128 and 0 < data["evenness"] <= 1
    assert (sel / "selection.png").stat().st_size > 5000
    ck = tmp_path / "ck"
    assert main(["-q", "calibrate", "--model", str(sharp_tiny_llama_path), "--out", str(ck), "--bits", "3",
                 "--plan", str(sel), "--steps", "2", "--samples", "2", "--val-samples", "1",
                 "--sample-len", "8"]) == 0
    meta = json.loads((ck / "spear_config.json").read_text())["meta"]
    assert meta["plan"] == data["plan"]
    model, _ = load_model(ck)
    ranks = {n: m.compensator.rank for n, m in model.named_modules() if getattr(m, "compensator", None) is not None}
    assert ranks == data["plan"]


def test_select_rejects_rank_and_bad_budget(sharp_tiny_llama_path, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:  # select places by budget only
        main(["-q", "select", "--model", str(sharp_tiny_llama_path), "--out", str(tmp_path / "s"), "--rank", "2"])
    assert exc.value.code == 2 and "unrecognized arguments: --rank" in capsys.readouterr().err
    assert main(["-q", "select", "--model", str(sharp_tiny_llama_path), "--out", str(tmp_path / "s"),
                 "--budget", "lots"]) == 2
    assert "budget" in capsys.readouterr().err
