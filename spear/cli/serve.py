"""``spear serve``: an OpenAI-compatible HTTP server for a model or checkpoint."""

from __future__ import annotations

import argparse
import re

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20,
          "g": 1e9, "gb": 1e9, "gib": 2**30}
DTYPES = {"auto": None, "float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
          "bfloat16": "bfloat16", "bf16": "bfloat16"}


def memory_size(text: str) -> int:
    """'2GiB', '512MiB', '1.5G' or a number of bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a size such as 2GiB, 512MiB or 1000000000, got {text!r}")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive size, got {text!r}")
    return value


def add_engine_args(p: argparse.ArgumentParser, slo: bool = True) -> None:
    from spear.cli.common import add_model_arg, nonneg_int, positive_float, positive_int

    add_model_arg(p, verify=True)
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", choices=sorted(DTYPES), default="auto",
                   help="activation / weight dtype; auto = float32 on CPU, float16 on CUDA (default: %(default)s)")
    g.add_argument("--device", default="auto", help="cpu, cuda or cuda:N; auto = cuda when available")
    g.add_argument("--max-num-seqs", type=positive_int, default=64,
                   help="sequences batched together (default: %(default)s)")
    g.add_argument("--max-num-batched-tokens", type=positive_int, default=512,
                   help="token budget of one step; longer prompts are prefilled in chunks (default: %(default)s)")
    g.add_argument("--max-model-len", type=positive_int,
                   help="prompt + output tokens per request (default: the model's context, at most 8192, "
                        "capped by the KV cache)")
    g.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block (default: %(default)s)")
    kv = g.add_mutually_exclusive_group()
    kv.add_argument("--num-blocks", type=positive_int, help="KV cache size in blocks")
    kv.add_argument("--kv-memory", type=memory_size,
                    help="KV cache size in bytes, e.g. 2GiB (default: 1GiB on CPU, 85%% of free GPU memory)")
    g.add_argument("--max-waiting", type=positive_int, default=256,
                   help="queued requests beyond which new ones are refused (HTTP 429) (default: %(default)s)")
    g.add_argument("--no-cuda-graphs", action="store_true", help="run decode steps eagerly on CUDA")
    g.add_argument("--compile-workers", type=nonneg_int, metavar="N",
                   help="processes that compile the W4 kernels' launches in parallel before the warm-up runs "
                        "them (one GPU; a cold kernel cache otherwise compiles them one at a time, minutes for an "
                        "8B model); 0: compile each where it is first run (default: the cores less one, at most "
                        "16)")
    g.add_argument("--pdl", choices=["off", "wait", "auto"], default="auto",
                   help="programmatic dependent launch of the decode kernels (CUDA, Hopper or newer): 'wait' "
                        "lets each kernel load its weights while the one before it finishes; faster at batch "
                        "1, slower at 64 sequences with compensators on an H200; 'auto' uses it for decode "
                        "batches of up to 32 sequences where the GPU has it (default: %(default)s)")
    g.add_argument("--launch-table", metavar="JSON",
                   help="launch shapes of the W4 kernel for this GPU (a JSON table as `spear tune-kernels` writes "
                        "it; default: the built-in table, chosen on an H200)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed of requests without one (default: %(default)s)")
    g.add_argument("--tensor-parallel", type=positive_int, default=1, metavar="N",
                   help="split the model across N processes: N GPUs (cuda:0..N-1) or, on the CPU, N gloo "
                        "processes; heads, kv heads and MLP features must divide by N (default: %(default)s)")
    g.add_argument("--tp-reduce", choices=["allreduce", "peer"], default="allreduce",
                   help="how row-parallel layers sum their partial outputs across GPUs: 'allreduce' (NCCL), or "
                        "'peer' (each GPU reads the others' symmetric-memory buffers in one fused kernel with the "
                        "compensator's gate; no collective on the decode path) (default: %(default)s)")
    if not slo:  # `spear profile` times whole steps: no scheduling settings
        p.set_defaults(max_prefill_chunk=None, max_prefill_chunk_alone=None, prefill_chunk_context=None,
                       newcomers_first=None, interleave_decodes=None,
                       itl_slo_ms=None, latency_table=None,
                       min_chunk=16, no_latency_correction=False)
        return
    c = p.add_argument_group("prefill chunks")
    c.add_argument("--max-prefill-chunk", type=positive_int, metavar="N",
                   help="most tokens of one prompt in a step it shares with others, so that requests arriving "
                        "beside a long prompt are admitted at the next step and running streams keep their pace "
                        "(default: 32 on a CPU, half of --max-num-batched-tokens on a GPU)")
    c.add_argument("--max-prefill-chunk-alone", type=positive_int, metavar="N",
                   help="most tokens of one prompt in a step it has alone: a request arriving during that step "
                        "waits for it (default: --max-prefill-chunk on a CPU, the whole budget on a GPU)")
    c.add_argument("--prefill-chunk-context", type=nonneg_int, metavar="C",
                   help="both caps shrink with the prompt's context L to cap x C / (C + L), so that a chunk's "
                        "attention over a long context does not make its step several decode steps long; C is "
                        "the context at which a token's attention costs what its linear layers do; 0: the caps "
                        "stand (default: that context from the model's shapes on a CPU, 0 on a GPU)")
    c.add_argument("--newcomers-first", choices=["on", "off"],
                   help="'on': a step that admits a request leaves out the chunks of prompts already running, at "
                        "most every other step, so a short request's first token does not wait for a long "
                        "prompt's chunk (default: on on a CPU, where a step's time is its work; off on a GPU)")
    c.add_argument("--interleave-decodes", choices=["on", "off"],
                   help="'on': a step after one that ran a running prompt's chunk beside decodes runs the decodes "
                        "without it, so a stream beside a long prompt gets every other token at a decode step's "
                        "pace; the long prompt takes a decode step longer per chunk (default: on on a CPU, off on "
                        "a GPU)")
    t = p.add_argument_group("latency target")
    t.add_argument("--itl-slo-ms", type=positive_float, metavar="MS",
                   help="inter-token latency target: every step runs all decodes and the largest prefill chunk "
                        "the latency table predicts within MS (with its margin); --max-num-batched-tokens stays "
                        "the ceiling (default: no target, the static budget)")
    t.add_argument("--latency-table", metavar="JSON",
                   help="the deployment's measured step times (`spear profile`); default with --itl-slo-ms: the "
                        "table cached for this checkpoint, device and kernel policy, else one profiled at start-up")
    t.add_argument("--min-chunk", type=positive_int, default=16, metavar="TOKENS",
                   help="prefill tokens a step takes at least under --itl-slo-ms, so prompts never starve "
                        "(default: %(default)s)")
    t.add_argument("--no-latency-correction", action="store_true",
                   help="predict with the table as measured; by default each kind of step's predictions are "
                        "corrected by the running ratio of measured to predicted step times while serving")


def port(text: str) -> int:
    """A TCP port, 1..65535 (0 asks the system for a free one)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is a number from 0 to 65535, got {value}")
    return value


