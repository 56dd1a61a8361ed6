"""The profiler on the CPU: `spear profile --tiny` on a tiny random Llama writes a table that
validates, is found again by an engine of the same deployment, and holds steps of the wanted
composition at the wanted contexts; the start-up hook profiles once and then reads the cache;
`--ec-costs` times compensators on a W4 checkpoint."""

import pytest

from spear.cli import main
from spear.errors import SpearError
from spear.serve import EngineConfig, LLMEngine, SamplingParams
from spear.serve.latency.table import cache_path, load_table
from spear.serve.latency.profiler import TINY_GRID, Grid, profile


def test_profile_cli_tiny_writes_a_table_the_engine_finds(tiny_llama_path, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPEAR_CACHE", str(tmp_path))
    assert main(["-q", "profile", "--model", str(tiny_llama_path), "--tiny"]) == 0
    assert "the cache" in capsys.readouterr().out
    engine = LLMEngine.from_pretrained(str(tiny_llama_path), EngineConfig(max_num_seqs=4))
    table = load_table(cache_path(engine.core.deployment))  # the same deployment, whatever max_num_seqs
    table.check_for(engine.core.deployment)
    assert (table.decodes, table.tokens, table.contexts) == (TINY_GRID.decodes, TINY_GRID.tokens, TINY_GRID.contexts)
    assert table.profile["repeats"] == 3 and table.deployment.density.modules == 0
    for i, d in enumerate(table.decodes):
        for j, t in enumerate(table.tokens):
            for k, L in enumerate(table.contexts):
                pred = table.predict(d, t, L)
                assert abs(pred - table.step_ms[i][j][k]) <= table.margin * pred  # the measured points come back
                # the timed steps' decodes sat at contexts centred on L
                assert abs(table.profile["observed_context"][i][j][k] - L) <= 1.5
    # an engine with a target takes the cached table as it is: no profile at start-up
    monkeypatch.setattr("spear.serve.latency.profiler.profile", lambda *a, **k: pytest.fail("profiled again"))
    slo = LLMEngine.from_pretrained(str(tiny_llama_path), EngineConfig(itl_slo_ms=1000.0, max_num_seqs=4))
    assert slo.core.scheduler.latency == table and slo.core.scheduler.itl_slo_ms == 1000.0


def test_start_up_profiles_once_when_nothing_is_cached(tiny_llama_path, tmp_path, monkeypatch):
    monkeypatch.setenv("SPEAR_CACHE", str(tmp_path))
    cfg = EngineConfig(itl_slo_ms=50.0, max_num_seqs=3, max_num_batched_tokens=64, max_model_len=512)
    engine = LLMEngine.from_pretrained(str(tiny_llama_path), cfg)
    table = engine.core.scheduler.latency
    # the quick grid fitted to the engine: 2 decodes beside a prefill, steps of 64 tokens (the sizes of
    # DEFAULT_GRID above 2 and below the budget: none), the contexts that fit 512
    assert (table.decodes, table.tokens, table.contexts) == ((1, 2), (0, 64), (256,))
    assert load_table(cache_path(engine.core.deployment)) == table
    assert not engine.has_unfinished() and engine.core.num_steps == 0 and engine.core.last_step is None
    out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0))
    assert len(out[0].output_token_ids) == 3 and engine.core.last_step.index == engine.core.num_steps


def test_profile_refuses_what_it_cannot_measure(tiny_llama_path):
    engine = LLMEngine.from_pretrained(str(tiny_llama_path), EngineConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                                                          max_model_len=256))
    with pytest.raises(SpearError, match=r"max_num_seqs >= 9 .*max_num_batched_tokens >= 72 .*max_model_len >= "):
        profile(engine.core, Grid((8,), (0, 72), (300,)))
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(SpearError, match="idle engine"):
        profile(engine.core, Grid((1,), (0,), (16,)))
    with pytest.raises(SpearError, match="tokens must include 0"):
        Grid((1,), (16,), (16,))
    with pytest.raises(SpearError, match="step sizes must exceed its most decodes"):
        Grid((1, 16), (0, 16), (16,))
    with pytest.raises(SpearError, match="decodes must be increasing"):
        Grid((4, 2), (0,), (16,))


def test_ec_costs_on_a_w4_checkpoint(tiny_llama_path, tmp_path, capsys):
    from spear.select.ec_costs import load_ec_costs

    ckpt = tmp_path / "w4"
    assert main(["-q", "quantize", "--model", str(tiny_llama_path), "--out", str(ckpt), "--group-size", "32"]) == 0
    out = tmp_path / "costs.json"
    assert main(["-q", "profile", "--model", str(ckpt), "--ec-costs", str(out), "--ec-ranks", "1,4",
                 "--repeats", "1"]) == 0
    costs = load_ec_costs(out)
    # q/o 64 x 64, k/v 64 -> 32, gate/up 64 -> 128, down 128 -> 64
    assert set(costs.costs) == {(64, 64), (64, 32), (64, 128), (128, 64)}
    assert all(r == (1, 4) and all(u >= 0 for u in us) for r, us in costs.costs.values())
    assert costs.base_step_us > 0 and "decode step" in costs.base
    assert main(["-q", "profile", "--model", str(tiny_llama_path), "--ec-costs", str(out)]) == 2
    assert "no quantized linear" in capsys.readouterr().err


def test_the_grid_steps_are_every_graph_size_the_scheduler_picks():
    """On CUDA graphs the profile times every mixed-step graph size above the most decodes up to the
    budget (the scheduler picks among them; step time is not linear between sizes); without graphs,
    DEFAULT_GRID's sizes. Catches: sizes at or below the decodes (no prefill token), a missing size."""
    from types import SimpleNamespace

    from spear.serve.model.graphs import mixed_graph_sizes
    from spear.serve.latency.profiler import DEFAULT_GRID, step_sizes

    graphs = SimpleNamespace(scheduler=SimpleNamespace(token_sizes=tuple(mixed_graph_sizes(1024))))
    assert step_sizes(graphs, 63, 1024) == (0, 64, 128, 192, 256, 384, 512, 640, 768, 896, 1024)
    assert step_sizes(graphs, 8, 200) == (0, 16, 32, 64, 128, 192, 200)
    eager = SimpleNamespace(scheduler=SimpleNamespace(token_sizes=None))
    assert step_sizes(eager, 63, 1536) == (0,) + tuple(t for t in DEFAULT_GRID.tokens if 63 < t < 1536) + (1536,)
