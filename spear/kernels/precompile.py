"""Compile the W4 GEMM's launches into Triton's disk cache in parallel, before a warm-up runs them.

Triton compiles a kernel on one CPU thread of the process that launches it first, so an engine that
warms up by running its step shapes one after another compiles one kernel at a time: Llama-3-8B at a
512-token budget waited 351 s for ``spear serve`` on a 16-core H100 host with a cold cache, and 1.1 s
for the same warm-up once the cache held the kernels (benchmarks/data/run30-h100-2026-12-07/
http-default/stdout.txt). Triton has no compile pass apart from a launch, and the launch's binding
(which integers and pointers it specializes on) is its own; so each distinct launch (:class:`W4Launch`:
a layer's shape, weight format, compensator form, activation, bias, dtype, PDL level and a token count
the planner plans for) is run once by a worker process on a layer of the same form filled with random
codes (a kernel's compiled form follows shapes, formats and flags, not values). The serial warm-up
after it finds its kernels in the cache. Only a speed-up: a launch a worker could not run is compiled
where it is first used, as without this pass.

    launches = unique(...)                          # one per (form, plan): what the engine will meet
    report = compile_launches(launches, device, policy, workers=8)
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from spear.kernels.layout import Layout
from spear.kernels.policy import KernelPolicy


@dataclass(frozen=True)
class W4Launch:
    """One call of ``w4a16_linear`` as far as what it compiles goes."""

    n: int                # output features
    k: int                # input features
    group_size: int       # 0: per channel
    symmetric: bool
    layout: Layout
    rank: int             # the compensator's kernel rank (padded); 0: none
    hidden: int           # its gate's hidden width (padded); 0: ungated
    act: int              # 1: SiLU·mul of interleaved (gate, up) features
    bias: bool
    dtype: torch.dtype
    tokens: int
    pdl: int


@dataclass
class CompileReport:
    """What a parallel compile pass did: launches run, launches that failed (with why), seconds."""

    launches: int = 0
    failed: list[str] = field(default_factory=list)
    seconds: float = 0.0
    workers: int = 0
    cached: bool = False  # the probe launch found its kernels compiled: no worker was started


def default_workers() -> int:
    """Processes for a compile pass: the cores this process may use, less one, at most 16."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(16, cores - 1))


def run_launch(launch: W4Launch, device: torch.device | str, policy: KernelPolicy) -> None:
    """Run ``launch`` once on a random layer of its form on ``device`` (what a worker does; on the CPU
    the op runs its torch reference and nothing compiles)."""
    from spear.kernels.layout import pack, pack_ec
    from spear.kernels.ops import w4a16_linear

    dev = torch.device(device)
    g = torch.Generator(device="cpu").manual_seed(0)
    n, k = launch.n, launch.k
    groups = 1 if launch.group_size == 0 else k // launch.group_size
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n, groups, generator=g) * 0.01 + 1e-3).to(torch.float16)
    zeros = torch.full((n, groups), 8, dtype=torch.uint8) if launch.symmetric else \
        torch.randint(0, 16, (n, groups), generator=g, dtype=torch.uint8)
    w = pack(codes.to(dev), scales.to(dev), zeros.to(dev), launch.group_size, launch.symmetric, launch.layout)
    ec = None
    if launch.rank:
        r, h = launch.rank, launch.hidden
        a, b = torch.randn(r, k, generator=g) * 0.01, torch.randn(n, r, generator=g) * 0.01
        gate = dict(w1=torch.randn(h, r, generator=g).to(dev), b1=torch.zeros(h, device=dev),
                    w2=torch.randn(r, h, generator=g).to(dev), b2=torch.zeros(r, device=dev)) if h else {}
        ec = pack_ec(a.to(dev), b.to(dev), 1.0, launch.dtype, **gate)
    x = torch.randn(launch.tokens, k, generator=g).to(dev, launch.dtype)
    bias = torch.zeros(n, dtype=launch.dtype, device=dev) if launch.bias else None
    w4a16_linear(x, w, bias, ec, launch.act, policy, launch.pdl)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _run(launch: W4Launch, device: str, policy: KernelPolicy) -> str | None:
    try:
        run_launch(launch, device, policy)
        return None
    except Exception as exc:  # reported, and compiled on first use instead
        return f"{launch}: {type(exc).__name__}: {exc}"