def http_url(host: str, port: int) -> str:
    """The URL of ``host``:``port``; an IPv6 address in brackets (RFC 3986), its zone's % escaped."""
    return f"http://[{host.replace('%', '%25')}]:{port}" if ":" in host else f"http://{host}:{port}"


def engine_config_from_args(args, **changes):
    """(EngineConfig, dtype name or None, device or None) the arguments describe; ``changes``
    replace EngineConfig fields. Every check that needs no model runs here, before any loading."""
    from spear.cli.common import device_from
    from spear.serve import EngineConfig
    from spear.serve.config import kernel_policy
    from spear.serve.latency.table import load_table

    device = None if args.device == "auto" else device_from(args)  # auto: the engine core's process picks
    dtype = DTYPES[args.dtype]
    table = None if args.latency_table is None else load_table(args.latency_table)  # a bad file fails before loading
    fields = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                  max_prefill_chunk=args.max_prefill_chunk, max_prefill_chunk_alone=args.max_prefill_chunk_alone,
                  prefill_chunk_context=args.prefill_chunk_context,
                  newcomers_first=None if args.newcomers_first is None else args.newcomers_first == "on",
                  interleave_decodes=None if args.interleave_decodes is None else args.interleave_decodes == "on",
                  max_model_len=args.max_model_len, block_size=args.block_size, num_blocks=args.num_blocks,
                  kv_memory=args.kv_memory, max_waiting=args.max_waiting, cuda_graphs=not args.no_cuda_graphs,
                  compile_workers=args.compile_workers,
                  kernels=kernel_policy(pdl=args.pdl, launch_table=args.launch_table), seed=args.seed,
                  itl_slo_ms=args.itl_slo_ms, latency_table=table, min_chunk_tokens=args.min_chunk,
                  latency_correction=not args.no_latency_correction,
                  tensor_parallel_size=args.tensor_parallel, tp_reduce=args.tp_reduce)
    fields.update(changes)
    return EngineConfig(**fields), dtype, device


