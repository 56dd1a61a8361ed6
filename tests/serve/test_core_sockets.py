"""The link between the HTTP server and the engine core against other processes (core/wire.py): no
name to connect to or bind at during the start or after it; every frame numbered, a replay dropped
and counted (both directions; /metrics shows it); a second submission of a running request does not
end its stream; both processes non-dumpable."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from functools import partial

import httpx
import psutil
import pytest

from spear.serve import SamplingParams
from spear.serve.core.messages import CoreHealth, CoreOutputs, CoreRequest, FromCore, ToCore
from spear.serve.core.wire import (FROM_CORE, HEARTBEAT, MAC_BYTES, TO_CORE, FrameReader, FrameSender, FrameWriter,
                                   Malformed, Replayed, Wire)
from tests.serve import core_faults
from tests.serve.conftest import running_server, wait_ready

SECRET = b"k" * 32


# ---------------------------------------------------------------------- frames
def test_a_frame_is_taken_once_and_only_on_its_own_channel():
    """Catches: signed frames that could be replayed (a heartbeat kept /health 200 while the core was
    frozen; a finished request ran again) or sent back the other way."""
    server = Wire(SECRET, FromCore, sends=TO_CORE, receives=FROM_CORE)
    core = Wire(SECRET, ToCore, sends=FROM_CORE, receives=TO_CORE)
    first, second = core.pack(CoreOutputs(accepted=["a"])), core.pack(CoreOutputs(accepted=["b"]))
    assert server.unpack(first).accepted == ["a"]
    with pytest.raises(Replayed, match="sequence number 1, 1 already"):
        server.unpack(first)
    assert server.unpack(second).accepted == ["b"]
    with pytest.raises(Replayed):  # an older frame, late
        server.unpack(first)
    later = [core.pack(CoreOutputs(accepted=[str(i)])) for i in range(3)]
    assert server.unpack(later[2]).accepted == ["2"]  # a gap is no replay
    with pytest.raises(Replayed):
        server.unpack(later[1])
    request = server.pack(CoreRequest("r", [1, 2], SamplingParams(), 0.0))
    with pytest.raises(Malformed, match="not signed"):  # the server's own frame sent back to it
        server.unpack(request)
    with pytest.raises(Malformed, match="not signed"):  # a heartbeat's key is not the outputs'
        server.unpack(Wire(SECRET, CoreHealth, sends=HEARTBEAT).pack(CoreOutputs()))
    renumbered = (10**6).to_bytes(8, "big") + request[8:]
    with pytest.raises(Malformed, match="not signed"):  # the number is signed with the payload
        core.unpack(renumbered)
    assert core.unpack(request).request_id == "r"


def test_a_frame_that_does_not_decode_is_not_accepted_and_moves_nothing():
    """A signed frame that is not one of the protocol's is dropped without taking its number: the
    frames after it are still taken."""
    import msgspec

    sender, receiver = Wire(SECRET, object, sends=FROM_CORE), Wire(SECRET, FromCore, receives=FROM_CORE)
    bad = sender.pack(msgspec.Raw(msgspec.msgpack.encode(42)))
    with pytest.raises(Malformed, match="not one of the protocol's") as e:
        receiver.unpack(bad)
    assert not isinstance(e.value, Replayed) and e.value.reason == "malformed"
    assert receiver.unpack(sender.pack(CoreOutputs(accepted=["x"]))).accepted == ["x"]
    assert len(bad) > MAC_BYTES


def test_frames_cross_a_socket_whole_whatever_the_reads():
    """Frames of every size (empty, one byte, larger than a socket's buffer) arrive whole and in
    order, however the stream cuts them; the end of the stream is EOFError once all were read."""
    a, b = socket.socketpair()
    frames = [b"", b"x", os.urandom(3 << 20), b"y" * 70000] + [bytes([i]) * i for i in range(50)]
    out = FrameSender(a, "test-sender")
    for f in frames:
        out.send(f)
    reader, got = FrameReader(b), []
    while len(got) < len(frames):
        assert reader.wait(10), "nothing arrived"
        got += reader.frames()
    assert got == frames
    out.close(linger=5)
    a.close()
    assert reader.wait(5)
    with pytest.raises(EOFError):
        reader.frames()
    b.close()


def test_a_sender_never_waits_for_the_reader():
    """The core's outputs never wait for the server: its sender queues what the socket cannot take
    (64 MiB sent before anything is read, far past a socket's buffer)."""
    a, b = socket.socketpair()
    out = FrameSender(a, "test-sender")
    sending = threading.Thread(target=lambda: [out.send(b"z" * (1 << 20)) for _ in range(64)])
    sending.start()
    sending.join(60)  # a guard against a hang only: a sender that waits never returns here
    assert not sending.is_alive(), "the sender waited for its reader"
    reader, n = FrameReader(b), 0
    while n < 64:
        assert reader.wait(10)
        n += len(reader.frames())
    out.close(linger=5)
    a.close(), b.close()
    with pytest.raises(OSError):
        FrameWriter(a).write(b"closed")


# ---------------------------------------------------------------------- the processes
def _named_unix_sockets(pids) -> list[str]:
    """The addresses of the unix sockets ``pids`` hold that have one (file system or abstract)."""
    named = []
    for pid in pids:
        try:
            conns = psutil.Process(pid).net_connections(kind="unix")
        except (psutil.NoSuchProcess, psutil.AccessDenied):  # gone, or not readable: non-dumpable
            continue
        named += [f"{pid}: {c.laddr or c.raddr}" for c in conns if c.laddr or c.raddr]
    return named


def test_no_process_can_reach_the_link_during_the_start_or_after(tiny_llama_path, tmp_path):
    """Catches: the socket folder that an unprivileged process of the same user entered in the
    1.8-2.8 s of every start, connecting to the server's sockets and binding its own at their
    names, then relaying every prompt. Watched from the server's start until it serves: nothing
    appears in the temporary directory, and no socket of the server or of the core has a name (file
    system or abstract) that a process could connect to or bind at."""
    from tests.serve.test_cli import _start_server

    seen, named, stop = set(), [], threading.Event()
    me = psutil.Process()
    before = {c.pid for c in me.children()}

    def watch():
        while not stop.is_set():
            try:
                seen.update(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")
                            if p.name.startswith("spear-core") or p.is_socket())
            except OSError:  # a file that went while it was listed
                pass
            servers = [c for c in me.children() if c.pid not in before]
            pids = [p.pid for s in servers for p in [s, *s.children(recursive=True)] if p.is_running()]
            named.extend(_named_unix_sockets(pids))
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        proc, url = _start_server(tiny_llama_path, env={"TMPDIR": str(tmp_path)})
    finally:
        stop.set()
        watcher.join()
    try:
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200
        kids = psutil.Process(proc.pid).children(recursive=True)
        named += _named_unix_sockets([proc.pid] + [k.pid for k in kids])
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
    assert not seen, f"the server made sockets or their folder in the temporary directory: {sorted(seen)}"
    assert not named, f"sockets with a name: {sorted(set(named))}"


def _metric(url: str, name: str, **labels) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(f"{name}{{{want}}} "):
            return float(line.split()[1])
    return 0.0


def _greedy_text(tiny_llama_path, prompt: str, n: int) -> str:
    from spear.serve import EngineConfig, LLMEngine

    eng = LLMEngine.from_pretrained(str(tiny_llama_path), EngineConfig(num_blocks=64, max_model_len=256,
                                                                      max_num_seqs=8))
    return eng.generate([prompt], SamplingParams(max_tokens=n, temperature=0))[0].text


def test_the_cores_replayed_frames_are_dropped_and_counted(tiny_llama_path, caplog):
    """Every frame the core writes, outputs and heartbeats, arrives twice: the copies are dropped
    (not one token twice: the text equals one engine's), counted in /metrics and logged once."""
    want = _greedy_text(tiny_llama_path, "Once upon a time", 12)
    with caplog.at_level(logging.ERROR, logger="spear.serve.frontend.mp_client"):
        with running_server(tiny_llama_path, "tiny", target=core_faults.replaying) as (url, llm):
            wait_ready(llm)
            r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "Once upon a time",
                                                           "max_tokens": 12, "temperature": 0}, timeout=60)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, r.text
            replayed = _metric(url, "spear_core_frames_dropped_total", side="server", reason="replayed")
            # one copy of each output message and heartbeat so far: Loaded, Ready, the request's messages
            assert replayed >= 4, replayed
            assert _metric(url, "spear_core_frames_dropped_total", side="server", reason="malformed") == 0
            assert httpx.get(url + "/health", timeout=5).status_code == 200
    dropped = [r.getMessage() for r in caplog.records if "dropped a message" in r.getMessage()]
    assert len(dropped) == 1 and "replayed frame" in dropped[0], dropped