def _worker() -> None:
    """A worker process (``python -m spear.kernels.precompile``): (launches, device, policy, result
    path) pickled on stdin; the failures pickled to the result path. Workers are plain interpreters
    rather than multiprocessing's spawned children, which re-import the parent's main script: an
    embedding script without a ``__main__`` guard would load its model again in every worker."""
    launches, device, policy, result = pickle.load(sys.stdin.buffer)
    torch.set_num_threads(1)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    Path(result).write_bytes(pickle.dumps([e for e in (_run(x, device, policy) for x in launches) if e is not None]))


# A launch that returns within this many seconds found its kernels in the cache (a compile takes
# seconds; a cached launch of the largest layer milliseconds).
CACHED_S = 0.5
# The whole pass stops its workers after this long (a hung GPU or compiler must not hold the start);
# what they did not compile compiles on first use.
TIMEOUT_S = 900.0


def compile_launches(launches: list[W4Launch], device: torch.device | str, policy: KernelPolicy, workers: int,
                     cached_s: float = CACHED_S, timeout_s: float = TIMEOUT_S) -> CompileReport:
    """Run every launch once, in ``workers`` worker processes (0 or 1: in this process), largest
    first; never raises for a launch or a worker that fails, it reports them. With workers, the
    largest launch runs here first: if it returned within ``cached_s`` the cache is taken as warm and
    no worker starts (each costs seconds of imports; a launch the cache missed compiles on first use).
    Workers still running after ``timeout_s`` are stopped."""
    report = CompileReport(launches=len(launches), workers=workers)
    if not launches:
        return report
    t0 = time.perf_counter()
    order = sorted(launches, key=lambda x: -x.n * x.k)  # the largest layers' kernels take longest
    dev = str(torch.device(device))
    if workers <= 1:
        report.failed = [e for e in (_run(x, dev, policy) for x in order) if e is not None]
    elif (probe := _run(order[0], dev, policy)) is None and time.perf_counter() - t0 < cached_s:
        report.cached, report.workers = True, 0
    else:
        report.failed = [] if probe is None else [probe]
        if rest := order[1:]:
            report.workers = min(workers, len(rest))
            report.failed += _in_workers(rest, dev, policy, report.workers, timeout_s - (time.perf_counter() - t0))
    report.seconds = time.perf_counter() - t0
    return report


def _in_workers(order: list[W4Launch], device: str, policy: KernelPolicy, workers: int, timeout: float) -> list[str]:
    """Run ``order`` in ``workers`` worker processes (each every workers-th launch, so the largest
    spread over them); the failures, a worker that died or ran out of time included."""
    import spear

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(spear.__file__).resolve().parents[1])] +
                                                      [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                       if p]))
    procs, failed = [], []
    with tempfile.TemporaryDirectory(prefix="spear-compile-") as tmp:
        try:
            for i in range(workers):
                result = Path(tmp) / f"worker{i}.pickle"
                log_file = open(Path(tmp) / f"worker{i}.log", "w+b")
                proc = subprocess.Popen([sys.executable, "-m", "spear.kernels.precompile"], stdin=subprocess.PIPE,
                                        stdout=log_file, stderr=subprocess.STDOUT, env=env)
                procs.append((proc, log_file, result))
                proc.stdin.write(pickle.dumps((order[i::workers], device, policy, str(result))))
                proc.stdin.close()
            end = time.monotonic() + timeout
            for proc, log_file, result in procs:
                try:
                    code = proc.wait(timeout=max(0.0, end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    failed.append("a compile worker ran past the pass's time limit and was stopped")
                    continue
                if code == 0 and result.is_file():
                    failed += pickle.loads(result.read_bytes())
                else:
                    log_file.seek(0)
                    tail = log_file.read().decode(errors="replace").strip().splitlines()[-1:]
                    failed.append(f"a compile worker exited with code {code}: {' '.join(tail)}")
        except OSError as exc:  # no process could be started: the kernels compile on first use
            failed.append(f"compile workers could not start: {exc}")
        finally:
            for proc, log_file, _ in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                log_file.close()
    return failed


def unique(launches: list[tuple[W4Launch, object]]) -> list[W4Launch]:
    """One launch per (form, plan) of ``(launch, plan)`` pairs, the fewest tokens of each: launches
    that differ only in a token count the planner plans alike compile the same kernels."""
    seen: dict[tuple, W4Launch] = {}
    for launch, plan in launches:
        key = (replace(launch, tokens=0), plan)
        if key not in seen or launch.tokens < seen[key].tokens:
            seen[key] = launch
    return list(seen.values())


if __name__ == "__main__":
    _worker()
