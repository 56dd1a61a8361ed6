"""``spear serve``'s engine core forked from its sealed command line (spear/serve/core/zygote.py): the
zygote is non-dumpable from the moment it exists, runs one core with the link's sockets it was
sent, exits with the core's code, and exits at once when its parent closes its socket or dies.
Each case forks in a fresh interpreter of its own, as the command line does (one thread, no torch)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the zygote is Linux's")

ROOT = Path(__file__).resolve().parents[2]

# run first in each script: sealed as spear serve's command line is, then the zygote forked
_FORK = """
import ctypes, os, sys
assert ctypes.CDLL(None).prctl(4, 0, 0, 0, 0) == 0
from spear.serve.core.zygote import Zygote, forkable
assert forkable()
z = Zygote()
print(z.pid, 'torch' in sys.modules, flush=True)
"""


def _unprivileged() -> list[str]:
    """The prefix that runs a command as a process of this user without CAP_SYS_PTRACE: for root,
    none of its capabilities, as benchmarks/attack_core_sockets.py runs both sides (root without
    them is refused a process of root that has them, dumpable or not)."""
    with open("/proc/self/status") as f:
        effective = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
    if os.geteuid() != 0 or not effective:
        return []
    if subprocess.run(["setpriv", "--version"], capture_output=True).returncode != 0:
        pytest.skip("root, and no setpriv to drop its capabilities")
    return ["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--"]


def opens_memory(pid: int) -> str:
    """What a fresh process of this user without CAP_SYS_PTRACE gets opening /proc/<pid>/mem."""
    probe = f"open('/proc/{pid}/mem', 'rb'); print('opened')"
    out = subprocess.run([*_unprivileged(), sys.executable, "-c", probe], capture_output=True, text=True)
    return out.stdout.strip() or out.stderr.strip().splitlines()[-1]


def _script(body: str) -> subprocess.Popen:
    """``body`` after _FORK in a fresh interpreter of this user without CAP_SYS_PTRACE."""
    return subprocess.Popen([*_unprivileged(), sys.executable, "-c", _FORK + body], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _report(path: str, spec) -> None:
    """A core's target: writes whether its process is dumpable, the server's child and would pass
    the link to a program it runs, answers on both sockets it was sent, and exits with code 3."""
    import ctypes

    inheritable = spec.link.get_inheritable() or spec.beat.get_inheritable()
    Path(path).write_text(f"{ctypes.CDLL(None).prctl(3, 0, 0, 0, 0)} {os.getppid() == spec.parent_pid} {inheritable}")
    spec.link.sendall(b"link")
    spec.beat.sendall(b"beat")
    raise SystemExit(3)


def test_the_zygote_is_sealed_from_the_start_and_runs_one_core_with_its_sockets(tmp_path):
    """The zygote is forked without torch, non-dumpable before any request: a process of the user
    cannot open its memory. Sent a core, it runs it as the server's child, non-dumpable, with the
    link's two sockets (not inherited by what it execs), and exits with the core's code; a second
    core is refused."""
    body = f"""
from tests.serve.test_zygote import opens_memory
print(opens_memory(z.pid), flush=True)
import socket
from functools import partial
from spear.serve import EngineConfig
from spear.serve.core.process import CoreSpec
from tests.serve.test_zygote import _report
link, core_link = socket.socketpair()
beat, core_beat = socket.socketpair()
spec = CoreSpec(model="unused", config=EngineConfig(), dtype=None, device=None, verify=False, eos_token_ids=(),
                torch_threads=1, parent_pid=os.getpid(), link=core_link, beat=core_beat, secret=b"k" * 32)
proc = z.start(partial(_report, {str(tmp_path / "report")!r}), spec)
core_link.close(), core_beat.close()
print(link.recv(16).decode(), beat.recv(16).decode(), flush=True)
proc.join(60)
print(proc.pid == z.pid, proc.exitcode, proc.is_alive())
try:
    z.start(partial(_report, "unused"), spec)
except RuntimeError as exc:
    print("refused:", exc)
