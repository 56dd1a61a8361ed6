"""The engine core's protocol: every message between a frontend and the core, as msgspec Structs.

In process (frontend/client.py, ``InProcClient``) the structs are handed over as objects; between
processes (``spear serve``) they travel as msgpack on the link's socket pairs, tagged by class,
numbered and signed with the server's secret (core/wire.py), and a message that does not decode to
one of these types is dropped. The types are the protocol; there is no other description of it.

    frontend -> core   CoreRequest, Abort, Stop
    core -> frontend   Loaded (CoreFacts: what requests are checked against), Ready, Failed, and per
                       engine step one CoreOutputs: every request's new token ids, the requests the
                       core took since the last one and those it refused
    core -> frontend   CoreHealth every HEARTBEAT_S on a socket of its own (core/process.py)

Every field's type and range are declared here (``Meta``), and the integers fit 64 bits, which is
what msgpack carries: frontend/processor.py checks a request against these declarations once,
before it goes to the core.
"""

from __future__ import annotations

import sys
from typing import Annotated, Literal, Union

import msgspec
from msgspec import Meta

I64_MAX = 2**63 - 1
# torch.Generator.manual_seed takes [-2**63, 2**64 - 1]; msgpack carries the same range
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
# Temperatures below this sample as greedy: logits / T overflows fp32 for T of order 1e-38, and a
# distribution that sharp is the argmax anyway (vLLM uses the same cut).
GREEDY_BELOW_TEMPERATURE = 1e-5

Count = Annotated[int, Meta(ge=0, le=I64_MAX)]


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How to pick tokens and when to stop. ``temperature`` below ``GREEDY_BELOW_TEMPERATURE`` (0
    included) is greedy decoding; ``top_k`` 0 is no cut, and a cut beyond the vocabulary is none
    either; ``stop`` strings end the output before their first occurrence (the frontend applies
    them: the core sees token ids only). The ranges are checked by frontend/processor.py when a
    request is added, not here; the core's requests always carry a ``max_tokens``."""

    max_tokens: Annotated[int, Meta(ge=1, le=I64_MAX)] | None = 16  # None: as many as the context leaves
    temperature: Annotated[float, Meta(ge=0, le=sys.float_info.max)] = 1.0
    top_p: Annotated[float, Meta(gt=0, le=1)] = 1.0
    top_k: Count = 0
    # None: the engine's generator. msgspec bounds only int64 ranges: the processor checks SEED_MAX
    seed: Annotated[int, Meta(ge=SEED_MIN)] | None = None
    stop: tuple[Annotated[str, Meta(min_length=1)], ...] = ()
    stop_token_ids: tuple[Count, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE


# ---------------------------------------------------------------------------------- frontend -> core
class CoreRequest(msgspec.Struct, tag=True, array_like=True, frozen=True, gc=False):
    """A request the input processor checked: token ids within the vocabulary, a prompt that leaves
    ``params.max_tokens`` in the context. ``arrival_time`` is time.monotonic() (one clock for every
    process of the host)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float


class Abort(msgspec.Struct, tag=True, array_like=True, frozen=True):
    request_ids: list[str]


class Stop(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """Stop serving: the core stops its tensor-parallel ranks and exits."""


# ---------------------------------------------------------------------------------- core -> frontend
class StepRecord(msgspec.Struct, frozen=True, kw_only=True):
    """What a step ran, the latency table's prediction for it, its wall time (schedule, model,
    sampling and outputs) and its interval: the time since the previous step's end when the engine
    went straight on (it left requests unfinished), else the wall time. The interval is what the
    decodes' next tokens waited for, the caller's work between steps included (admitting requests,
    streaming outputs); the latency target and its correction are on it."""

    num_tokens: int                      # scheduled tokens
    num_seqs: int                        # scheduled sequences
    decode_only: bool
    seconds: float                       # wall time
    index: int = 0                       # steps run so far, this one included
    num_decodes: int = 0
    prefill_tokens: int = 0
    decode_context: float = 0.0          # the decodes' mean context in tokens (0 without decodes)
    chunk_budget: int | None = None      # prefill tokens the latency target allowed (None: no target)
    predicted_ms: float | None = None    # None without a table or without decodes
    interval_s: float | None = None      # None: the wall time (the first step, or one after idling)

    @property
    def measured_ms(self) -> float:
        return 1e3 * self.seconds

    @property
    def interval_ms(self) -> float:
        return 1e3 * (self.seconds if self.interval_s is None else self.interval_s)


class CoreOutput(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One request's progress in one step: its new token ids; ``finish_reason`` once it ended in
    the core ("stop": EOS or a stop token id, "length", "error" with ``error`` saying why)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: Literal["stop", "length", "error"] | None = None
    error: str | None = None


class Rejection(msgspec.Struct, array_like=True, frozen=True):
    request_id: str
    reason: Literal["queue_full", "invalid"]
    message: str


class CoreOutputs(msgspec.Struct, tag=True, array_like=True, frozen=True, gc=False):
    """What the core sends after taking requests and after each step: every request's progress, the
    requests taken since the last message and those refused; ``timestamp`` (time.monotonic()) is
    when it was sent, ``step`` the record of the step that made the outputs."""

    outputs: list[CoreOutput] = []
    accepted: list[str] = []
    rejected: list[Rejection] = []
    timestamp: float = 0.0
    step: StepRecord | None = None


class EngineStats(msgspec.Struct, frozen=True, kw_only=True):
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0              # fraction of KV blocks in use
    num_free_blocks: int = 0
    num_preemptions: int = 0
    num_failed_steps: int = 0          # steps in a row that failed every request they ran (0 after a good one)
    num_steps: int = 0
    last_step: StepRecord | None = None
    itl_slo_ms: float | None = None
    # the latency table's online correction: kind of step -> running (measured / predicted - 1)
    latency_correction: dict[int, float] = {}


class LatencyFacts(msgspec.Struct, frozen=True, kw_only=True):
    created: str                       # when the table was measured
    device: str
    margin: float


class CoreFacts(msgspec.Struct, frozen=True, kw_only=True):
    """What the engine is: what requests are checked against, and what ``spear serve`` reports."""

    max_model_len: int
    vocab_size: int
    eos_ids: list[int]
    num_blocks: int
    block_size: int
    tensor_parallel_size: int = 1
    load_report: list[tuple[str, str]] = []   # (layer, why it runs off the kernel path)
    itl_slo_ms: float | None = None
    min_chunk_tokens: int = 16
    latency: LatencyFacts | None = None
    torch_threads: int = 1


class Loaded(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """The model is in place; the warm-up starts."""

    facts: CoreFacts


class Ready(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """Requests are served from now on."""

    warmup_s: float


class Failed(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """The engine could not start; the core exits."""

    message: str


class CoreHealth(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """The heartbeat: sent whatever the engine is doing, so that a step that runs too long, a core
    that stopped and one that is quiet can be told apart."""

    ready: bool
    step_started: float | None          # time.monotonic() when the running step began; None between steps
    failed_steps: int
    last_failure: str | None
    stats: EngineStats | None
    # the server's frames the core dropped so far, by reason ("malformed", "replayed"; core/wire.py)
    frames_dropped: dict[str, int] = {}


ToCore = Union[CoreRequest, Abort, Stop]
FromCore = Union[CoreOutputs, Loaded, Ready, Failed]