def engine_from_args(args, **changes):
    """The engine the arguments describe, in this process (``LLMEngine``); ``changes`` replace
    EngineConfig fields."""
    import torch

    from spear.serve import LLMEngine

    cfg, dtype, device = engine_config_from_args(args, **changes)
    return LLMEngine.from_pretrained(args.model, cfg, dtype=None if dtype is None else getattr(torch, dtype),
                                     device=device, verify=args.verify)


def register(sub) -> None:
    from spear.cli.common import positive_float, positive_int
    from spear.serve.config import ServerLimits

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, streaming, metrics)",
                       description="Serve a model with continuous batching over a paged KV cache: "
                                   "/v1/completions, /v1/chat/completions (streaming or not), /v1/models, "
                                   "/health and /metrics (Prometheus). See docs/serving.md.")
    add_engine_args(p)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    s.add_argument("--port", type=port, default=8000, help="port, 0-65535 (default: %(default)s)")
    s.add_argument("--served-model-name", help="the model id clients send (default: the --model argument)")
    s.add_argument("--core-threads", type=positive_int, default=None, metavar="N",
                   help="torch threads of the engine core (default: on a GPU 2, on a CPU all cores but one; the "
                        "HTTP server's process keeps one)")
    s.add_argument("--step-timeout", type=positive_float, default=300.0, metavar="SECONDS",
                   help="/health answers 503 while one engine step has run longer than this, e.g. on a hung GPU "
                        "(default: %(default)s)")
    limits = ServerLimits()
    s.add_argument("--shutdown-timeout", type=positive_float, default=limits.shutdown_timeout_s, metavar="SECONDS",
                   help="on SIGTERM / Ctrl-C, how long open requests may run on; then each ends with the JSON "
                        "error (503 shutting_down; a stream with its error event and [DONE]); a second signal cuts "
                        "them at once (default: %(default)s)")
    s.add_argument("--max-body-bytes", type=memory_size, default=limits.max_body_bytes, metavar="SIZE",
                   help="largest request body, e.g. 8MiB; larger ones get HTTP 413 (default: %(default)s bytes)")
    s.add_argument("--max-prompt-chars", type=positive_int, default=limits.max_prompt_chars, metavar="N",
                   help="most characters of a text prompt or of all chat messages together (default: %(default)s)")
    s.add_argument("--max-stop-chars", type=positive_int, default=limits.max_stop_chars, metavar="N",
                   help="most characters of one stop string (default: %(default)s)")
    s.add_argument("--max-messages", type=positive_int, default=limits.max_messages, metavar="N",
                   help="most messages of one chat (default: %(default)s)")
    s.add_argument("--header-timeout", type=positive_float, default=limits.header_timeout_s, metavar="SECONDS",
                   help="a connection must send a request's headers within this, else it is closed "
                        "(default: %(default)s)")
    s.add_argument("--min-upload-rate", type=positive_int, default=limits.min_upload_rate, metavar="BYTES",
                   help="after its headers (and a grace of --header-timeout) a request's body must arrive at this "
                        "many bytes a second or faster, else the connection is closed (default: %(default)s)")
    s.add_argument("--request-timeout", type=positive_float, default=limits.request_timeout_s, metavar="SECONDS",
                   help="a request's headers and body must all arrive within this (default: %(default)s)")
    s.add_argument("--max-header-bytes", type=memory_size, default=limits.max_header_bytes, metavar="SIZE",
                   help="largest request line and headers; larger ones get HTTP 431 (default: %(default)s bytes)")
    s.add_argument("--max-connections", type=positive_int, default=limits.max_connections, metavar="N",
                   help="open connections kept; beyond them new ones are closed at once (held below the "
                        "process's open-file limit) (default: %(default)s)")
    s.add_argument("--max-connections-per-client", type=positive_int, default=limits.max_connections_per_client,
                   metavar="N", help="open connections of one client address; beyond them its new ones are closed "
                                     "at once (default: %(default)s)")
    s.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info",
                   help="server log level (default: %(default)s)")
    p.set_defaults(func=main)


