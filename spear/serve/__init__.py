"""Serving: a continuous-batching engine over a paged KV cache and an OpenAI-compatible server.

sequence.py       request state and sampling parameters
block_manager.py  paged KV block allocation
scheduler.py      continuous batching with chunked prefill, admission control, preemption
layers.py         RMSNorm, rotary, paged attention on flat token batches
model_runner.py   the Llama-family forward over the cache; CUDA graphs for decode
w4_kernels.py     QuantLinear -> the W4A16 (+EC) Triton kernels on CUDA
sampling.py       greedy / temperature / top-k / top-p, seeds
detokenizer.py    incremental text and stop strings
engine.py         LLMEngine: add_request / step / abort / generate
async_engine.py   the engine in a background thread, for the server
protocol.py       OpenAI request bodies
server.py         FastAPI app: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics
metrics.py        Prometheus metrics
"""

from spear.serve.config import EngineConfig
from spear.serve.engine import LLMEngine, RequestOutput
from spear.serve.sequence import SamplingParams

__all__ = ["EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]
