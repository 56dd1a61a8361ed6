"""The processes of tensor-parallel ranks 1..N-1, driven by rank 0 (the engine's process).

Rank 0 runs the scheduler, the sampler and the detokenizer; every rank holds its share of the
model (spear/serve/model/llama.py with ``tp``), its KV cache and its CUDA graphs. Each step rank 0
sends the step's ``StepInputs`` (host arrays) down one pipe per worker and runs it itself; the
ranks' layers then meet in the same collectives. The pipes also carry start-up: each worker
reports that it started (before the process group forms, so a worker that cannot start is an
error, not a hang), then how many KV blocks fit beside its share of the weights (rank 0 takes
the smallest), then that it is ready.

A worker that fails reports the error on its pipe and exits; rank 0 turns it into a SpearError
naming the rank. Workers are daemonic: they end with rank 0's process. No control message
goes through a collective, so an idle server holds no collective open (their timeouts bound
only the wait inside a step).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from spear.errors import SpearError
from spear.serve.config import EngineConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to build its rank (picklable): the engine's own config, whole."""

    path: str                 # the checkpoint or HF folder
    config: EngineConfig      # the engine's settings (tensor_parallel_size ranks in all)
    address: str              # tcp://host:port of the process group's rendezvous
    device_type: str          # "cuda" (rank r on cuda:r) or "cpu"
    dtype: str                # "float16", "bfloat16", "float32"
    verify: bool

    @property
    def size(self) -> int:
        return self.config.tensor_parallel_size