def main(args, zygote=None) -> int:
    """The HTTP server in this process, the engine core in a process of its own (spear/serve/core/process.py):
    the child of ``zygote`` (spear/serve/core/zygote.py, forked by the command line), else spawned."""
    from spear.serve.core.process import forbid_inspection

    forbid_inspection()  # first: no process of the user reads or writes this one from here (core/wire.py)
    import logging

    import torch

    from spear.models.checkpoint import check_folder_configs, load_folder_tokenizer
    from spear.models.loading import resolve_model_path
    from spear.serve.api.app import run_server
    from spear.serve.api.transport import listen
    from spear.serve.config import ServerLimits
    from spear.serve.frontend.async_llm import AsyncLLM
    from spear.serve.frontend.llm_engine import tokenizer_eos
    from spear.serve.frontend.mp_client import MPClient

    logging.getLogger("spear").setLevel(args.log_level.upper())
    limits = ServerLimits(max_body_bytes=args.max_body_bytes, max_prompt_chars=args.max_prompt_chars,
                          max_stop_chars=args.max_stop_chars, shutdown_timeout_s=args.shutdown_timeout,
                          max_messages=args.max_messages, header_timeout_s=args.header_timeout,
                          max_connections=args.max_connections, min_upload_rate=args.min_upload_rate,
                          request_timeout_s=args.request_timeout, max_header_bytes=args.max_header_bytes,
                          max_connections_per_client=args.max_connections_per_client)
    config, dtype, device = engine_config_from_args(args)  # a bad setting fails here, before any loading
    listener = listen(args.host, args.port)  # so does an address that is taken or does not resolve
    port = listener.getsockname()[1]
    torch.set_num_threads(1)  # this process computes nothing with torch: the engine core owns the threads
    path = resolve_model_path(args.model)  # the embedded default converted once, here, not in both processes
    check_folder_configs(path)  # a damaged config is said here, not by the engine core after the server started
    tokenizer = load_folder_tokenizer(path)
    name = args.served_model_name or args.model
    url = http_url(args.host, port)

    def loaded(facts) -> None:
        for layer, reason in facts.load_report:
            print(f"note: {layer} runs off the kernel path: {reason}", flush=True)
        if facts.itl_slo_ms is not None:
            t = facts.latency
            print(f"inter-token latency target {facts.itl_slo_ms:g} ms: step times measured {t.created} on "
                  f"{t.device}, margin {100 * t.margin:.1f}%, at least {facts.min_chunk_tokens} prefill tokens a step",
                  flush=True)
        tp = facts.tensor_parallel_size
        print(f"serving {name} on {url} (max_model_len {facts.max_model_len}, "
              f"{facts.num_blocks} KV blocks of {facts.block_size} tokens"
              + (f", tensor parallel over {tp} ranks" if tp > 1 else "")
              + f"; engine core on {facts.torch_threads} torch thread{'s' if facts.torch_threads > 1 else ''}"
              "); /health answers 200 once warm", flush=True)

    client = MPClient(str(path), config, dtype=dtype, device=device, verify=args.verify,
                       eos_token_ids=tokenizer_eos(tokenizer), log_level=args.log_level, on_loaded=loaded,
                       torch_threads=args.core_threads, zygote=zygote)
    llm = AsyncLLM(client, tokenizer, step_timeout_s=args.step_timeout)
    print(f"loading {name} in the engine core; {url}/health answers 503 until it is ready", flush=True)
    run_server(llm, name, listener, args.log_level, limits)
    if client.error is not None and not client.loaded.is_set():
        from spear.errors import SpearError

        raise SpearError(str(client.error).removeprefix("the engine could not start: "))
    return 0
