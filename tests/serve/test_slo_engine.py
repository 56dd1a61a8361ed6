"""The engine under a latency target with a synthetic table of its own deployment: the chunks the
table dictates, the same greedy tokens as the static budget, the per-step record, /metrics, and
tables of another deployment or bad settings refused."""

import dataclasses
import math
import re
import time
from fractions import Fraction

import pytest

from spear.errors import SpearError
from spear.serve import EngineConfig, LLMEngine, SamplingParams
from spear.serve.latency.table import LatencyTable
from spear.serve.frontend.metrics import ServingMetrics

# The synthetic table's times and the target are SCALE times a small formula's, so that the chunks it
# allows do not depend on SCALE while any CPU's steps (3-20 ms for this model) stay well under its prices
SCALE = 4
TARGET, MARGIN = 20.0 * SCALE, 0.25


def table_for(deployment):
    # d decodes and c prefill tokens (a step of T = d + c tokens) take SCALE (4 + d/4 + c/8 + L/1024) ms:
    # at TARGET / 1.25 one decode leaves room for ~94 tokens; linear from T = 9 on, so exact there
    f = lambda d, t, L: SCALE * (4 + d / 4 + (t - d if t else 0) / 8 + L / 1024)  # noqa: E731
    decodes, tokens, contexts = (1, 8), (0, 9, 64, 256), (1, 1024)
    return LatencyTable(decodes, tokens, contexts, [[[f(d, t, L) for L in contexts] for t in tokens]
                                                    for d in decodes], MARGIN, deployment)


def table_ms(rec) -> float:
    """The synthetic table's price of a step record: mixed steps below T = 9 tokens are held at 9
    (the table's first mixed size); decode-only steps are its T = 0 row."""
    chunk = rec.prefill_tokens and max(rec.prefill_tokens, 9 - rec.num_decodes)
    return SCALE * (4 + rec.num_decodes / 4 + chunk / 8 + rec.decode_context / 1024)


def allowed(d, ctx: Fraction, ceiling):
    fit = math.floor(8 * (Fraction(TARGET) / Fraction(5, 4) / SCALE - 4 - Fraction(d, 4) - ctx / 1024))
    return min(ceiling - d, max(16, fit))


@pytest.fixture(scope="module")
def static_engine(tiny_llama_path):
    return LLMEngine.from_pretrained(str(tiny_llama_path), EngineConfig(max_num_seqs=4, max_num_batched_tokens=256))


def _run(engine, prompts, metrics=None, pause_s=0.0):
    """Serve ``prompts`` to the end (the caller works ``pause_s`` between steps); (tokens, records)."""
    records = []
    rids = [engine.add_request(p, SamplingParams(max_tokens=6, temperature=0)) for p in prompts]
    final = {}
    while engine.has_unfinished():
        if records:
            time.sleep(pause_s)
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.output_token_ids
        records.append(engine.core.last_step)
        if metrics is not None:  # as the server's frontend does with each step's message
            metrics.observe_step(engine.core.last_step, engine.core.scheduler.itl_slo_ms)
            metrics.set_stats(engine.stats())
            metrics.set_stats(engine.stats())  # the state read again at another scrape: counted once
    return [final[r] for r in rids], records


