"""Serving: a continuous-batching engine over a paged KV cache and an OpenAI-compatible server.

llama.py          the engine's own Llama-family model (Llama 2/3, SmolLM2, Mistral, Qwen2)
layers/           its layers: linears owning packed weights and merged ECs, RMSNorm, rotary, attention
loader.py         weights from a spear checkpoint, an HF folder or a model in memory
sequence.py       request state and sampling parameters
block_manager.py  paged KV block allocation
block_tables.py   the decode step's block tables, kept on the host between steps
scheduler.py      continuous batching with chunked prefill, admission control, preemption, latency targets
latency.py        the deployment's latency table: measured step times, interpolation, margin, cache
deployment.py     what a latency table is valid for: checkpoint, device, dtype, policy, engine settings
profiler.py       timing engine steps into a latency table (spear profile), EC costs per linear shape
model_runner.py   one step of the model over the cache; CUDA graphs for decode
sampling.py       greedy / temperature / top-k / top-p, seeds
detokenizer.py    incremental text and stop strings
chat.py           chat templates, message content tokenized as text
engine.py         LLMEngine: add_request / step / abort / generate
outputs.py        RequestOutput, StepRecord, EngineStats: what the engine hands out
rank.py           one rank's model, KV cache and runner (rank 0 and every tensor-parallel worker)
workers.py        the processes of tensor-parallel ranks 1..N-1
core.py           the engine core: LLMEngine in a process of its own (spear serve)
client.py         EngineClient: the server's side of the engine core
async_engine.py   AsyncEngine: the engine in a background thread of the server (tests, embedding)
stream.py         what both frontends hand the server: RequestStream, EngineDead, Frontend
protocol.py       OpenAI request bodies
endpoints.py      what the endpoints do with a request: parse, tokenize, submit, respond
server.py         FastAPI app: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics
transport.py      uvicorn under the app: header deadline, connection cap, accept faults
metrics.py        Prometheus metrics
config.py         EngineConfig (with the kernel policy) and ServerLimits
"""

from spear.serve.config import EngineConfig
from spear.serve.engine import LLMEngine
from spear.serve.outputs import RequestOutput
from spear.serve.sequence import SamplingParams

__all__ = ["EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]