def test_frames_replayed_to_the_core_are_dropped_and_counted(tiny_llama_path):
    """Every frame the server writes arrives at the core twice, and a finished request's frame is
    written again later: the core takes each once (the text equals one engine's, no refusal of a
    request id in use), runs nothing again, and counts the copies, which /metrics shows."""
    want = _greedy_text(tiny_llama_path, "The capital of France is", 10)
    with running_server(tiny_llama_path, "tiny") as (url, llm):
        wait_ready(llm)
        client, written = llm.client, []
        real = client._writer.write

        def twice(data):  # on the event loop, as every write
            written.append(bytes(data))
            real(data)
            real(data)

        client._writer.write = twice
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "The capital of France is",
                                                       "max_tokens": 10, "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, r.text

        def core_count() -> float:
            return _metric(url, "spear_core_frames_dropped_total", side="core", reason="replayed")

        deadline = time.monotonic() + 10
        while core_count() < len(written):  # the core reports its count with its heartbeat
            assert time.monotonic() < deadline, (core_count(), len(written))
            time.sleep(0.1)
        while llm.stats.num_steps == 0 or llm.stats.num_running:  # stats come with the heartbeats
            assert time.monotonic() < deadline, llm.stats
            time.sleep(0.1)
        steps = llm.stats.num_steps
        counted = core_count()
        request_frame = written[0]  # the request's CoreRequest, whole: it ran once and finished
        client._loop.call_soon_threadsafe(real, request_frame)
        while core_count() < counted + 1:
            assert time.monotonic() < deadline + 10, core_count()
            time.sleep(0.1)
        time.sleep(1.0)  # heartbeats after it: a request that ran again would have stepped
        assert llm.stats.num_steps == steps and llm.stats.num_running == 0
        assert _metric(url, "spear_core_frames_dropped_total", side="core", reason="malformed") == 0


