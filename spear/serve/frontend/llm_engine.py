"""``LLMEngine``: the engine in this process, for Python use. Requests in, text out, one step at a time.

    engine = LLMEngine.from_pretrained("smollm2-135m")
    outs = engine.generate(["The capital of France is"], SamplingParams(max_tokens=16, temperature=0))

``add_request`` checks a prompt (text or token ids) once and queues it (input processor), ``step``
runs one engine step and returns a ``RequestOutput`` (new tokens and text) for every request that
got a token or failed (output processor), ``abort`` drops a request. The engine core
(``engine.core``: scheduler, model runner, sampler) is reached through the in-process transport
(frontend/client.py, ``InProcClient``); ``spear serve`` reaches the same core in a process of its
own (frontend/async_llm.py, frontend/mp_client.py). A failed request finishes with
``finish_reason == "error"`` and the message in ``RequestOutput.error``.
"""

from __future__ import annotations

import itertools
import time

import torch
from torch import nn

from spear.errors import SpearError
from spear.serve.config import EngineConfig
from spear.serve.core.engine import EngineCore
from spear.serve.core.messages import SamplingParams
from spear.serve.frontend.client import InProcClient
from spear.serve.frontend.output import OutputProcessor, RequestOutput
from spear.serve.frontend.processor import InputProcessor, encode_text


def tokenizer_eos(tokenizer) -> tuple[int, ...]:
    """The tokenizer's end-of-sequence id(s), which end a request beside the model's own."""
    eos = getattr(tokenizer, "eos_token_id", None)
    return () if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos))


class LLMEngine:
    """``LLMEngine(model, tokenizer)`` serves a transformers causal LM in memory (with spear's
    QuantLinears and compensators where it has them), ``from_pretrained`` a checkpoint from disk;
    ``EngineCore``'s arguments otherwise. ``close()`` (or ``with``) stops tensor-parallel ranks."""

    def __init__(self, model: nn.Module, tokenizer, config: EngineConfig | None = None,
                 device: str | torch.device | None = None, dtype: torch.dtype | None = None):
        self._attach(EngineCore(model, config, device, dtype), tokenizer)

    @classmethod
    def from_pretrained(cls, model: str = "smollm2-135m", config: EngineConfig | None = None,
                        dtype: torch.dtype | None = None, device: str | None = None,
                        verify: bool = False, tokenizer=None) -> "LLMEngine":
        """Load the default model, an HF folder or a spear checkpoint (``EngineCore.from_pretrained``);
        ``tokenizer``: use this one instead of the folder's."""
        from spear.models.checkpoint import load_folder_tokenizer
        from spear.models.loading import resolve_model_path

        core = EngineCore.from_pretrained(model, config, dtype, device, verify)  # a damaged checkpoint is said first
        try:
            if tokenizer is None:
                tokenizer = load_folder_tokenizer(resolve_model_path(model))
        except BaseException:
            core.close()
            raise
        self = cls.__new__(cls)
        self._attach(core, tokenizer)
        return self

    def _attach(self, core: EngineCore, tokenizer) -> None:
        core.stop_on(tokenizer_eos(tokenizer))
        self.core, self.tokenizer = core, tokenizer
        self.client = InProcClient(core)
        self.processor = InputProcessor(self.client.facts)
        self.output = OutputProcessor(tokenizer)
        self._ids = itertools.count()

    def close(self) -> None:
        self.core.close()

    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def warmup(self) -> float:
        return self.core.warmup()

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return encode_text(self.tokenizer, prompt) if isinstance(prompt, str) else list(prompt)

    def _request(self, prompt, params, request_id, arrival_time):
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.output:
            raise SpearError(f"request id {rid!r} is already in use")
        return self.processor.process(self.tokenize(prompt), params or SamplingParams(), rid,
                                      arrival_time or time.monotonic())

    def _add(self, request) -> str:
        self.client.add(request)  # may raise QueueFull: then nothing of the request stays here
        self.output.add(request)
        return request.request_id

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        """Queue a prompt (text or token ids). Raises SpearError (InvalidRequest) for a bad request,
        QueueFull when full; either way nothing of the request stays in the engine."""
        return self._add(self._request(prompt, params, request_id, arrival_time))

    def abort(self, request_id: str) -> bool:
        """Drop a request and free its blocks; False when it is unknown or already finished."""
        if not self.output.drop(request_id):
            return False
        self.client.abort([request_id])
        return True

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def stats(self):
        return self.core.stats()

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        """One engine step: the output of every request that got a token or failed."""
        outputs, ended_here = self.output.process(self.client.step())
        if ended_here:  # a stop string (or a token the tokenizer cannot decode) ended them here
            self.client.abort(ended_here)
        return outputs

    # ------------------------------------------------------------------ offline
    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Run prompts to completion (continuously batched); the final output of each, in order.

        The engine must hold no other request: ``generate`` steps until its own prompts finish, and
        the outputs of requests queued with ``add_request`` would be consumed here, lost to their
        caller (a SpearError says so; drain those with ``step`` first, or ``abort`` them)."""
        if self.has_unfinished():
            raise SpearError(f"generate() needs an idle engine; it holds {len(self.output)} request(s) added with "
                             "add_request: step() until they finish, or abort() them, first")
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise SpearError(f"{len(prompts)} prompts but {len(plist)} sampling parameter sets")
        # every request checked before any work: one that cannot run fails fast
        requests = [self._request(p, sp, None, None) for p, sp in zip(prompts, plist)]
        added = 0
        final: dict[str, RequestOutput] = {}
        while len(final) < len(requests):
            while added < len(requests) and len(self.core.scheduler.waiting) < self.core.config.max_waiting:
                self._add(requests[added])
                added += 1
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [self._as_whole(final[r.request_id]) for r in requests]

    @staticmethod
    def _as_whole(out: RequestOutput) -> RequestOutput:
        out.new_token_ids, out.new_text = list(out.output_token_ids), out.text
        return out