"""
    proc = _script(body)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    lines = out.splitlines()
    assert lines[0].split()[1] == "False", "the zygote was forked after torch was imported"
    assert lines[1].startswith("PermissionError"), lines[1]
    assert lines[2:5] == ["link beat", "True 3 False", "refused: this zygote has started its core already, or was closed"]
    assert (tmp_path / "report").read_text() == "0 True False"


@pytest.mark.parametrize("how", ["closed", "killed"])
def test_the_zygote_exits_when_its_parent_closes_its_socket_or_dies(how):
    """Catches: a zygote that outlives a server that never started its core (``--help``, a bad
    setting, a crash): it exits at the end of its socket (closed: reaped by ``close`` within a
    second, no SIGKILL needed) and when its parent dies."""
    body = "import time\n" + ("t = time.monotonic(); z.close(); print(round(time.monotonic() - t, 3))" if how == "closed"
                              else "time.sleep(600)")
    proc = _script(body)
    pid = int(proc.stdout.readline().split()[0])
    zygote = psutil.Process(pid)
    assert zygote.ppid() == proc.pid
    if how == "killed":
        proc.kill()
        proc.wait(30)
        deadline = time.monotonic() + 10
        while True:
            try:
                if zygote.status() == psutil.STATUS_ZOMBIE:  # under an init that does not reap
                    break
            except psutil.NoSuchProcess:
                break
            assert time.monotonic() < deadline, "the zygote outlived its parent"
            time.sleep(0.05)
    else:
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert float(out.strip()) < 1.0, out
        assert not psutil.pid_exists(pid) or zygote.status() == psutil.STATUS_ZOMBIE


def test_spear_serve_that_starts_no_core_leaves_no_process():
    """``spear serve --help`` and a bad setting end at once, the zygote with them: the pipes they
    write to close (a zygote left behind would hold them open)."""
    for args in (["serve", "--help"], ["serve", "--model", "/no/such/folder", "--port", "0"]):
        started = time.monotonic()
        res = subprocess.run([sys.executable, "-m", "spear", *args], capture_output=True, text=True, timeout=120,
                             cwd=ROOT)
        assert res.returncode == (0 if "--help" in args else 2), res.stderr[-2000:]
        assert time.monotonic() - started < 60


def test_spear_serves_core_is_its_child_and_sealed_from_its_first_sight(tiny_llama_path):
    """Catches: the core spawned (exec'd, so dumpable until its interpreter and multiprocessing's
    bootstrap ran: 0.1-0.4 s), in which a process of the same user opened its /proc/<pid>/mem and
    took its link's sockets. A process of the user without CAP_SYS_PTRACE, watching from the
    server's start, is refused the memory of every child of the server from the moment it first
    sees it; the core is that child, named spear-core, and still refuses it once serving."""
    from tests.serve.conftest import free_port, wait_healthy

    watch = """
import json, os, sys, time
server, seen = sys.argv[1], {}
while not os.path.exists(sys.argv[2]):
    try:
        kids = open(f"/proc/{server}/task/{server}/children").read().split()
    except OSError:
        break
    for kid in kids:
        try:
            os.close(os.open(f"/proc/{kid}/mem", os.O_RDONLY))
            what = "opened"
        except FileNotFoundError:
            continue
        except OSError as exc:
            what = type(exc).__name__
        seen.setdefault(kid, set()).add(what)
    time.sleep(0.001)
print(json.dumps({k: sorted(v) for k, v in seen.items()}))
"""
    prefix, port = _unprivileged(), free_port()
    stop = Path(f"/tmp/spear-zygote-watch-{os.getpid()}-{port}")
    proc = subprocess.Popen([*prefix, sys.executable, "-m", "spear", "-q", "serve", "--model", str(tiny_llama_path), "--port",
                             str(port), "--num-blocks", "64", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watcher = subprocess.Popen([*prefix, sys.executable, "-c", watch, str(proc.pid), str(stop)],
                               stdout=subprocess.PIPE, text=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", 120, proc, "spear serve")
        kids = psutil.Process(proc.pid).children()
        late = {k.pid: opens_memory(k.pid) for k in kids}
        stop.touch()
        seen = json.loads(watcher.communicate(timeout=30)[0])
        assert seen and all(v == ["PermissionError"] for v in seen.values()), seen
        assert [(k.name(), k.ppid()) for k in kids] == [("spear-core", proc.pid)], kids
        assert list(seen) == [str(kids[0].pid)] and late[kids[0].pid].startswith("PermissionError"), (seen, late)
    finally:
        stop.unlink(missing_ok=True)
        if watcher.poll() is None:
            watcher.kill()
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
    assert proc.returncode == 0


def test_spear_serves_core_dies_with_its_server(tiny_llama_path):
    """The server killed (SIGKILL: no shutdown of its own) takes its forked core with it."""
    from tests.serve.test_cli import _start_server

    proc, _ = _start_server(tiny_llama_path)
    try:
        (core,) = psutil.Process(proc.pid).children()
        proc.kill()
        proc.wait(30)
        _, alive = psutil.wait_procs([core], timeout=10)
        assert not alive or core.status() == psutil.STATUS_ZOMBIE, "the engine core outlived its killed server"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)
