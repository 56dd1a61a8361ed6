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

import concurrent.futures as cf
import logging
import multiprocessing as mp
import os
import time
from dataclasses import dataclass, field, replace

import torch

from spear.kernels.layout import Layout
from spear.kernels.policy import KernelPolicy

log = logging.getLogger(__name__)


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
    cached: bool = False  # the probe launch found its kernels compiled: no pool was started


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


def _worker_init(device: str) -> None:
    torch.set_num_threads(1)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))


def _run(launch: W4Launch, device: str, policy: KernelPolicy) -> str | None:
    try:
        run_launch(launch, device, policy)
        return None
    except Exception as exc:  # reported, and compiled on first use instead
        return f"{launch}: {type(exc).__name__}: {exc}"


# A launch that returns within this many seconds found its kernels in the cache (a compile takes
# seconds; a cached launch of the largest layer milliseconds).
CACHED_S = 0.5


def compile_launches(launches: list[W4Launch], device: torch.device | str, policy: KernelPolicy,
                     workers: int) -> CompileReport:
    """Run every launch once, in ``workers`` spawned processes (0 or 1: in this process), largest
    first; never raises for a launch or a broken pool, it reports them. With workers, the largest
    launch runs here first: if it was cached (``CACHED_S``) the cache is taken as warm and no pool
    starts (starting one costs seconds of imports; a launch it missed compiles on first use)."""
    report = CompileReport(launches=len(launches), workers=workers)
    if not launches:
        return report
    t0 = time.perf_counter()
    order = sorted(launches, key=lambda x: -x.n * x.k)  # the largest layers' kernels take longest
    dev = str(torch.device(device))
    if workers <= 1:
        report.failed = [e for e in (_run(x, dev, policy) for x in order) if e is not None]
    elif (probe := _run(order[0], dev, policy)) is None and time.perf_counter() - t0 < CACHED_S:
        report.cached, report.workers = True, 0
    else:
        report.failed = [] if probe is None else [probe]
        order = order[1:]
    if workers > 1 and order and not report.cached:
        try:
            with cf.ProcessPoolExecutor(max_workers=min(workers, len(order)), mp_context=mp.get_context("spawn"),
                                        initializer=_worker_init, initargs=(dev,)) as pool:
                report.failed += [e for e in pool.map(_run, order, [dev] * len(order), [policy] * len(order))
                                  if e is not None]
        except Exception as exc:  # a worker died (out of memory, say): the rest compiles on first use
            report.failed.append(f"the compile pool broke: {type(exc).__name__}: {exc}")
    report.seconds = time.perf_counter() - t0
    return report


def unique(launches: list[tuple[W4Launch, object]]) -> list[W4Launch]:
    """One launch per (form, plan) of ``(launch, plan)`` pairs, the fewest tokens of each: launches
    that differ only in a token count the planner plans alike compile the same kernels."""
    seen: dict[tuple, W4Launch] = {}
    for launch, plan in launches:
        key = (replace(launch, tokens=0), plan)
        if key not in seen or launch.tokens < seen[key].tokens:
            seen[key] = launch
    return list(seen.values())