def test_a_second_submission_of_a_running_request_does_not_end_its_stream(tiny_llama_path, caplog):
    """Catches: the core's refusal of a second submission of a running request ("already in use")
    ending that request's stream silently (21 events, then nothing). The core refuses the duplicate
    without touching the request it runs; the server logs the refusal and the stream runs to its end."""
    n = 30
    with caplog.at_level(logging.ERROR, logger="spear.serve.frontend.async_llm"):
        with running_server(tiny_llama_path, "tiny", target=partial(core_faults.slow_steps, 0.05)) as (url, llm):
            wait_ready(llm)
            events: list = []

            def stream():
                body = {"model": "tiny", "prompt": "Hi", "max_tokens": n, "ignore_eos": True, "stream": True}
                try:
                    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as s:
                        events.extend(line for line in s.iter_lines() if line.startswith("data: "))
                except httpx.TimeoutException as exc:
                    events.append(f"timeout: {exc!r}")

            t = threading.Thread(target=stream)
            t.start()
            deadline = time.monotonic() + 30
            while not llm._streams:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            (rid,) = list(llm._streams)
            again = CoreRequest(rid, [1, 2, 3], SamplingParams(max_tokens=2), time.monotonic())
            llm.client._loop.call_soon_threadsafe(llm.client.add, again)
            t.join(60)
    assert not t.is_alive()
    assert events[-1] == "data: [DONE]", events[-3:]
    assert len(events) == n + 1 and '"finish_reason":"length"' in events[-2], events[-3:]
    refused = [r.getMessage() for r in caplog.records if "second submission" in r.getMessage()]
    assert len(refused) == 1 and rid in refused[0] and "already in use" in refused[0], refused


