"""``spear serve``'s engine core, forked from the server's process before the server imports anything
heavy, so that it is non-dumpable from its first instruction.

A process that execs starts dumpable (exec resets the flag), so a spawned core is open to a process
of the user from its exec until it seals itself (core/wire.py). A forked child inherits the flag,
and its address space is a new one: a /proc/<pid>/mem opened on the parent before does not reach
it. The server cannot fork its core when it starts it: by then it has imported torch and runs
threads, whose locks and pools a forked child does not get back. So ``spear serve``'s command
line forks a ``Zygote`` at once (spear/cli ``main``), right after it made its process non-dumpable
and while that runs one thread: the child waits for one request on a socket pair of its own, the
core's target and spec (pickled) with the link's two sockets as descriptors (SCM_RIGHTS), then
runs ``target(spec)`` as core/process.py's ``sealed_start`` does and exits with its code. It
exits at once at the end of its socket (the server went away, or never asked: ``--help``, a bad
setting) or when the server's process dies (PR_SET_PDEATHSIG). One zygote makes one core.
Linux only; elsewhere, and where a server is embedded without the CLI, MPClient spawns the core.
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import os
import pickle
import signal
import socket
import struct
import sys
import threading
import time
import traceback

_PR_SET_PDEATHSIG, _PR_SET_NAME = 1, 15
_LENGTH = struct.Struct("!Q")  # the request's pickle, after its length


def forkable() -> bool:
    """Whether this process may fork a zygote: on Linux, while it runs one thread (a fork copies the
    thread that forks alone: the others' locks stay held in the child for good)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False


class Zygote:
    """Forks the child that becomes the engine core's process; ``start`` sends it the core."""

    def __init__(self):
        ours, theirs = socket.socketpair()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            ours.close()
            _child(theirs, parent)  # never returns
        theirs.close()
        self.pid = pid
        self._control: socket.socket | None = ours

    def start(self, target, spec) -> ForkedProcess:
        """Run ``target(spec)`` in the zygote (core/process.py's CoreSpec: its ``link`` and ``beat``
        travel as descriptors, the rest pickled) and return its process. A zygote that is gone
        already is returned as such: its exit code says so."""
        if self._control is None:
            raise RuntimeError("this zygote has started its core already, or was closed")
        blob = pickle.dumps((target, dataclasses.replace(spec, link=None, beat=None)))
        control, self._control = self._control, None
        try:
            socket.send_fds(control, [_LENGTH.pack(len(blob)), blob], [spec.link.fileno(), spec.beat.fileno()])
        except OSError:  # the zygote died (it is reaped, and reported, as the core)
            pass
        finally:
            control.close()
        return ForkedProcess(self.pid)

    def close(self) -> None:
        """Without a core started: end the zygote (it exits at the end of its socket) and reap it."""
        if self._control is None:
            return
        self._control.close()
        self._control = None
        proc = ForkedProcess(self.pid)
        proc.join(2.0)
        if proc.is_alive():  # stopped (SIGSTOP), it does not read the end of its socket
            proc.kill()
            proc.join()


def _child(control: socket.socket, parent: int):
    """The zygote's life: one request, the core, the exit. Never returns into the code that forked it."""
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's: it stops the core
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent:  # the server died before the line above
            code = 0
            return
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(b"spear-core"), 0, 0, 0)
        request = _receive(control)
        control.close()
        if request is None:
            code = 0
            return
        target, spec = request
        code = _run(target, spec)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def _receive(control: socket.socket):
    """(target, spec with its link and beat) sent by ``Zygote.start``; None at the end of the socket
    before a whole request."""
    data, fds, flags, _ = socket.recv_fds(control, 1 << 16, 2)
    for fd in fds:  # as the sockets the server made: a program the core runs does not get them
        os.set_inheritable(fd, False)
    socks = [socket.socket(fileno=fd) for fd in fds]
    if flags & socket.MSG_CTRUNC or len(socks) != 2:
        for s in socks:
            s.close()
        if not data:
            return None
        raise OSError("the zygote's request came without the link's two sockets")
    data = bytearray(data)
    while len(data) < _LENGTH.size or len(data) < _LENGTH.size + _LENGTH.unpack_from(data)[0]:
        chunk = control.recv(1 << 20)
        if not chunk:
            for s in socks:
                s.close()
            return None
        data += chunk
    target, spec = pickle.loads(data[_LENGTH.size:])
    link, beat = socks
    return target, dataclasses.replace(spec, link=link, beat=beat)


def _run(target, spec) -> int:
    """``target(spec)``'s exit code, as multiprocessing gives a process's; then what an interpreter's
    exit runs (atexit: multiprocessing's ends the ranks the core started)."""
    try:
        target(spec)
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            sys.stderr.write(f"{exc.code}\n")
            code = 1
    except BaseException:
        sys.stderr.write("the engine core's process:\n")
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    return code


class ForkedProcess:
    """What MPClient uses of multiprocessing.Process, for a child of this process: ``pid``,
    ``is_alive``, ``join``, ``terminate``, ``kill`` and ``exitcode`` (negative: the signal that
    ended it). Reaped with os.waitpid, once, under a lock: any thread may call any of them."""

    def __init__(self, pid: int):
        self.pid = pid
        self._lock = threading.Lock()
        self._exitcode: int | None = None

    @property
    def exitcode(self) -> int | None:
        with self._lock:
            if self._exitcode is None:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:  # reaped elsewhere (SIGCHLD ignored): how it ended is not known
                    self._exitcode = 255
                else:
                    if pid:
                        self._exitcode = os.waitstatus_to_exitcode(status)
            return self._exitcode

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        if timeout is None:
            try:  # until it exits, without reaping it: the lock's holder does
                os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT)
            except ChildProcessError:  # reaped by another thread already
                pass
            self.exitcode
            return
        deadline = time.monotonic() + timeout
        while self.exitcode is None and (left := deadline - time.monotonic()) > 0:
            time.sleep(min(0.01, left))

    def _signal(self, signum: int) -> None:
        with self._lock:  # not reaped meanwhile: the pid is still this child's
            if self._exitcode is None:
                try:
                    os.kill(self.pid, signum)
                except ProcessLookupError:
                    pass

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)
