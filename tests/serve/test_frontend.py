"""The frontend's own parts: the input processor's checks (every field against its declared type and
range, whatever the field), the wire's codec and signature, and the HTTP server's frontend
(AsyncLLM) over the in-process transport against LLMEngine.

The server in a process of its own, as ``spear serve`` runs it, is in test_server.py and the
tests beside it."""

from __future__ import annotations

import asyncio
import typing

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spear.serve import SamplingParams
from spear.serve.core.messages import SEED_MAX, CoreFacts, CoreOutputs, CoreRequest, FromCore, ToCore
from spear.serve.core.wire import MAC_BYTES, Malformed, Wire
from spear.serve.frontend.processor import InputProcessor, InvalidRequest, check_params
from tests.serve.conftest import make_engine

FACTS = CoreFacts(max_model_len=64, vocab_size=100, eos_ids=[2], num_blocks=8, block_size=8)


def _int_fields() -> list[str]:
    """Every field of SamplingParams that holds an integer (alone, optional or in a tuple)."""
    def holds_int(t) -> bool:
        if isinstance(t, msgspec.inspect.IntType):
            return True
        inner = getattr(t, "types", None) or ([t.item_type] if hasattr(t, "item_type") else [])
        return any(holds_int(x) for x in inner)

    info = msgspec.inspect.type_info(SamplingParams)
    return [f.name for f in info.fields if holds_int(f.type)]


def _with(field: str, value) -> SamplingParams:
    hint = typing.get_type_hints(SamplingParams)[field]
    return SamplingParams(**{field: (value,) if "tuple" in str(hint) else value})


def test_every_integer_field_is_known():
    """The sweep below covers every integer field; a new one joins it by its type."""
    assert _int_fields() == ["max_tokens", "top_k", "seed", "stop_token_ids"]


@pytest.mark.parametrize("field", _int_fields())
@pytest.mark.parametrize("value", [2**64, 2**70, 2**200, -(2**63) - 1, -(2**100)])
def test_integers_beyond_64_bits_are_refused_in_every_field(field, value):
    """Catches: a field whose range reaches past what msgpack carries (top_k >= 2**64 passed and
    failed later, in the wire's encoder): each integer field's range is declared, and checked."""
    with pytest.raises(InvalidRequest) as e:
        check_params(_with(field, value))
    assert e.value.param == field, e.value


@pytest.mark.parametrize("field", _int_fields())
def test_what_the_processor_accepts_the_wire_carries(field):
    """The largest value of every integer field passes and encodes: the declared ranges are the wire's."""
    top = SEED_MAX if field == "seed" else 2**63 - 1
    proc = InputProcessor(FACTS)
    params = _with(field, top) if field != "max_tokens" else SamplingParams(max_tokens=None)
    req = proc.process([1, 2, 3], params, "r", 0.0)
    assert msgspec.msgpack.Decoder(ToCore).decode(Wire(b"k" * 32, ToCore).pack(req)[MAC_BYTES:]) == req


@pytest.mark.parametrize("kw,param", [
    (dict(max_tokens=True), "max_tokens"), (dict(top_k=3.0), "top_k"), (dict(seed=False), "seed"),
    (dict(temperature=float("nan")), "temperature"), (dict(temperature=float("inf")), "temperature"),
    (dict(top_p=float("nan")), "top_p"), (dict(top_p=1.5), "top_p"), (dict(stop=("ok", "")), "stop"),
    (dict(stop=("a\ud800",)), "stop"), (dict(stop_token_ids=(-1,)), "stop_token_ids"),
    (dict(ignore_eos=1), "ignore_eos"), (dict(max_tokens=0), "max_tokens")])
def test_mistyped_and_out_of_range_fields_are_refused_by_name(kw, param):
    with pytest.raises(InvalidRequest) as e:
        check_params(SamplingParams(**kw))
    assert e.value.param == param


def test_the_prompt_and_the_context():
    proc = InputProcessor(FACTS)
    for ids, param in (([], "prompt"), ([100], "prompt"), ([True], "prompt"), ([1.0], "prompt"), ([1] * 64, "prompt")):
        with pytest.raises(InvalidRequest) as e:
            proc.process(ids, SamplingParams(), "r", 0.0)
        assert e.value.param == param
    with pytest.raises(InvalidRequest, match="at most 54 tokens") as e:
        proc.process([1] * 10, SamplingParams(max_tokens=55), "r", 0.0)
    assert e.value.param == "max_tokens"
    assert proc.process([1] * 10, SamplingParams(max_tokens=None), "r", 0.0).params.max_tokens == 54
    assert proc.process([1] * 10, SamplingParams(stop="x"), "r", 0.0).params.stop == ("x",)


# ---------------------------------------------------------------------- the wire
def test_frames_not_signed_with_the_secret_or_not_the_protocols_are_malformed():
    wire, other = Wire(b"s" * 32, FromCore), Wire(b"t" * 32, FromCore)
    msg = CoreOutputs(accepted=["a"], timestamp=1.5)
    assert wire.unpack(wire.pack(msg)) == msg
    for frame in (other.pack(msg), wire.pack(msg)[MAC_BYTES:], b"", b"\x00" * MAC_BYTES + wire.pack(msg)[MAC_BYTES:]):
        with pytest.raises(Malformed, match="not signed"):
            wire.unpack(frame)
    for payload in (msgspec.msgpack.encode(42), msgspec.msgpack.encode([]), b"\xc1"):
        with pytest.raises(Malformed, match="not one of the protocol's"):
            wire.unpack(wire.pack(msgspec.Raw(payload)))
    with pytest.raises(OverflowError):  # what the processor keeps from the wire
        wire.pack(CoreRequest("r", [2**64], SamplingParams(), 0.0))


