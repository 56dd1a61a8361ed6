"""Serving: a continuous-batching engine over a paged KV cache and an OpenAI-compatible server.

core/       the engine core: token ids in, token ids out
  sequence.py       a request's tokens and state
  block_manager.py  paged KV block allocation
  scheduler.py      continuous batching with chunked prefill, admission control, preemption, latency targets
  sampling.py       greedy / temperature / top-k / top-p, seeds
  engine.py         LLMEngine: add_request / step / abort / generate
  outputs.py        RequestOutput, StepRecord, EngineStats
  process.py        the engine core in a process of its own (spear serve)
model/      the engine's own Llama-family model and what runs it
  llama.py          the model (Llama 2/3, SmolLM2, Mistral, Qwen2); layers/ its layers
  loader.py         weights from a spear checkpoint, an HF folder or a model in memory
  model_runner.py   one step of the model over the cache; graphs.py its CUDA graphs
  block_tables.py   the decode step's block tables, kept on the host between steps
  rank.py           one rank's model, KV cache and runner; workers.py tensor-parallel ranks 1..N-1
latency/    latency targets: table.py (measured step times), deployment.py (what a table is valid
            for), profiler.py (timing engine steps into a table, EC costs)
frontend/   between a user and the engine core
  client.py         EngineClient: the server's side of the engine core
  async_engine.py   AsyncEngine: the engine in a background thread of the server
  stream.py         RequestStream, EngineDead, Frontend
  detokenizer.py    incremental text and stop strings
  chat.py           chat templates, message content tokenized as text
api/        the OpenAI-compatible HTTP server
  protocol.py       request bodies
  endpoints.py      what the endpoints do with a request
  app.py            the FastAPI app and its routes
  transport.py      uvicorn under the app: header deadline, connection cap, accept faults
  metrics.py        Prometheus metrics
config.py   EngineConfig (with the kernel policy) and ServerLimits
"""

from spear.serve.config import EngineConfig
from spear.serve.core.engine import LLMEngine
from spear.serve.core.outputs import RequestOutput
from spear.serve.core.sequence import SamplingParams

__all__ = ["EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]
