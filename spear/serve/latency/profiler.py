"""Measuring a deployment's latency table by timing real engine steps (``spear profile``).

For each context L and decode count d of the grid, ``profile`` brings d requests to their decode
phase through the engine core (prompts of about L random token ids, greedy, EOS ignored), then runs
rounds over the grid's step sizes: a step of T tokens (T > 0) is one more request of a (T - d)-token
prompt and ``max_tokens=1``, admitted and prefilled whole in the next step beside the d decodes and
finished by it; T = 0 is the decode-only step. The grid's step sizes are CUDA graph sizes of the
mixed steps (16, 32, 64, 128, 192, then multiples of 128: spear/serve/model/graphs.py), so every timed
mixed step runs unpadded. Each timed step is checked against the engine's step record (exactly d
decodes and T - d prefill tokens) and timed around ``engine.step()`` with CUDA synchronized on both
sides. The first ``warmup`` rounds are not timed; a point's time is the median of its ``repeats``.
The decodes' context grows by one token a step, so their prompts start about half a block's timed
steps below L, and the rounds interleave the sizes: every size is timed at contexts centred on L
(the table records the mean context each point saw).

``table_for`` is the engine's start-up hook when it has a target and no table: the cached one,
else a profile on ``quick_grid`` (fitted to the engine's limits), written to the cache.
"""

from __future__ import annotations

import logging
import random
import statistics
import time
from dataclasses import dataclass

import torch

from spear.errors import SpearError
from spear.serve.latency.table import LatencyTable, cache_path, load_cached
from spear.serve.core.messages import CoreRequest, SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Grid:
    decodes: tuple[int, ...]
    tokens: tuple[int, ...]   # step sizes: 0 (decode-only), then mixed steps of more tokens than decodes
    contexts: tuple[int, ...]

    def __post_init__(self):
        for name, minimum in (("decodes", 1), ("tokens", 0), ("contexts", 1)):
            v = getattr(self, name)
            if not v or any(isinstance(x, bool) or not isinstance(x, int) or x < minimum for x in v) \
                    or list(v) != sorted(set(v)):
                raise SpearError(f"the profile grid's {name} must be increasing whole numbers >= {minimum}, "
                                 f"got {list(v)}")
        if self.tokens[0] != 0:
            raise SpearError(f"the profile grid's tokens must include 0 (the decode-only step), got {list(self.tokens)}")
        if len(self.tokens) > 1 and self.tokens[1] <= self.decodes[-1]:
            raise SpearError(f"the profile grid's step sizes must exceed its most decodes ({self.decodes[-1]}): a "
                             f"step of T tokens is d decodes and T - d >= 1 prefill tokens; got {list(self.tokens)}")

    @property
    def max_chunk(self) -> int:
        """The longest prefill chunk of the grid: its largest step beside its fewest decodes."""
        return max(0, self.tokens[-1] - self.decodes[0]) if len(self.tokens) > 1 else 0


# step sizes: mixed-step graph sizes (spear/serve/model/graphs.py); contexts: served contexts to 4k
DEFAULT_GRID = Grid((1, 8, 32, 63), (0, 64, 128, 256, 512, 1024, 2048), (256, 1024, 2048, 4096))
TINY_GRID = Grid((1, 2, 4), (0, 16, 64), (32, 96))   # seconds on a CPU
QUICK_REPEATS, QUICK_WARMUP = 3, 1


def _rounds_steps(grid: Grid, repeats: int, warmup: int) -> int:
    return (repeats + warmup) * len(grid.tokens)


def _prompt_len(L: int, grid: Grid, repeats: int, warmup: int) -> int:
    steps = _rounds_steps(grid, repeats, warmup)
    mean_step = (warmup * len(grid.tokens) + steps - 1) / 2  # of the timed steps, counted from the first decode
    return max(1, round(L - 1 - mean_step))