class _Probe:
    """Unpickled first in the core's process, as its target: writes whether torch is imported there
    yet and whether the process is dumpable, without importing anything of spear's."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        code = ("import ctypes, sys\n"
                f"open({self.path!r}, 'w').write(f\"{{'torch' in sys.modules}} {{ctypes.CDLL(None).prctl(3, 0, 0, 0, 0)}}\")")
        return exec, (code,)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_DUMPABLE is Linux's")
def test_the_cores_process_is_not_dumpable_before_it_imports_the_engine(tmp_path):
    """Catches: a core process open to a process of the user for the seconds its imports take
    (torch's) before it made itself non-dumpable: when its target is unpickled, before anything of
    the engine is imported, it is non-dumpable already."""
    import multiprocessing as mp

    from spear.serve import EngineConfig
    from spear.serve.core.process import CoreSpec, sealed_start

    a, b = socket.socketpair()
    spec = CoreSpec(model="unused", config=EngineConfig(), dtype=None, device=None, verify=False, eos_token_ids=(),
                    torch_threads=1, parent_pid=os.getpid(), link=a, beat=b, secret=SECRET)
    target, args = sealed_start(_Probe(str(tmp_path / "probe")), spec)
    proc = mp.get_context("spawn").Process(target=target, args=args)
    proc.start()
    proc.join(120)
    a.close(), b.close()
    assert (tmp_path / "probe").read_text() == "False 0"


def test_both_processes_are_not_dumpable(tiny_llama_path, tmp_path):
    """Neither the server's process nor the core's is dumpable once the core runs: a process of the
    same user without CAP_SYS_PTRACE cannot ptrace them or read their /proc/<pid>/mem."""
    from spear.serve.core.process import dumpable

    if dumpable() is None:
        pytest.skip("no PR_GET_DUMPABLE on this system")
    report = tmp_path / "dumpable"
    with running_server(tiny_llama_path, "tiny", target=partial(core_faults.reporting_dumpable, str(report))) \
            as (url, llm):
        wait_ready(llm)
        assert dumpable() is False
        assert report.read_text() == "0"
        if os.geteuid() != 0:  # root may read any process's memory, dumpable or not
            core = llm.client._proc.pid
            for pid in (os.getpid(), core):
                probe = f"open('/proc/{pid}/mem', 'rb')"
                out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
                assert "PermissionError" in out.stderr, (pid, out.stderr)


def test_spear_serve_is_sealed_before_its_imports():
    """Catches: the server non-dumpable only once serve's main ran, after 4-15 s of the CLI's imports
    in which a process of the user opened its memory and later read prompts there. The command
    line is read first: serve seals at once, other commands do not."""
    import subprocess
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("non-dumpable processes are Linux's")
    code = ("import sys; import spear.cli as c; c._seal_if_serving(sys.argv[1:]); "
            "from spear.serve.core.process import dumpable; print(dumpable())")
    seen = [subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                           check=True).stdout.strip() for args in (["serve"], ["-q", "serve", "--port", "0"], ["run"])]
    assert seen == ["False", "False", "True"]
    # and nothing heavy was imported before the seal: spear.cli alone does not import torch
    out = subprocess.run([sys.executable, "-c", "import sys, spear.cli; print('torch' in sys.modules)"],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"
