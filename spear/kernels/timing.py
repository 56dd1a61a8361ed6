"""Timing protocol of the kernel sweeps (``spear tune-kernels``) and benchmarks (benchmarks/).

Each timing is a CUDA graph of back-to-back calls replayed after warm-up, timed with CUDA
events, median over replays; callers pass one call per weight copy, with enough copies
(``copies_for``) to exceed twice the L2 cache so every call streams its weights from HBM.
"""

from __future__ import annotations

import math
import statistics

import torch


def time_calls(fns, target_s=0.02, max_reps=30):
    """Median µs per call of a CUDA graph that runs every fn once (one per weight copy)."""
    for f in fns:
        f()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    for _ in range(2):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    reps = max(5, min(max_reps, int(target_s * 1e3 / max(start.elapsed_time(end), 1e-3))))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in events:
        a.record()
        graph.replay()
        b.record()
    torch.cuda.synchronize()
    med_ms = statistics.median(a.elapsed_time(b) for a, b in events)
    del graph
    return 1e3 * med_ms / len(fns)


def profile_calls(fns, reps=5):
    """GPU time per call by kernel name (torch.profiler over replays of the graph that
    :func:`time_calls` times), largest first: [(name, µs per call, launches per call)]. The sum
    against time_calls' wall time per call shows the gaps (launch, fork/join, dependencies)."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    rows = profile_graph(graph, reps, reps * len(fns))
    del graph
    return rows


def profile_graph(graph, reps, units):
    """GPU time by kernel name over ``reps`` replays of a captured graph, per one of ``units``
    (calls, steps), largest first: [(name, µs per unit, launches per unit)]."""
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us > 0 and "cudaGraph" not in e.key:
            rows.append((e.key[:80], us / units, e.count / units))
    return sorted(rows, key=lambda r: -r[1])


def copies_for(nbytes, l2):
    """Weight copies whose calls, one after another, stream more than twice the L2 cache."""
    return max(1, min(64, math.ceil(2 * l2 / max(nbytes, 1))))