def test_the_engine_schedules_the_chunks_the_table_allows(static_engine, tiny_llama_path):
    table = table_for(static_engine.core.deployment)
    engine = LLMEngine.from_pretrained(str(tiny_llama_path), EngineConfig(
        max_num_seqs=4, max_num_batched_tokens=256, itl_slo_ms=TARGET, latency_table=table, latency_correction=False))
    prompts = [[(7 * i + j) % 1000 + 1 for j in range(n)] for i, n in enumerate((30, 300, 250))]
    want, _ = _run(static_engine, prompts)
    metrics = ServingMetrics()
    got, records = _run(engine, prompts, metrics)
    assert got == want  # chunk sizes change the schedule, never the tokens

    limited = 0
    for rec in records:
        if rec.num_decodes == 0:
            assert rec.predicted_ms is None and rec.chunk_budget == 256
            continue
        ctx = Fraction(rec.decode_context).limit_denominator(16)
        assert rec.chunk_budget == allowed(rec.num_decodes, ctx, 256) and rec.prefill_tokens <= rec.chunk_budget
        assert rec.predicted_ms == pytest.approx(table_ms(rec))
        limited += rec.prefill_tokens == rec.chunk_budget < 256 - rec.num_decodes
    assert limited >= 2  # the 300- and 250-token prompts were cut to the table's chunk beside decodes
    assert [r.index for r in records] == list(range(1, len(records) + 1)) and all(r.measured_ms > 0 for r in records)

    text = metrics.render().decode()
    value = lambda name: float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))  # noqa: E731
    predicted = [r for r in records if r.predicted_ms is not None]
    assert value("spear_itl_slo_seconds") == TARGET / 1e3
    assert value("spear_step_seconds_count") == len(records)
    assert value("spear_step_prefill_tokens_sum") == sum(r.prefill_tokens for r in records)
    assert value("spear_step_predicted_seconds_count") == len(predicted)
    assert value("spear_step_predicted_seconds_sum") == pytest.approx(sum(r.predicted_ms for r in predicted) / 1e3)
    assert value("spear_steps_over_slo_total") == sum(r.num_decodes > 0 and r.interval_ms > TARGET for r in records)
    last = predicted[-1]
    assert value("spear_step_prediction_error_ratio") == pytest.approx(
        (last.interval_ms - last.predicted_ms) / last.predicted_ms)
    assert value("spear_step_chunk_budget_tokens") == records[-1].chunk_budget


def test_the_correction_learns_the_measured_steps_and_moves_the_chunks(static_engine, tiny_llama_path):
    """With the correction on, each prediction is the table's times (1 + the running residual of
    its kind: 0 decode-only, 1 mixed on the CPU) over the steps before it, learned from the steps'
    intervals (the caller works 2 ms between steps), and each chunk budget is the table's under the
    target divided by the mixed kind's factor; replayed here from the step records with the
    synthetic formula. The CPU steps take 3-20 ms against the table's ~60: the residuals fall and
    the chunks grow beyond the table's.
    Catches: a correction not fed by the engine, applied to the wrong kind, learned from the
    corrected prediction instead of the table's, or from the step's wall time instead of its interval."""
    engine = LLMEngine.from_pretrained(str(tiny_llama_path), EngineConfig(
        max_num_seqs=4, max_num_batched_tokens=256, itl_slo_ms=TARGET, latency_table=table_for(static_engine.core.deployment)))
    prompts = [[(5 * i + j) % 900 + 1 for j in range(n)] for i, n in enumerate((20, 400, 400, 300))]
    want, _ = _run(static_engine, prompts)
    metrics = ServingMetrics()
    got, records = _run(engine, prompts, metrics, pause_s=0.002)
    assert got == want
    residual = {0: 0.0, 1: 0.0}
    for rec in records:
        if rec.num_decodes == 0:
            continue
        kind = 0 if rec.prefill_tokens == 0 else 1
        price = table_ms(rec)
        assert rec.predicted_ms == pytest.approx(price * (1 + residual[kind]), rel=1e-9)
        fit = math.floor(8 * (TARGET / (1.25 * (1 + residual[1])) / SCALE - 4 - rec.num_decodes / 4
                              - rec.decode_context / 1024))
        assert rec.chunk_budget == min(256 - rec.num_decodes, max(16, fit))
        r = min(max(rec.interval_ms / price - 1, -0.5), 1.0)
        residual[kind] += 0.1 * (r - residual[kind])
    assert engine.core.scheduler.correction.residual == pytest.approx({k: v for k, v in residual.items() if v})
    text = metrics.render().decode()  # /metrics: the running residual of each kind
    for kind, v in engine.core.scheduler.correction.residual.items():
        got_v = float(re.search(rf'^spear_latency_correction_ratio{{step_tokens="{kind}"}} (\S+)$', text, re.M).group(1))
        assert got_v == pytest.approx(v)
    # faster than the table: chunks beyond what the table alone allows
    assert residual[1] < -0.2 and any(r.num_decodes and r.chunk_budget > allowed(
        r.num_decodes, Fraction(r.decode_context).limit_denominator(16), 256) for r in records)


