"""Faults injected into the engine core's process: each function is a ``target`` for a test
server's MPClient (tests/serve/conftest.py, ``running_server``). It runs in the spawned core
process, patches the engine there, then runs the core as ``spear serve`` does. Bind the fault's
arguments with functools.partial (the target is pickled into the process)."""

from __future__ import annotations

import os
import time

from spear.serve.core.process import core_main


def _wrap_execute(wrap) -> None:
    """Every step of the model runner goes through ``wrap(real_execute, runner, scheduled)``."""
    from spear.serve.model.model_runner import ModelRunner

    real = ModelRunner.execute
    ModelRunner.execute = lambda runner, sched: wrap(real, runner, sched)


def failing_first_steps(n: int, spec) -> None:
    """The model raises on the first ``n`` steps."""
    calls = []

    def wrap(real, runner, sched):
        calls.append(1)
        if len(calls) <= n:
            raise RuntimeError("injected failure")
        return real(runner, sched)

    _wrap_execute(wrap)
    core_main(spec)


def failing_while(flag: str, spec) -> None:
    """The model raises on every step while the file ``flag`` exists (a broken GPU)."""
    def wrap(real, runner, sched):
        if os.path.exists(flag):
            raise RuntimeError("the GPU is gone")
        return real(runner, sched)

    _wrap_execute(wrap)
    core_main(spec)


def hanging_first_step(entered: str, release: str, spec) -> None:
    """The first step writes ``entered`` and does not return until the file ``release`` exists (a hung GPU)."""
    def wrap(real, runner, sched):
        if not os.path.exists(release):
            open(entered, "w").close()
            while not os.path.exists(release):
                time.sleep(0.02)
        return real(runner, sched)

    _wrap_execute(wrap)
    core_main(spec)


def slow_steps(seconds: float, spec) -> None:
    """Every step sleeps ``seconds`` first (no work), so that a stream outlives what a test sends beside it."""
    def wrap(real, runner, sched):
        time.sleep(seconds)
        return real(runner, sched)

    _wrap_execute(wrap)
    core_main(spec)


def slow_warmup(started: str, release: str, spec) -> None:
    """The warm-up writes ``started`` and does not end until the file ``release`` exists."""
    from spear.serve.core.engine import EngineCore

    def warmup(core) -> float:
        open(started, "w").close()
        while not os.path.exists(release):
            time.sleep(0.02)
        return 0.0

    EngineCore.warmup = warmup
    core_main(spec)


def sending_garbage(spec) -> None:
    """Before the core starts, frames that are not the protocol's reach the server on the link: signed
    ones that do not decode (msgpack 42, [], a truncated frame, a message of the wrong shape) and
    unsigned ones (a forged message, an empty frame). Then the core runs as usual."""
    import msgspec

    from spear.serve.core.messages import CoreOutput, CoreOutputs
    from spear.serve.core.wire import FROM_CORE, FrameWriter, Wire

    wire = Wire(spec.secret, object, sends=FROM_CORE)
    out = FrameWriter(spec.link)
    enc = msgspec.msgpack.encode
    for payload in (enc(42), enc([]), b"\xc1", enc(["CoreOutputs", 5])):
        out.write(wire.pack(msgspec.Raw(payload)))
    forged = enc(CoreOutputs(outputs=[CoreOutput("nobody", [1])]))
    out.write(b"\x00" * 32 + forged)
    out.write(b"")
    core_main(spec)


def replaying(spec) -> None:
    """Every frame the core writes, on the link and with its heartbeats, goes twice: the second is a
    replay of the first, as a process that could write on the link would send it."""
    from spear.serve.core.wire import FrameWriter

    real = FrameWriter.write

    def twice(writer, frame):
        real(writer, frame)
        real(writer, frame)

    FrameWriter.write = twice
    core_main(spec)


def reporting_dumpable(path: str, spec) -> None:
    """Writes whether the core's process is dumpable (1, 0; "None" where the system does not say) to
    ``path`` once it runs, before the model loads."""
    from spear.serve.core import process

    real = process._CoreProcess.build

    def build(proc):
        with open(path, "w") as f:
            f.write(str(None if (d := process.dumpable()) is None else int(d)))
        real(proc)

    process._CoreProcess.build = build
    core_main(spec)