def test_the_zeromq_client_sends_nothing_the_wire_cannot_carry():
    """A request that escaped the processor and that msgpack cannot carry is refused (400), not
    sent, and not followed: the client raises before anything leaves."""
    from spear.serve import EngineConfig
    from spear.serve.frontend.mp_client import MPClient

    sent = []

    class Socket:
        def send(self, frame, *a, **k):
            sent.append(frame)

    client = MPClient("unused", EngineConfig())
    client._wire, client._out = Wire(b"s" * 32, FromCore), Socket()
    with pytest.raises(InvalidRequest, match="cannot be sent"):
        client.add(CoreRequest("r", [1], SamplingParams(seed=2**70), 0.0))
    assert sent == []


# ---------------------------------------------------------------------- AsyncLLM in process
def test_the_async_frontend_in_process_equals_the_engine(tiny):
    """AsyncLLM over the in-process transport streams what LLMEngine generates, stop strings
    included; a refused request leaves nothing behind."""
    from spear.serve.frontend.async_llm import AsyncLLM
    from spear.serve.frontend.client import InProcClient

    prompts = ["Hello there", "The capital of France is", "Once upon a time"]
    params = SamplingParams(max_tokens=12, temperature=0, stop=(" the",))
    want = make_engine(tiny).generate(prompts, params)
    eng = make_engine(tiny)
    llm = AsyncLLM(InProcClient(eng.core), eng.tokenizer)

    async def run():
        await llm.start()
        try:
            async def one(p):
                text, last = "", None
                async for out in await llm.submit(eng.tokenize(p), params):
                    text, last = text + out.new_text, out
                return text, last.finish_reason, last.num_output_tokens

            got = await asyncio.gather(*[one(p) for p in prompts])
            with pytest.raises(InvalidRequest):
                await llm.submit([10**9], params)
            return got
        finally:
            await llm.shutdown()

    got = asyncio.run(run())
    assert got == [(w.text, w.finish_reason, w.num_output_tokens) for w in want]
    assert not llm._streams and not llm._taking and len(llm.output) == 0 and not eng.has_unfinished()


# ---------------------------------------------------------------------- stop strings while streaming
def _held(text: str, stops) -> int:
    """Brute force: the longest end of ``text`` that a stop string begins with (shorter than it)."""
    return max((k for s in stops for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])),
               default=0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text("abc", min_size=0, max_size=6), min_size=1, max_size=12),
       st.lists(st.text("abc", min_size=1, max_size=7), min_size=1, max_size=4))
def test_the_stop_matcher_against_brute_force(pieces, stops):
    """Fed piece by piece, the matcher finds the earliest start of any stop string as soon as one
    is complete, and holds back exactly the longest end of the text that begins one.
    Catches: a hold of the longest stop string's length, a match missed across pieces, a later
    match preferred to an earlier one of another stop string."""
    from spear.serve.frontend.detokenizer import StopMatcher

    m, text = StopMatcher(tuple(stops)), ""
    for piece in pieces:
        start = len(text)
        text += piece
        hit = m.feed(text, start)
        found = [i for i in (text.find(s) for s in stops) if i != -1]
        assert hit == (min(found) if found else None)
        if found:
            break
        assert m.hold == _held(text, stops)


def _stream(tokenizer, text: str, stop: tuple[str, ...]):
    from spear.serve.frontend.detokenizer import IncrementalDetokenizer

    ids = tokenizer(text, add_special_tokens=False).input_ids
    d = IncrementalDetokenizer(tokenizer, [1, 2, 3], stop)
    deltas, stopped = [], False
    for t in ids:
        stopped = d.add(t)
        deltas.append(d.delta(final=stopped))
        if stopped:
            break
    if not stopped:
        deltas.append(d.delta(final=True))
    return ids, d.text, deltas, stopped


def _whole(tokenizer, ids, stop) -> str:
    """Without streaming: the text of the first token prefix that holds a stop string, cut before its
    earliest one, else the whole text."""
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:k], skip_special_tokens=True)
        found = [i for i in (text.find(s) for s in stop) if i != -1]
        if found:
            return text[:min(found)]
    return text


def test_streamed_text_is_held_back_only_where_a_stop_string_could_begin(tokenizer):
    """Each token's delta is everything up to the longest end of the text that begins a stop
    string, exactly; a 1,024-character stop string that the text never begins holds nothing back
    (it held back the whole answer: one event at the end); a stop string spanning tokens stops
    the text before it; the streamed text equals the text without streaming."""
    text = "The cat sat on the mat. The end of the story is near, said the cat."
    cases = [(("Z" * 1024,), False), (("end of the story",), True), (("the mat", "at. The e"), True),
             ((" cat sat on the hat",), False), (("story is near, said the dog",), False)]
    for stop, stops in cases:
        ids, got, deltas, stopped = _stream(tokenizer, text, stop)
        assert stopped == stops, stop
        assert got == "".join(deltas) == _whole(tokenizer, ids, stop), stop
        shown = ""
        for k, delta in enumerate(deltas[:len(ids)]):
            shown += delta
            if stopped and k == len(deltas) - 1:
                break
            so_far = tokenizer.decode(ids[:k + 1], skip_special_tokens=True)
            assert shown == so_far[:len(so_far) - _held(so_far, stop)], (stop, k)
    _, _, deltas, _ = _stream(tokenizer, text, ("Z" * 1024,))
    assert all(deltas[:-1]) and deltas[0] == "The"   # every token's text at once, nothing held to the end