def free_address() -> str:
    """A rendezvous address on this host with a free port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def spawn_ranks(path, config, device, dtype, verify: bool) -> tuple["WorkerPool", object]:
    """Check that the model at ``path`` splits over ``config.tensor_parallel_size`` ranks (one line
    now, not one per rank later) and start ranks 1..N-1; (their pool, rank 0's device)."""
    import torch

    from spear.models.checkpoint import read_hf_config
    from spear.parallel.shard import TPRank, check_splits
    from spear.serve.model.llama import check_supported

    n = config.tensor_parallel_size
    model_config = read_hf_config(path)
    check_supported(model_config)
    check_splits(model_config, TPRank(0, n))
    if device.type == "cuda":
        if torch.cuda.device_count() < n:
            raise SpearError(f"tensor parallelism over {n} ranks needs {n} CUDA devices; "
                             f"{torch.cuda.device_count()} visible")
        if device.index not in (None, 0):
            raise SpearError("tensor-parallel ranks take cuda:0..N-1 (rank 0 on cuda:0); set "
                             "CUDA_VISIBLE_DEVICES to choose the GPUs")
        device = torch.device("cuda:0")
    spec = WorkerSpec(str(path), config, free_address(), device.type, str(dtype).removeprefix("torch."), verify)
    return WorkerPool(spec), device


class WorkerPool:
    """Ranks 1..size-1 of a tensor-parallel engine, one spawned process each; ``comms``: rank 0's
    collectives once made (``shutdown`` closes them before the group they were made for)."""

    def __init__(self, spec: WorkerSpec, start_timeout_s: float = 600.0):
        self.spec, self.start_timeout_s = spec, start_timeout_s
        self.broken: str | None = None  # a step failed on rank 0 after it was sent: workers may wait in it
        self.comms: list = []
        ctx = mp.get_context("spawn")  # CUDA and torch's threads do not survive fork
        self.conns, self.procs = [], []
        for rank in range(1, spec.size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(rank, spec, child), name=f"spear-tp{rank}", daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def form_group(self, device, timeout_s: float) -> None:
        """Once every worker has started, join the process group with them as rank 0."""
        from spear.parallel.comm import init_group
        from spear.parallel.shard import TPRank

        self.wait("that it started")
        try:
            init_group(TPRank(0, self.spec.size), self.spec.address, device, timeout_s)
        except Exception as exc:  # a worker that failed after it started: its own message says why
            raise SpearError(f"the tensor-parallel ranks did not form a group: {self.errors() or exc}") from None

    def shutdown(self) -> None:
        """Stop the workers, close rank 0's collectives and leave the process group."""
        from spear.parallel.comm import destroy_group

        self.close()
        for comm in self.comms:
            comm.close()
        destroy_group()

    def wait(self, what: str) -> list:
        """Each worker's next report (``what`` names it in errors), in rank order; the first error or
        exit of any worker is raised at once."""
        from multiprocessing.connection import wait

        out: dict[int, object] = {}
        deadline = time.monotonic() + self.start_timeout_s
        pending = dict(enumerate(self.conns, start=1))
        while pending:
            left = deadline - time.monotonic()
            ready = wait(list(pending.values()) + [self.procs[r - 1].sentinel for r in pending], max(0.0, left))
            if not ready:
                raise SpearError(f"tensor-parallel rank {min(pending)} did not report {what} within "
                                 f"{self.start_timeout_s:.0f} s")
            for rank, conn in list(pending.items()):
                proc = self.procs[rank - 1]
                if conn not in ready and proc.sentinel not in ready:
                    continue
                try:
                    if not conn.poll(0):  # the process ended without a word
                        raise EOFError
                    status, value = conn.recv()
                except EOFError:
                    proc.join(1)
                    raise SpearError(f"tensor-parallel rank {rank} exited (code {proc.exitcode}) before {what}") \
                        from None
                if status == "error":
                    raise SpearError(f"tensor-parallel rank {rank}: {value}")
                out[rank] = value
                del pending[rank]
        return [out[r] for r in sorted(out)]

    def errors(self) -> str | None:
        """A worker's reported error or exit, if any worker has failed (without waiting)."""
        for rank, (conn, proc) in enumerate(zip(self.conns, self.procs), start=1):
            if conn.poll(0) or not proc.is_alive():
                return f"rank {rank}: {self._why(conn, proc)}"
        return None

    def send(self, message) -> None:
        """Send ``message`` to every worker, pickled once for all of them."""
        from multiprocessing.reduction import ForkingPickler

        data = bytes(ForkingPickler.dumps(message))
        for rank, (conn, proc) in enumerate(zip(self.conns, self.procs), start=1):
            try:
                conn.send_bytes(data)  # the worker's recv() unpickles it
            except (BrokenPipeError, ConnectionResetError, OSError):
                raise SpearError(f"tensor-parallel rank {rank} is gone ({self._why(conn, proc)})") from None

    def run(self, step) -> None:
        """Send a step to every worker (rank 0 runs it itself)."""
        self.send(("run", step))

    @staticmethod
    def _why(conn, proc) -> str:
        try:
            if conn.poll(0):
                status, value = conn.recv()
                if status == "error":
                    return value
        except (EOFError, OSError):
            pass
        return f"exit code {proc.exitcode}"

    def close(self, timeout: float = 30.0) -> None:
        """Stop the workers (each leaves the process group and exits); kill any that do not (at once
        when a failed step may hold them in a collective)."""
        if self.broken is not None:
            timeout = min(timeout, 2.0)
        for conn in self.conns:
            try:
                conn.send(None)
            except (BrokenPipeError, ConnectionResetError, OSError):
                pass
        for proc in self.procs:
            proc.join(timeout)
            if proc.is_alive():
                log.warning("tensor-parallel worker %s did not stop in %.0f s; killing it", proc.name, timeout)
                proc.kill()
                proc.join(5)
        for conn in self.conns:
            conn.close()
        self.conns, self.procs = [], []


def _worker_main(rank: int, spec: WorkerSpec, conn) -> None:
    """One worker: join the group, build this rank's share, then run what rank 0 sends."""
    import signal

    from spear.parallel.comm import ENV, destroy_group

    # Ctrl-C reaches the whole process group: rank 0 drains its requests and then stops the workers
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    try:
        import torch

        if spec.device_type == "cpu":  # ranks share the host's cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.size))
        conn.send(("ok", "started"))
        runner = _build(rank, spec, conn)
        conn.send(("ok", "ready"))
        while True:
            message = conn.recv()
            if message is None:
                break
            _, step = message
            runner.run(step)
    except EOFError:  # rank 0 went away
        pass
    except BaseException as exc:
        traceback.print_exc()
        try:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
        os._exit(1)
    finally:
        destroy_group()
    conn.close()


def _build(rank: int, spec: WorkerSpec, conn):
    """Rank ``rank``'s share (spear/serve/model/rank.py), agreeing with rank 0 over ``conn``: this rank's
    KV capacity up, the blocks and context every rank uses down."""
    import torch

    from spear.parallel.comm import init_group
    from spear.parallel.shard import TPRank
    from spear.serve.model import loader
    from spear.serve.model.rank import build_rank

    tp = TPRank(rank, spec.size)
    device = torch.device(f"cuda:{rank}" if spec.device_type == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    init_group(tp, spec.address, device, spec.config.tp_timeout_s)
    cfg, quantized, tensors = loader.from_folder(Path(spec.path), spec.verify)

    def agree(blocks: int) -> tuple[int, int]:
        conn.send(("ok", blocks))
        return conn.recv()

    return build_rank(cfg, quantized, tensors, spec.config, tp, device, getattr(torch, spec.dtype), agree).runner
