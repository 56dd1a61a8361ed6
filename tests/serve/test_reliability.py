"""No request can hurt the engine, the server or other requests.

Engine level: a request is validated whole before anything of it is queued; a step that
fails (the model raising on one request, a row of non-finite logits, a sampled id the
tokenizer cannot decode) fails that request alone, and the others' greedy tokens equal a
clean run's. The server level is in test_reliability_server.py.
"""

from __future__ import annotations

import pytest
import torch

from spear.errors import SpearError
from spear.serve import LLMEngine, SamplingParams
from spear.serve.core.sampling import sample
from spear.serve.core.scheduler import QueueFull
from spear.serve.frontend.processor import check_params
from tests.serve.conftest import make_engine

PROMPTS = ["Hello there", "The capital of France is", "Once upon a time", "def f(x):"]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def clean(tiny):
    """Greedy tokens of PROMPTS on an engine nothing goes wrong in."""
    return [o.output_token_ids for o in make_engine(tiny).generate(PROMPTS, GREEDY)]


def run_all(eng: LLMEngine, prompts, params) -> dict[str, object]:
    """Add every prompt, step to the end; request id -> final output."""
    rids = [eng.add_request(p, params) for p in prompts]
    final = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
    assert eng.stats().kv_usage == 0.0 and not eng.core._seqs and not eng.core._generators
    return {r: final[r] for r in rids}


# ---------------------------------------------------------------------- parameters
@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 2**70, 1.5, True])
def test_seeds_torch_cannot_take_are_refused_up_front(seed):
    """Catches: a seed range check dropped (torch raises inside the engine after queuing)."""
    with pytest.raises(SpearError, match="seed"):
        check_params(SamplingParams(seed=seed))


@pytest.mark.parametrize("seed", [2**64 - 1, -(2**63), 0])
def test_seeds_at_the_edges_of_the_range_work(tiny, seed):
    eng = make_engine(tiny)
    out = eng.generate(["Hi"], SamplingParams(max_tokens=2, seed=seed))[0]
    assert out.num_output_tokens == 2


@pytest.mark.parametrize("kw", [dict(temperature=float("nan")), dict(temperature=float("inf")),
                                dict(top_p=float("nan")), dict(max_tokens=2.0), dict(stop=("",)),
                                dict(stop_token_ids=(-1,))])
def test_non_finite_and_mistyped_params_are_refused(kw):
    with pytest.raises(SpearError):
        check_params(SamplingParams(**kw))


def test_a_request_that_fails_while_queued_leaves_no_trace(tiny, monkeypatch, clean):
    """Catches: the request put in the scheduler before its generator is made (the denial of
    service: every later step raised KeyError on the orphan)."""
    import spear.serve.core.engine as engine_module

    eng = make_engine(tiny)
    monkeypatch.setattr(engine_module, "make_generator", lambda seed: (_ for _ in ()).throw(ValueError("boom")))
    with pytest.raises(ValueError, match="boom"):
        eng.add_request("Hi", SamplingParams(max_tokens=2, seed=1))
    assert not eng.has_unfinished() and not eng.core._seqs and not len(eng.output)
    monkeypatch.undo()
    assert [o.output_token_ids for o in run_all(eng, PROMPTS, GREEDY).values()] == clean


