"""spear: 4-bit weight quantization of LLMs with low-rank error compensators, and an engine that serves the result.

The rooms: ``quant`` turns linears into ``QuantLinear`` (RTN, GPTQ, AWQ); ``compensate`` attaches and
calibrates the error compensators (the static baselines and SPEAR's KL-calibrated ECs, with
``CompensatorSpec`` the one record of a compensator every part shares); ``select`` places them under
a memory or latency budget; ``models`` loads models and reads and writes checkpoints; ``data`` gives
texts and self-samples; ``eval`` measures perplexity and memory; ``kernels`` holds the Triton
kernels, their torch references and the frozen ``KernelPolicy``; ``serve`` is the serving engine
(its own Llama-family model, scheduler, runner, OpenAI server); ``parallel`` splits that engine
across devices by tensor parallelism; ``vllm_plugin`` serves spear checkpoints on vLLM; ``cli`` is
the ``spear`` command and ``pipeline`` its default job. Settings live in the frozen configs of
``config`` and are passed down; what a user must fix raises ``errors.SpearError``.
"""
