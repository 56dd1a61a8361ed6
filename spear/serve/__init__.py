"""Serving: a continuous-batching engine over a paged KV cache and an OpenAI-compatible server.

    Python: LLMEngine ───┐                                  ┌─ InProcClient ── EngineCore (this process)
                         ├─ InputProcessor, OutputProcessor ─ CoreClient
    HTTP:   api/ AsyncLLM┘   (checks once; text once a step)  └─ MPClient ═════ EngineCore (its own process)

core/       the engine core: token ids in, token ids out
  messages.py       the protocol: every message between a frontend and the core, as msgspec Structs
  wire.py           those messages between processes: msgpack, numbered and signed, on socket pairs
  engine.py         EngineCore: add / step / abort
  process.py        the engine core in a process of its own (spear serve), its heartbeat
  zygote.py         spear serve's core forked from its sealed start, non-dumpable from its first instruction
  sequence.py       a request's tokens and state
  block_manager.py  paged KV block allocation
  scheduler.py      continuous batching with chunked prefill, admission control, preemption, latency targets
  sampling.py       greedy / temperature / top-k / top-p, seeds
model/      the engine's own Llama-family model and what runs it
  llama.py          the model (Llama 2/3, SmolLM2, Mistral, Qwen2); layers/ its layers
  loader.py         weights from a spear checkpoint, an HF folder or a model in memory
  model_runner.py   one step of the model over the cache; graphs.py its CUDA graphs
  block_tables.py   the decode step's block tables, kept on the host between steps
  rank.py           one rank's model, KV cache and runner; workers.py tensor-parallel ranks 1..N-1
latency/    latency targets: table.py (measured step times), deployment.py (what a table is valid
            for), profiler.py (timing engine steps into a table, EC costs)
frontend/   between a user and the engine core
  processor.py      InputProcessor: every request checked once, into a CoreRequest
  output.py         OutputProcessor: a step's outputs into every request's RequestOutput
  detokenizer.py    incremental text and stop strings
  client.py         CoreClient, the one interface to the core, and its in-process transport
  mp_client.py     the core in a process of its own, over socket pairs it inherits
  llm_engine.py     LLMEngine: the engine in this process, for Python use
  async_llm.py      AsyncLLM: the HTTP server's frontend; RequestStream; health
  metrics.py        Prometheus metrics
  chat.py           chat templates, message content tokenized as text
api/        the OpenAI-compatible HTTP server
  protocol.py       request bodies
  endpoints.py      what the endpoints do with a request
  sse.py            streaming responses: server-sent events encoded per step
  errors.py         every error as OpenAI's JSON body; the body limit
  app.py            the FastAPI app and its routes; run_server
  transport.py      the listening socket, uvicorn (httptools, uvloop): header deadline, connection cap
config.py   EngineConfig (with the kernel policy) and ServerLimits
faults.py   repeated faults logged once per interval
"""

import importlib

# Imported when first asked for, not with the package: ``spear serve`` forks its engine core's zygote
# (core/zygote.py) from a process that has imported nothing heavy yet, torch least of all.
_EXPORTS = {"EngineConfig": "spear.serve.config", "LLMEngine": "spear.serve.frontend.llm_engine",
            "RequestOutput": "spear.serve.frontend.output", "SamplingParams": "spear.serve.core.messages"}

__all__ = ["EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