def test_a_steps_interval_counts_the_callers_work_since_the_last_step_not_idle_time(static_engine):
    """A step's interval runs from the previous step's end while the engine went straight on (it left
    requests unfinished): the caller's 20 ms between steps are in it, on top of the step's wall time.
    The first step, and the first after the engine ran out of work (then idled 50 ms), count their
    wall time alone.
    Catches: an interval from the step's start (the caller's work lost), or one that counts idling."""
    _, records = _run(static_engine, [[5] * 40, [6] * 9], pause_s=0.02)
    first, rest = records[0], records[1:]
    assert first.interval_ms == first.measured_ms
    assert rest and all(20 <= r.interval_ms - r.measured_ms < 20 + 250 for r in rest)
    time.sleep(0.05)
    _, again = _run(static_engine, [[7] * 12], pause_s=0.0)
    assert again[0].interval_ms == again[0].measured_ms


def test_a_table_alone_predicts_without_changing_the_schedule(static_engine, tiny_llama_path):
    engine = LLMEngine.from_pretrained(str(tiny_llama_path), EngineConfig(
        max_num_seqs=4, max_num_batched_tokens=256, latency_table=table_for(static_engine.core.deployment)))
    prompts = [[3] * 200, [4] * 50]
    want, static = _run(static_engine, prompts)
    got, records = _run(engine, prompts)
    assert got == want
    assert [(r.num_decodes, r.prefill_tokens) for r in records] == [(r.num_decodes, r.prefill_tokens) for r in static]
    assert all(r.chunk_budget is None for r in records)
    assert all((r.predicted_ms is None) == (r.num_decodes == 0) for r in records)


def test_tables_of_another_deployment_and_bad_settings_are_refused(static_engine, tiny_llama_path, tmp_path):
    dep = dataclasses.replace(static_engine.core.deployment, device="NVIDIA H200")
    with pytest.raises(SpearError, match="measured on another deployment: device 'NVIDIA H200'"):
        LLMEngine.from_pretrained(str(tiny_llama_path), EngineConfig(itl_slo_ms=TARGET, latency_table=table_for(dep)))
    path = table_for(dataclasses.replace(static_engine.core.deployment, block_size=32)).save(tmp_path / "t.json")
    with pytest.raises(SpearError, match=r"t.json was measured on another deployment: block_size 32"):
        LLMEngine.from_pretrained(str(tiny_llama_path), EngineConfig(itl_slo_ms=TARGET, latency_table=str(path)))
    for bad, message in [(dict(itl_slo_ms=0), "itl_slo_ms must be a finite number"),
                         (dict(itl_slo_ms=float("nan")), "itl_slo_ms"), (dict(min_chunk_tokens=0), "min_chunk_tokens"),
                         (dict(latency_table=3), "latency_table must be a LatencyTable or a path"),
                         (dict(latency_correction=1), "latency_correction must be True or False")]:
        with pytest.raises(SpearError, match=message):
            EngineConfig(**bad)


def test_cli_latency_flags(tiny_llama_path, tmp_path, capsys):
    from spear.cli import main

    (tmp_path / "bad.json").write_text("{}")
    assert main(["-q", "generate", "--model", str(tiny_llama_path), "--prompt", "x", "--itl-slo-ms", "20",
                 "--latency-table", str(tmp_path / "bad.json")]) == 2
    assert "format must be 'spear-latency-table'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # argparse's own check
        main(["-q", "generate", "--model", str(tiny_llama_path), "--prompt", "x", "--itl-slo-ms", "-3"])
    assert exc.value.code == 2 and "--itl-slo-ms: expected a finite number > 0" in capsys.readouterr().err