@pytest.mark.parametrize("temperature", [1e-38, 1e-45, 1e-300, 5e-6])
def test_tiny_temperatures_sample_the_argmax(temperature):
    """Catches: logits / T without the shift by the row maximum (inf / inf = NaN in softmax)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g) * 10
    params = [SamplingParams(temperature=temperature, seed=1), SamplingParams(temperature=0.7, seed=2),
              SamplingParams(temperature=1e-4, seed=3)]
    gens = [torch.Generator().manual_seed(s) for s in (1, 2, 3)]
    out = sample(logits, params, gens)
    assert out[0] == int(logits[0].argmax())
    assert all(isinstance(t, int) and 0 <= t < 50 for t in out)
    # 1e-4 is sampled, not greedy, yet that sharp a distribution is the argmax here (gaps >> 1e-4)
    assert out[2] == int(logits[2].argmax())


def test_a_row_of_non_finite_logits_fails_only_its_row():
    logits = torch.randn(4, 20, generator=torch.Generator().manual_seed(0))
    logits[1, 3] = float("nan")
    logits[2, 5] = float("inf")
    logits[3] = float("-inf")
    out = sample(logits, [SamplingParams(temperature=0)] * 2 + [SamplingParams(temperature=1.0, seed=0)] * 2,
                 [None, None, torch.Generator().manual_seed(0), None])
    assert out[0] == int(logits[0].argmax()) and out[1:] == [None, None, None]


# ---------------------------------------------------------------------- failure isolation in steps
def _poison(eng, bad_prompt_ids: list[int], how: str):
    """Make the model fail (raise, or NaN logits) on every step that holds the request whose
    prompt is ``bad_prompt_ids``."""
    real = eng.core.runner.execute

    def execute(sched):
        rows = [c for c in sched.chunks if c.samples]
        holds = [c.seq.prompt_token_ids == bad_prompt_ids for c in sched.chunks]
        if how == "raise" and any(holds):
            raise RuntimeError("device-side assert on this request")
        logits = real(sched)
        if how == "nan":
            logits = logits.clone()  # an inference tensor (and maybe a graph's buffer): write a copy
            for i, c in enumerate(rows):
                if c.seq.prompt_token_ids == bad_prompt_ids:
                    logits[i] = float("nan")
        return logits

    eng.core.runner.execute = execute


@pytest.mark.parametrize("how", ["raise", "nan"])
def test_a_request_the_model_fails_on_fails_alone(tiny, clean, how):
    """Catches: a failed step failing every request of it (one client's request killed others'),
    and rows put back in the wrong order after the retry in parts."""
    eng = make_engine(tiny)
    bad = "this one breaks the model"
    _poison(eng, eng.tokenize(bad), how)
    outs = run_all(eng, PROMPTS[:2] + [bad] + PROMPTS[2:], GREEDY)
    results = list(outs.values())
    assert results[2].finish_reason == "error" and results[2].error
    assert ("device-side assert" in results[2].error) == (how == "raise")
    assert [o.output_token_ids for o in results[:2] + results[3:]] == clean
    assert all(o.error is None for o in results[:2] + results[3:])
    assert eng.stats().num_failed_steps == 0


def test_a_token_the_tokenizer_cannot_decode_fails_only_its_request(tiny, clean):
    eng = make_engine(tiny)
    rid_bad = eng.add_request("undecodable", GREEDY)

    def add(tok):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    eng.output._states[rid_bad].detok.add = add
    rids = [eng.add_request(p, GREEDY) for p in PROMPTS]
    final = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
    assert final[rid_bad].finish_reason == "error" and "UnicodeDecodeError" in final[rid_bad].error
    assert [final[r].output_token_ids for r in rids] == clean
    assert eng.stats().kv_usage == 0.0 and not eng.core._seqs and not len(eng.output)


def test_steps_that_fail_everyone_are_counted(tiny):
    eng = make_engine(tiny)
    eng.core.runner.execute = lambda sched: (_ for _ in ()).throw(RuntimeError("GPU fell off the bus"))
    for i in range(3):
        eng.add_request(f"request {i}", GREEDY)
        while eng.has_unfinished():
            eng.step()
    assert eng.stats().num_failed_steps == 3


def test_requests_that_fail_alone_do_not_count_as_failing_steps(tiny):
    """Three requests in a row whose logits are non-finite (each alone in its step) fail, but the
    model ran: /health must not turn 503 for them. Catches: counting a step as failed whenever every
    output in it is an error (a client could then flip the server's health)."""
    eng = make_engine(tiny)
    for i in range(3):
        bad = f"bad request {i}"
        _poison(eng, eng.tokenize(bad), "nan")
        out = run_all(eng, [bad], GREEDY)
        assert list(out.values())[0].finish_reason == "error"
        assert eng.stats().num_failed_steps == 0


def test_a_prompt_that_is_not_valid_unicode_is_refused_before_queuing(tiny):
    """Catches: a lone surrogate reaching the tokenizer (a TypeError, not a one-line SpearError)."""
    eng = make_engine(tiny)
    with pytest.raises(SpearError, match="not valid Unicode text"):
        eng.add_request("a\ud800b", GREEDY)
    assert not eng.core._seqs and not eng.has_unfinished()


def test_queue_bound_counts_the_free_slots():
    """A burst that arrives between two steps fills the free sequence slots, then max_waiting
    more: 8 slots + 2 waiting = 10 accepted, the 11th refused. Catches: the old bound, which
    refused the burst after max_waiting requests with every slot free."""
    from spear.serve.core.block_manager import BlockManager
    from spear.serve.core.scheduler import Scheduler
    from spear.serve.core.sequence import Sequence

    sched = Scheduler(BlockManager(64, 16), max_num_seqs=8, max_num_batched_tokens=64, max_waiting=2)
    for i in range(10):
        sched.add(Sequence(f"r{i}", [1, 2, 3], GREEDY))
    with pytest.raises(QueueFull):
        sched.add(Sequence("r10", [1, 2, 3], GREEDY))
    out = sched.schedule()
    assert len(out.chunks) == 8 and len(sched.waiting) == 2
    with pytest.raises(QueueFull):  # every slot busy now: only max_waiting may wait
        sched.add(Sequence("r11", [1, 2, 3], GREEDY))


# ---------------------------------------------------------------------- the sampler's rows
def test_a_top_k_beyond_the_vocabulary_is_no_cut_and_fails_nobody(tiny, clean):
    """Catches: a top_k at the top of its range overflowing the sampler's int64 tensor, which failed
    every request of the step (the sender got a 500, its neighbours too, three such requests turned
    /health 503). A cut beyond the vocabulary is no cut."""
    eng = make_engine(tiny)
    huge = SamplingParams(max_tokens=8, temperature=0.7, top_k=2**63 - 1, seed=3, ignore_eos=True)
    rids = [eng.add_request(p, GREEDY) for p in PROMPTS] + [eng.add_request("Hello there", huge)]
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    assert [outs[r].output_token_ids for r in rids[:-1]] == clean
    assert outs[rids[-1]].finish_reason == "length" and outs[rids[-1]].error is None
    plain = make_engine(tiny).generate(["Hello there"], SamplingParams(max_tokens=8, temperature=0.7, seed=3,
                                                                       ignore_eos=True))[0]
    assert outs[rids[-1]].output_token_ids == plain.output_token_ids


def test_a_row_the_sampler_cannot_take_fails_alone(monkeypatch):
    """Whatever field makes the batch's pass raise, each row is then sampled on its own: the row
    that still raises gives None (its request fails alone), the others their tokens."""
    from spear.serve.core import sampling

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=0.8, seed=2),
              SamplingParams(temperature=0)]
    want = sample(logits, params, [sampling.make_generator(p.seed) for p in params])
    real = sampling._sample

    def fragile(lg, ps, gens):
        if any(p.seed == 2 for p in ps):
            raise RuntimeError("a setting the step cannot hold")
        return real(lg, ps, gens)

    monkeypatch.setattr(sampling, "_sample", fragile)
    got = sample(logits, params, [sampling.make_generator(p.seed) for p in params])
    assert got == [want[0], None, want[2]]