def _max_tokens(engine, d: int, p: int, steps: int) -> int:
    prefill_steps = -(-d * p // max(1, engine.config.max_num_batched_tokens - d))
    return steps + prefill_steps + 2  # decodes that finish their prompt early run on while the rest prefill


def problems(engine, grid: Grid, repeats: int, warmup: int) -> list[str]:
    """Why ``engine`` cannot produce every step of ``grid`` (empty: it can)."""
    cfg, out = engine.config, []
    d_max, t_max, c_max = max(grid.decodes), max(grid.tokens), grid.max_chunk
    if t_max and d_max + 1 > cfg.max_num_seqs:
        out.append(f"{d_max} decodes beside a prefill need max_num_seqs >= {d_max + 1} (it is {cfg.max_num_seqs})")
    if t_max > cfg.max_num_batched_tokens:
        out.append(f"steps of {t_max} tokens need max_num_batched_tokens >= {t_max} "
                   f"(it is {cfg.max_num_batched_tokens})")
    steps = _rounds_steps(grid, repeats, warmup)
    bs, blocks = engine.block_manager.block_size, engine.block_manager.num_free_blocks
    for L in grid.contexts:
        p = _prompt_len(L, grid, repeats, warmup)
        end = p + _max_tokens(engine, d_max, p, steps)
        if end > engine.max_model_len:
            out.append(f"context {L} needs max_model_len >= {end} (it is {engine.max_model_len})")
        need = d_max * -(-end // bs) + -(-c_max // bs)
        if need > blocks:
            out.append(f"context {L} with {d_max} decodes needs {need} KV blocks of {bs} tokens ({blocks} free): "
                       "give the cache more memory (--kv-memory) or profile shorter contexts")
    return out


def quick_grid(engine) -> Grid:
    """The start-up grid: DEFAULT_GRID cut to the engine's limits (max_num_seqs - 1 decodes beside a
    prefill; step sizes above them up to max_num_batched_tokens, which is a graph size; the contexts
    the KV cache and max_model_len hold)."""
    cfg = engine.config
    d_max = cfg.max_num_seqs - 1
    if d_max < 1:
        raise SpearError("a latency table needs max_num_seqs >= 2 (decodes beside a prefill)")
    decodes = tuple(sorted({d for d in DEFAULT_GRID.decodes if d < d_max} | {d_max}))
    tokens = step_sizes(engine, d_max, cfg.max_num_batched_tokens)
    fit = [L for L in DEFAULT_GRID.contexts
           if not problems(engine, Grid(decodes, tokens, (L,)), QUICK_REPEATS, QUICK_WARMUP)]
    if not fit:
        why = problems(engine, Grid(decodes, tokens, DEFAULT_GRID.contexts[:1]), QUICK_REPEATS, QUICK_WARMUP)
        raise SpearError(f"the engine cannot profile even a {DEFAULT_GRID.contexts[0]}-token context: "
                         f"{'; '.join(why)}; give it a table (`spear profile`, --latency-table)")
    return Grid(decodes, tokens, tuple(fit))


def step_sizes(engine, d_max: int, top: int) -> tuple[int, ...]:
    """The grid's step sizes for an engine: with mixed-step CUDA graphs every graph size above
    ``d_max`` up to ``top`` (the scheduler picks among them, so each is measured, not interpolated:
    step time is not linear between sizes, e.g. 384 tokens cost 9% more than halfway between 256 and
    512 on an H200); without, DEFAULT_GRID's sizes between them and ``top``. 0 first."""
    sizes = engine.scheduler.token_sizes or DEFAULT_GRID.tokens
    return (0,) + tuple(sorted({t for t in sizes if d_max < t < top} | {top}))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile(engine, grid: Grid = DEFAULT_GRID, repeats: int = 5, warmup: int = 1,
            progress: bool = False) -> LatencyTable:
    """Time ``engine``'s steps over ``grid`` (module docstring); the engine must be idle and
    schedule statically (no latency target) while it runs."""
    if repeats < 1 or warmup < 0:
        raise SpearError(f"profiling needs repeats >= 1 and warmup >= 0, got {repeats} and {warmup}")
    if engine.has_unfinished():
        raise SpearError("profile an idle engine: it has requests in flight")
    if engine.scheduler.itl_slo_ms is not None:
        raise SpearError("profile an engine without a latency target: the target would cut the chunks")
    bad = problems(engine, grid, repeats, warmup)
    if bad:
        raise SpearError("this engine cannot run the profile grid: " + "; ".join(bad))
    from tqdm.auto import tqdm

    engine.warmup()  # compile every step shape first (CUDA): no timed step may pay a compilation
    sched = engine.scheduler
    saved = (engine.num_steps, engine.last_step, engine.num_preemptions, sched.correction, sched.max_prefill_chunk,
             sched.max_prefill_chunk_alone)
    sched.correction = None  # the profile's steps teach no correction
    # each timed step's fresh prompt runs whole beside the decodes
    sched.max_prefill_chunk = sched.max_prefill_chunk_alone = None
    device, vocab = engine.runner.device, engine.model.config.vocab_size
    rng = random.Random(0)
    prompt = lambda n: [rng.randrange(vocab) for _ in range(n)]  # noqa: E731
    shape = (len(grid.decodes), len(grid.tokens), len(grid.contexts))
    times = [[[[] for _ in range(shape[2])] for _ in range(shape[1])] for _ in range(shape[0])]
    seen_ctx = [[[[] for _ in range(shape[2])] for _ in range(shape[1])] for _ in range(shape[0])]
    steps = _rounds_steps(grid, repeats, warmup)
    serial = iter(range(1 << 62))
    started = time.perf_counter()
    bar = tqdm(total=shape[0] * shape[2] * steps, desc="profile", unit="step", disable=not progress)
    def add(ids: list[int], params: SamplingParams) -> str:
        rid = f"profile-{next(serial)}"
        engine.add(CoreRequest(rid, ids, params, time.monotonic()))
        return rid

    def block(d: int, p: int, rounds: int, record) -> None:
        params = SamplingParams(max_tokens=_max_tokens(engine, d, p, steps), temperature=0, ignore_eos=True)
        rids = [add(prompt(p), params) for _ in range(d)]
        pending = set(rids)
        while pending:  # every decode past its prompt
            pending -= {o.request_id for o in engine.step() if o.new_token_ids}
        for r in range(rounds):
            for j, t in enumerate(grid.tokens):
                c = t - d if t else 0
                if c:
                    add(prompt(c), SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
                _sync(device)
                t0 = time.perf_counter()
                engine.step()
                _sync(device)
                ms = 1e3 * (time.perf_counter() - t0)
                rec = engine.last_step
                if rec.num_decodes != d or rec.prefill_tokens != c:
                    raise SpearError(f"profiling: a step meant as {d} decodes + {c} prefill tokens ran "
                                     f"{rec.num_decodes} decodes + {rec.prefill_tokens}")
                record(r, j, ms, rec.decode_context)
        engine.abort(rids)

    try:
        # one untimed block first: the first steps of each shape pay for allocation and lazy set-up
        block(grid.decodes[0], _prompt_len(grid.contexts[0], grid, repeats, warmup), 1, lambda *a: None)
        for k, L in enumerate(grid.contexts):
            p = _prompt_len(L, grid, repeats, warmup)
            for i, d in enumerate(grid.decodes):
                def record(r, j, ms, ctx, i=i, k=k):
                    if r >= warmup:
                        times[i][j][k].append(ms)
                        seen_ctx[i][j][k].append(ctx)
                    bar.update()

                block(d, p, warmup + repeats, record)
    finally:
        bar.close()
        engine.abort_all()
        (engine.num_steps, engine.last_step, engine.num_preemptions, sched.correction, sched.max_prefill_chunk,
         sched.max_prefill_chunk_alone) = saved
    med = [[[statistics.median(times[i][j][k]) for k in range(shape[2])] for j in range(shape[1])]
           for i in range(shape[0])]
    deviations = [t / med[i][j][k] - 1 for i in range(shape[0]) for j in range(shape[1]) for k in range(shape[2])
                  for t in times[i][j][k]]
    info = {"repeats": repeats, "warmup": warmup, "seconds": round(time.perf_counter() - started, 3),
            "max_num_seqs": engine.config.max_num_seqs, "max_num_batched_tokens": engine.config.max_num_batched_tokens,
            "observed_context": [[[round(statistics.fmean(seen_ctx[i][j][k]), 2) for k in range(shape[2])]
                                  for j in range(shape[1])] for i in range(shape[0])]}
    return LatencyTable.from_measurements(grid.decodes, grid.tokens, grid.contexts, med, engine.deployment,
                                          deviations, profile=info)


def table_for(engine, progress: bool = False) -> LatencyTable:
    """The cached table of ``engine``'s deployment, else one profiled now on ``quick_grid`` and cached."""
    table = load_cached(engine.deployment)
    if table is not None:
        log.info("latency table: %s", cache_path(engine.deployment))
        return table
    grid = quick_grid(engine)
    log.warning("no latency table is cached for this deployment; profiling %d x %d x %d steps now", len(grid.decodes),
                len(grid.tokens), len(grid.contexts))
    table = profile(engine, grid, QUICK_REPEATS, QUICK_WARMUP, progress=progress)
    path = table.save(cache_path(engine.deployment))
    log.warning("latency table written to %s", path)
    return table


# ---------------------------------------------------------------------------- compensator costs
def linear_shapes(config) -> list[tuple[int, int]]:
    """The distinct (in_features, out_features) of a Llama-family decoder's linears."""
    from spear.serve.model.llama import head_dim

    h, inter, hd = config.hidden_size, config.intermediate_size, head_dim(config)
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    return sorted({(h, q), (h, kv), (q, h), (h, inter), (inter, h)})


def _probe_layer(k: int, n: int, rank: int, group_size: int, device, dtype, gen: torch.Generator):
    """A W4 linear of random codes (with a rank-``rank`` EC) in the engine's layer class."""
    from spear.compensate.spec import ECFactors
    from spear.kernels.layout import MAX_RANK
    from spear.quant.primitives import n_groups
    from spear.serve.model.layers.linear import Linear, MemberWeights, QuantTensors

    g = group_size if group_size and k % group_size == 0 else 0
    ng = n_groups(k, g)
    q = QuantTensors(torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen),
                     (torch.rand(n, ng, generator=gen) * 0.01 + 1e-3).half(),
                     torch.full((n, ng), 8, dtype=torch.uint8), 4, g, True)
    ec = None if rank == 0 else ECFactors(torch.randn(rank, k, generator=gen) / k ** 0.5,
                                          torch.randn(n, rank, generator=gen) * 1e-2)
    layer = Linear(k, [n], ["probe"])
    layer.load(0, MemberWeights("probe", quant=q, ec=ec))
    layer.finalize(device, dtype, MAX_RANK)
    return layer


@torch.inference_mode()
def _call_us(layer, x, ctx, calls: int, repeats: int) -> float:
    for _ in range(3):  # compilation, the allocator
        layer(x, ctx)
    per = []
    for _ in range(repeats):
        _sync(x.device)
        t0 = time.perf_counter()
        for _ in range(calls):
            layer(x, ctx)
        _sync(x.device)
        per.append(1e6 * (time.perf_counter() - t0) / calls)
    return statistics.median(per)


def measure_ec_costs(engine, ranks=(1, 4, 16, 32), group_size: int = 128, calls: int = 50, repeats: int = 5,
                     progress: bool = False):
    """An EC cost table for ``engine``'s layer shapes (spear.select.ec_costs): per shape and rank, the
    one-token time of the engine's W4 layer with an ungated rank-r EC minus the same layer without
    one (median of ``repeats`` runs of ``calls`` calls; below zero, timing noise, counts as 0), and
    the base, the engine's one-sequence decode step. The engine must hold a W4 model without ECs."""
    from datetime import datetime, timezone

    from tqdm.auto import tqdm

    from spear.select.ec_costs import ECCostTable

    dep = engine.deployment
    if dep.density.modules == 0:
        raise SpearError("EC costs are priced over a W4 model's decode step: give a checkpoint written by "
                         "`spear quantize` (this model has no quantized linear)")
    if dep.density.modules_with_ec:
        raise SpearError(f"EC costs are priced over the W4 step without compensators; this checkpoint has "
                         f"{dep.density.modules_with_ec}: quantize without --compensator")
    if not ranks or any(r < 1 for r in ranks) or list(ranks) != sorted(set(ranks)):
        raise SpearError(f"EC ranks must be increasing whole numbers >= 1, got {list(ranks)}")
    device, dtype, ctx = engine.runner.device, engine.runner.dtype, engine.runner.eager_ctx
    gen = torch.Generator().manual_seed(0)
    shapes = linear_shapes(engine.model.config)
    costs = {}
    with tqdm(total=len(shapes) * (len(ranks) + 1), desc="EC costs", unit="layer", disable=not progress) as bar:
        for k, n in shapes:
            x = torch.randn(1, k, generator=gen).to(device=device, dtype=dtype)
            base = _call_us(_probe_layer(k, n, 0, group_size, device, dtype, gen), x, ctx, calls, repeats)
            bar.update()
            us = []
            for r in ranks:
                t = _call_us(_probe_layer(k, n, r, group_size, device, dtype, gen), x, ctx, calls, repeats)
                us.append(max(0.0, t - base))
                bar.update()
            costs[(k, n)] = (tuple(ranks), tuple(us))
    context = min(256, engine.max_model_len // 2)
    step = profile(engine, Grid((1,), (0,), (context,)), repeats=max(repeats, 5), warmup=1)
    return ECCostTable(1e3 * step.step_ms[0][0][0], costs, dep.device, dep.dtype,
                       datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                       f"one-sequence decode step at a {context}-token context of {dep.checkpoint or 'the model'}")
