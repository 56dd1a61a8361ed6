"""``spear generate`` and ``spear serve`` from the command line."""

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from spear.cli import main
from tests.serve.conftest import free_port, wait_healthy


def test_generate_prints_completions(tiny_llama_path, capsys):
    assert main(["-q", "generate", "--model", str(tiny_llama_path), "--prompt", "Hello", "--prompt", "A b c",
                 "--max-tokens", "5", "--num-blocks", "32", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in rows] == ["Hello", "A b c"]
    assert all(1 <= r["completion_tokens"] <= 5 and r["finish_reason"] in ("stop", "length") for r in rows)


def test_generate_chat_and_stop(default_model_path, capsys):
    assert main(["-q", "generate", "--prompt", "What is the capital of France?", "--chat", "--max-tokens", "24",
                 "--stop", ".", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert "Paris" in row["text"] and "." not in row["text"] and row["finish_reason"] == "stop"


@pytest.mark.parametrize("argv,message", [
    (["generate", "--prompt", "x", "--kv-memory", "lots"], "expected a size such as 2GiB"),
    (["generate", "--prompt", "x", "--kv-memory", "1GiB", "--num-blocks", "4"], "not allowed with argument"),
    (["generate", "--prompt", "x", "--max-num-seqs", "0"], "expected a number >= 1"),
    (["serve", "--dtype", "int3"], "invalid choice"),
    (["serve", "--pdl", "sometimes"], "argument --pdl: invalid choice"),
    # before any loading (it loaded the model, then failed with a traceback)
    (["serve", "--port", "99999"], "a port is a number from 0 to 65535"),
    (["serve", "--port", "http"], "expected a port number"),
    (["serve", "--max-messages", "0"], "expected a number >= 1"),
    (["serve", "--max-prefill-chunk", "0"], "expected a number >= 1"),
    (["generate", "--prompt", "x", "--max-prefill-chunk-alone", "-4"], "expected a number >= 1"),
    (["serve", "--prefill-chunk-context", "-1"], "expected a number >= 0"),
    (["serve", "--newcomers-first", "yes"], "argument --newcomers-first: invalid choice"),
    (["serve", "--compile-workers", "-2"], "expected a number >= 0"),
])
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


@pytest.mark.parametrize("argv,expect", [
    ([], {"cpu": (32, 32), "cuda": (256, None)}),  # the device's defaults (EngineConfig.prefill_chunks)
    (["--max-prefill-chunk", "48"], {"cpu": (48, 48), "cuda": (48, None)}),
    (["--max-prefill-chunk", "48", "--max-prefill-chunk-alone", "200"], {"cpu": (48, 200), "cuda": (48, 200)}),
])
def test_serve_prefill_chunk_flags_reach_the_engine_config(argv, expect):
    from spear.cli import build_parser
    from spear.cli.serve import engine_config_from_args

    args = build_parser().parse_args(["serve", "--max-num-batched-tokens", "512", *argv])
    config, _, _ = engine_config_from_args(args)
    for device, chunks in expect.items():
        assert config.prefill_chunks(device) == chunks, device


@pytest.mark.parametrize("argv,context,first", [
    ([], None, None), (["--prefill-chunk-context", "0"], 0, None), (["--prefill-chunk-context", "2000"], 2000, None),
    (["--newcomers-first", "on"], None, True), (["--newcomers-first", "off"], None, False)])
def test_serve_prefill_chunk_context_and_newcomers_flags_reach_the_engine_config(argv, context, first):
    from spear.cli import build_parser
    from spear.cli.serve import engine_config_from_args

    args = build_parser().parse_args(["serve", *argv])
    config, _, _ = engine_config_from_args(args)
    assert (config.prefill_chunk_context, config.newcomers_first) == (context, first)
    assert config.first_steps_for_newcomers("cuda") is bool(first)


@pytest.mark.parametrize("argv,want", [([], None), (["--interleave-decodes", "on"], True),
                                       (["--interleave-decodes", "off"], False)])
def test_serve_interleave_decodes_flag_reaches_the_engine_config(argv, want):
    from spear.cli import build_parser
    from spear.cli.serve import engine_config_from_args

    config, _, _ = engine_config_from_args(build_parser().parse_args(["serve", *argv]))
    assert config.interleave_decodes is want
    assert config.decodes_interleaved("cpu") is (want is not False)


@pytest.mark.parametrize("argv,want", [([], None), (["--compile-workers", "0"], 0), (["--compile-workers", "6"], 6)])
def test_serve_compile_workers_flag_reaches_the_engine_config(argv, want):
    from spear.cli import build_parser
    from spear.cli.serve import engine_config_from_args

    config, _, _ = engine_config_from_args(build_parser().parse_args(["serve", *argv]))
    assert config.compile_workers == want


def test_generate_without_prompt_and_impossible_settings(tiny_llama_path, capsys):
    assert main(["generate", "--model", str(tiny_llama_path)]) == 2
    assert "no prompt given" in capsys.readouterr().err
    assert main(["generate", "--model", str(tiny_llama_path), "--prompt", "x", "--num-blocks", "2",
                 "--max-model-len", "100"]) == 2
    assert "exceeds the model's KV cache capacity (32)" in capsys.readouterr().err
    assert main(["generate", "--model", str(tiny_llama_path), "--prompt", "x", "--device", "cpu",
                 "--pdl", "wait"]) == 2
    assert "programmatic dependent launch (pdl='wait') needs a Hopper" in capsys.readouterr().err
    assert main(["generate", "--model", str(tiny_llama_path), "--prompt", "x", "--launch-table",
                 str(tiny_llama_path / "no-such-table.json")]) == 2
    assert "kernel policy: cannot read the launch table" in capsys.readouterr().err


def test_generate_refuses_a_prompt_that_is_not_unicode_in_one_line(tiny_llama_path):
    """Bytes that are not UTF-8 in --prompt, as a shell passes them (argv decodes them to lone
    surrogates): exit 2 and one stderr line from the CLI's own check, before the model loads.
    Catches: the check dropped, leaving the prompt to the model loading and the engine's
    tokenizer (a TypeError traceback, exit 1, with an engine that does not check)."""
    res = subprocess.run([sys.executable, "-m", "spear", "generate", "--model", str(tiny_llama_path), "--max-tokens",
                          "2", "--num-blocks", "32", "--prompt", b"a\xed\xa0\x80b"], capture_output=True, timeout=300)
    err = res.stderr.decode("utf-8").strip().splitlines()
    assert res.returncode == 2 and len(err) == 1, (res.returncode, err)
    assert err[0] == ("spear generate: error: --prompt 'a\\udced\\udca0\\udc80b' is not valid Unicode text "
                      "(a lone surrogate at character 1; bytes that are not UTF-8?)"), err


@pytest.mark.parametrize("extra,message", [
    (["--prompt", "ok", "--stop", os.fsdecode(b"\xff")], "--stop '\\udcff' is not valid Unicode text"),
    (["--prompt-file", "BAD_FILE"], "is not valid UTF-8 text: 'utf-8' codec can't decode byte 0xff"),
    (["--prompt", "ok", "--request-seed", str(2**70)], "seed"),
])
def test_generate_bad_text_and_seed_fail_in_one_line(tiny_llama_path, tmp_path, capsys, extra, message):
    """Bytes that are not UTF-8 in --stop (as argv decodes them) or in a --prompt-file, and a
    --request-seed torch cannot take: exit 2 and one stderr line. Catches: the UnicodeDecodeError
    of the file escaping as a traceback (it was caught only as an OSError), and a --stop string
    with a lone surrogate accepted (exit 0; it can never match)."""
    bad_file = tmp_path / "prompts.txt"
    bad_file.write_bytes(b"fine prompt\nbad \xff\xfe bytes\n")
    extra = [str(bad_file) if a == "BAD_FILE" else a for a in extra]
    assert main(["generate", "--model", str(tiny_llama_path), "--max-tokens", "2", "--num-blocks", "32", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("spear generate: error: ") and message in err[0], err


def test_serve_subprocess_answers_and_stops(tiny_llama_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "spear", "serve", "--model", str(tiny_llama_path), "--port",
                             str(port), "--num-blocks", "64", "--served-model-name", "tiny", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 120, proc, "spear serve")
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 4}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 4
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert f"serving tiny on http://127.0.0.1:{port}" in out
    # torch's threads are the engine core's: the cores this process may use, but one for the server
    # (with one core busy elsewhere, a 4-token request took 6.0 s on 2 threads, 0.3 s on one)
    threads = max(1, len(os.sched_getaffinity(0)) - 1)
    assert f"engine core on {threads} torch thread" in out, out


@pytest.mark.parametrize("how", ["port in use", "unresolvable host"])
def test_serve_refuses_an_address_it_cannot_listen_on_before_loading(tiny_llama_path, how):
    """Catches: a port in use or a --host that does not resolve found only after the model had
    loaded, ending with uvicorn's error and exit code 3. Now one line and exit code 2, before the
    engine core starts."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        where = (["--port", str(held.getsockname()[1])] if how == "port in use"
                 else ["--host", "no-such-host.invalid", "--port", "0"])
        res = subprocess.run([sys.executable, "-m", "spear", "serve", "--model", str(tiny_llama_path), *where],
                             capture_output=True, text=True, timeout=120)
    err = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(err) == 1, (res.returncode, res.stderr[-2000:])
    assert ("cannot listen on 127.0.0.1" in err[0] and "in use" in err[0]) if how == "port in use" else \
        "--host no-such-host.invalid: cannot resolve it" in err[0], err
    assert "loading" not in res.stdout, res.stdout  # the engine core never started


def _start_server(tiny_llama_path, *extra, env=None):
    """``spear serve`` of the tiny model in a process of its own (``env``: over this one's), healthy."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "spear", "-q", "serve", "--model", str(tiny_llama_path), "--port",
                             str(port), "--num-blocks", "512", "--served-model-name", "tiny", "--log-level",
                             "warning", *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=None if env is None else {**os.environ, **env})
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, 120, proc, "spear serve")
    return proc, url


def _long_stream(url, got_tokens):
    """A stream far longer than the test; records how many events arrived and whether it ended cleanly."""
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    got_tokens.append(line)
    except httpx.TransportError:
        got_tokens.append("cut")


@pytest.mark.parametrize("how", ["second signal", "drain timeout"])
def test_sigterm_drains_then_a_second_signal_or_the_timeout_ends_it(tiny_llama_path, how):
    """On SIGTERM the server stops taking connections and lets the open stream run; a second
    SIGTERM, or --shutdown-timeout, ends the wait. Catches: a drain without a limit (the
    process outliving both) and a second SIGTERM that is ignored."""
    import threading

    proc, url = _start_server(tiny_llama_path, "--shutdown-timeout", "2" if how == "drain timeout" else "120")
    events: list[str] = []
    try:
        streamer = threading.Thread(target=_long_stream, args=(url, events))
        streamer.start()
        deadline = time.monotonic() + 60
        while len(events) < 5:
            assert time.monotonic() < deadline, "the stream never started"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert proc.poll() is None, "the server quit without draining"
        n = len(events)
        time.sleep(0.5)
        assert len(events) > n, "the open stream stopped at the first SIGTERM"
        with pytest.raises(httpx.TransportError):  # no new connections while draining
            httpx.get(url + "/health", timeout=2)
        started = time.monotonic()
        if how == "second signal":
            proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
        assert time.monotonic() - started < (10 if how == "second signal" else 15)
        streamer.join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)
    if how == "drain timeout":  # ended by the deadline: the documented error event, then [DONE]
        assert events[-1] == "data: [DONE]" and "shutting down" in events[-2] and '"error"' in events[-2], events[-3:]
    else:  # the second signal cuts at once
        assert events[-1] != "data: [DONE]"


@pytest.mark.parametrize("file,text,message", [
    ("generation_config.json", "{not json", "generation_config.json is not valid JSON"),
    ("generation_config.json", '{"max_new_tokens": -4}', "is not a generation config transformers accepts"),
    ("spear_config.json", '{"format": "spear-checkpoint", "version": 1}', "spear_config.json: lacks the field"),
    ("config.json", "[" * 100_000 + "]" * 100_000, "config.json is not valid JSON: nested too deeply to parse"),
    ("config.json", '{"model_type": ', "config.json is not valid JSON"),
])
def test_serve_names_a_damaged_config_before_the_server_starts(tiny_llama_path, tmp_path, file, text, message):
    """Catches: a damaged generation_config.json or spear_config.json found by the engine core
    after the HTTP server had started (and said it was loading), and a config.json too deeply
    nested reported as "cannot load the tokenizer". Now one line, exit 2, nothing started."""
    import shutil

    folder = shutil.copytree(tiny_llama_path, tmp_path / "model")
    (folder / file).write_text(text)
    res = subprocess.run([sys.executable, "-m", "spear", "serve", "--model", str(folder), "--port", "0"],
                         capture_output=True, text=True, timeout=120)
    err = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(err) == 1, (res.returncode, res.stderr[-2000:])
    assert err[0].startswith("spear serve: error: ") and message in err[0] and str(folder / file) in err[0], err
    assert "tokenizer" not in err[0] and "loading" not in res.stdout, (err, res.stdout)


def test_serve_on_ipv6_prints_a_url_that_works(tiny_llama_path):
    """Catches: --host ::1 printed as http://::1:PORT, which no client parses."""
    import socket

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    proc = subprocess.Popen([sys.executable, "-m", "spear", "serve", "--model", str(tiny_llama_path), "--host", "::1",
                             "--port", "0", "--num-blocks", "64", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline()
        assert first.startswith("loading ") and "; http://[::1]:" in first, first
        url = first.split("; ")[1].split("/health")[0]
        wait_healthy(url, 120, proc, "spear serve")
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == str(tiny_llama_path)
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    assert f"on {url} (" in out, out
