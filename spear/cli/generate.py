"""``spear generate``: complete prompts offline with the serving engine."""

from __future__ import annotations

import json
import sys


def register(sub) -> None:
    from spear.cli.common import positive_int
    from spear.cli.serve import add_engine_args

    p = sub.add_parser("generate", help="complete prompts offline (continuous batching, no server)",
                       description="Complete one or more prompts with the serving engine and print the "
                                   "completions. Greedy unless --temperature > 0.")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for several)")
    p.add_argument("--prompt-file", help="a file with one prompt per line")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    p.add_argument("--max-tokens", type=positive_int, default=64, help="tokens per completion (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens; 0 = all")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--request-seed", type=int, help="per-request sampling seed")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_engine_args(p)
    p.set_defaults(func=main)


def _check_unicode(text: str, where: str) -> None:
    from spear.errors import SpearError

    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise SpearError(f"{where} {text[:40]!r} is not valid Unicode text (a lone surrogate at character "
                         f"{exc.start}; bytes that are not UTF-8?)") from None


def main(args) -> int:
    from spear.errors import SpearError
    from spear.serve import SamplingParams
    from spear.serve.frontend.processor import check_params

    prompts = list(args.prompt)
    # bytes that are not UTF-8 reach argv as lone surrogates (surrogateescape); no tokenizer takes them
    for option, values in (("--prompt", prompts), ("--stop", args.stop)):
        for text in values:
            _check_unicode(text, option)
    if args.prompt_file:
        try:
            with open(args.prompt_file, encoding="utf-8") as fh:
                prompts += [line.rstrip("\n") for line in fh if line.strip()]
        except UnicodeDecodeError as exc:
            raise SpearError(f"--prompt-file {args.prompt_file} is not valid UTF-8 text: {exc}") from None
        except OSError as exc:
            raise SpearError(f"cannot read --prompt-file: {exc}") from None
    if not prompts:
        raise SpearError("no prompt given (use --prompt TEXT or --prompt-file FILE)")
    # checked before the model loads (the engine would refuse them only then)
    params = check_params(SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                         top_k=args.top_k, stop=tuple(args.stop), seed=args.request_seed))

    from spear.cli.serve import engine_from_args

    engine = engine_from_args(args)
    if args.chat:
        from spear.serve.frontend.chat import chat_prompt_ids, has_chat_template

        if not has_chat_template(engine.tokenizer):
            raise SpearError(f"--chat: the model {args.model} has no chat template")
        inputs = [chat_prompt_ids(engine.tokenizer, [{"role": "user", "content": p}]) for p in prompts]
    else:
        inputs = prompts
    failed = 0
    for prompt, out in zip(prompts, engine.generate(inputs, params)):
        if out.error is not None:
            failed += 1
            print(f"spear generate: error: prompt {prompt[:40]!r}: {out.error}", file=sys.stderr)
            continue
        if args.json:
            print(json.dumps({"prompt": prompt, "text": out.text, "finish_reason": out.finish_reason,
                              "prompt_tokens": out.num_prompt_tokens, "completion_tokens": out.num_output_tokens}))
        else:
            print(f"{prompt}{out.text}" if not args.chat else out.text)
            if len(prompts) > 1:
                print("-" * 40)
    sys.stdout.flush()
    return 1 if failed else 0