def test_every_bit_of_a_64_bit_seed_counts():
    """Catches: torch's CPU generator keeping only the low 32 bits of a seed, so that seeds 7 and
    7 + 2**40 drew the same tokens."""
    from spear.serve.core.sampling import make_generator

    p = torch.full((1000,), 1e-3)
    draws = {s: torch.multinomial(p, 8, generator=make_generator(s)).tolist()
             for s in (7, 7 + 2**32, 7 + 2**40, 7 + 2**63, -7)}
    assert len({tuple(v) for v in draws.values()}) == len(draws)
    assert torch.multinomial(p, 8, generator=make_generator(7)).tolist() == draws[7]  # still reproducible


def test_generate_refuses_an_engine_holding_other_requests(tiny):
    """Catches: generate() beside a request queued with add_request raising KeyError (it consumed
    that request's outputs as its own). It now refuses with a message saying what to do, and the
    other request is untouched."""
    eng = make_engine(tiny)
    rid = eng.add_request("Hello there", GREEDY)
    with pytest.raises(SpearError, match="idle engine"):
        eng.generate(["The capital of France is"], GREEDY)
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    assert outs[rid].num_output_tokens == 8
    assert eng.generate(["Hi"], SamplingParams(max_tokens=2))[0].num_output_tokens == 2
