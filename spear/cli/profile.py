"""``spear profile``: time real engine steps over a grid and write the deployment's latency table."""

from __future__ import annotations


def _ints(minimum: int):
    import argparse

    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(v) for v in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers such as 1,8,32; got {text!r}") \
                from None
        if not values or any(v < minimum for v in values) or list(values) != sorted(set(values)):
            raise argparse.ArgumentTypeError(f"expected increasing whole numbers >= {minimum}, got {text!r}")
        return values

    parse.__name__ = "list"
    return parse


def register(sub) -> None:
    from spear.cli.common import nonneg_int, positive_int
    from spear.cli.serve import add_engine_args
    from spear.serve.latency.profiler import DEFAULT_GRID, TINY_GRID

    fmt = lambda v: ",".join(map(str, v))  # noqa: E731
    p = sub.add_parser("profile", help="time the engine's steps: the latency table of --itl-slo-ms",
                       description="Build the engine as `spear serve` would and time real steps over a grid: "
                                   "running decodes x the step's tokens (decodes + prefill) x the decodes' context. Writes the "
                                   "versioned JSON table the latency-target scheduler interpolates (`spear serve "
                                   "--itl-slo-ms`), valid for this checkpoint, device, dtype and kernel policy. "
                                   "--max-num-seqs and --max-num-batched-tokens are raised to fit the grid. "
                                   "See docs/serving.md.")
    add_engine_args(p, slo=False)
    g = p.add_argument_group("profile")
    g.add_argument("--out", help="the table to write (default: the cache file `spear serve --itl-slo-ms` looks "
                                 "up for this deployment)")
    g.add_argument("--tiny", action="store_true",
                   help=f"a small grid that runs in seconds on a CPU: decodes {fmt(TINY_GRID.decodes)}, tokens "
                        f"{fmt(TINY_GRID.tokens)}, contexts {fmt(TINY_GRID.contexts)}, 3 repeats")
    g.add_argument("--decodes", type=_ints(1), help=f"running decodes (default: {fmt(DEFAULT_GRID.decodes)})")
    g.add_argument("--tokens", type=_ints(0),
                   help=f"step sizes in tokens, decodes included: 0 (the decode-only step), then sizes above the "
                        f"most --decodes (default: on CUDA graphs every mixed-step graph size above them up to "
                        f"{DEFAULT_GRID.tokens[-1]} or --max-num-batched-tokens, else {fmt(DEFAULT_GRID.tokens)})")
    g.add_argument("--contexts", type=_ints(1),
                   help=f"the decodes' context in tokens (default: {fmt(DEFAULT_GRID.contexts)})")
    g.add_argument("--repeats", type=positive_int, help="timed steps per point, their median kept (default: 5; "
                                                        "3 with --tiny)")
    g.add_argument("--warmup", type=nonneg_int, default=1, help="untimed rounds before them (default: %(default)s)")
    e = p.add_argument_group("compensator costs (instead of the step table)")
    e.add_argument("--ec-costs", metavar="JSON",
                   help="write the per-module EC cost table of `spear select --latency-budget` instead: the time an "
                        "EC of each rank adds to each of the model's linear shapes at one token, and the decode "
                        "step they add to; --model must be a W4 checkpoint without compensators")
    e.add_argument("--ec-ranks", type=_ints(1), default=(1, 4, 16, 32), help="ranks to time (default: 1,4,16,32)")
    p.set_defaults(func=main)


def main(args) -> int:
    from spear.cli.serve import engine_from_args
    from spear.serve.latency.table import cache_path
    from spear.serve.latency.profiler import DEFAULT_GRID, TINY_GRID, Grid, measure_ec_costs, profile

    progress = not args.quiet
    if args.ec_costs is not None:
        engine = engine_from_args(args).core
        table = measure_ec_costs(engine, args.ec_ranks, repeats=args.repeats or 5, progress=progress)
        table.save(args.ec_costs)
        print(f"{table.device}: EC costs of {len(table.costs)} linear shapes at ranks "
              f"{','.join(map(str, args.ec_ranks))} over a {table.base_step_us:.0f} us decode step; wrote "
              f"{args.ec_costs} (use: spear select --latency-budget 3% --ec-costs {args.ec_costs})")
        return 0
    base = TINY_GRID if args.tiny else DEFAULT_GRID
    grid = Grid(args.decodes or base.decodes, args.tokens or base.tokens, args.contexts or base.contexts)
    repeats = args.repeats or (3 if args.tiny else 5)
    d_max, t_max = max(grid.decodes), max(grid.tokens)
    engine = engine_from_args(args, max_num_seqs=max(args.max_num_seqs, d_max + (t_max > 0)),
                              max_num_batched_tokens=max(args.max_num_batched_tokens, t_max)).core
    if not args.tokens and not args.tiny:
        from spear.serve.latency.profiler import step_sizes

        grid = Grid(grid.decodes, step_sizes(engine, d_max, engine.config.max_num_batched_tokens), grid.contexts)
    table = profile(engine, grid, repeats, args.warmup, progress=progress)
    out = table.save(args.out or cache_path(engine.deployment))
    dep = table.deployment
    print(f"{dep.device}, {dep.dtype}: {len(grid.decodes)} x {len(grid.tokens)} x {len(grid.contexts)} points in "
          f"{table.profile['seconds']:.1f} s; margin {100 * table.margin:.1f}% ({table.margin_source})")
    for i, d in enumerate(grid.decodes):
        row = ", ".join(f"{t}: {table.step_ms[i][j][0]:.2f}" for j, t in enumerate(grid.tokens))
        print(f"  {d} decodes at context {grid.contexts[0]}, ms by step tokens (0: decode only): {row}")
    print(f"wrote {out}" + ("" if args.out else " (the cache: `spear serve --itl-slo-ms MS` finds it)"))
    return 0
