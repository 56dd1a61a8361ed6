"""The latency model of one deployment: measured engine step times, interpolated.

A :class:`LatencyTable` holds the wall time of ``LLMEngine.step()`` measured over a grid of step
compositions: ``decodes`` running decodes (d >= 1) x ``tokens``, the step's tokens (T: the d
decodes plus T - d prefill tokens; T = 0 is the decode-only step) x ``contexts`` (L, the decodes'
mean context in tokens). The second axis counts the whole step, not its prefill part, because a
mixed step replays the CUDA graph of its padded token count (spear/serve/model/graphs.py): its cost is a
staircase over T, flat between graph sizes, and a grid of graph sizes measures the steps that run
(with a prefill axis, d decodes beside a c-token chunk pad to a size that depends on d, so
neighbouring grid points straddled different steps of the staircase). It is valid only for what it
was measured on, its :class:`Deployment` (spear/serve/latency/deployment.py: the checkpoint, device,
dtype, kernel policy and engine settings that change a step's kernels). ``Deployment.key()`` names
its cache file,
``<spear cache>/latency/<key>.json`` (``~/.cache/spear/latency`` by default).

``predict(d, T, L)`` is piecewise-linear in each axis (trilinear inside a grid cell); T = 0 is
the decode-only row, a step of its own kind (the decode graphs), never interpolated with the mixed
steps: T > 0 interpolates among the positive points only. Beyond an axis's last point it
extrapolates along the last segment, since a step keeps growing about linearly with its tokens and
context (the weights are read once, the compute and the attention reads scale with them); below an
axis's first point (for T, its first positive one) it holds that point's value, which
overestimates (fewer decodes, tokens or a shorter context cost no more than measured): the safe
side, and for small mixed steps close to the truth (they read every weight whatever their size).

The table carries a relative safety ``margin``: the scheduler keeps ``predict · (1 + margin)``
under its target. :meth:`LatencyTable.from_measurements` learns it as the larger of two
``q``-quantiles (q = 0.9): of the leave-one-out residuals ``(measured - predicted) / predicted``
(every grid point with neighbours on both sides of an axis predicted from them, and an axis's
last point from the two before it, as the extrapolation would; along the tokens axis among the
mixed steps only), and of the timed repeats'
deviations from their point's median. Negative quantiles count as 0.
"""

from __future__ import annotations

import bisect
import json
import logging
import math
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

from spear.errors import SpearError
from spear.fileio import read_json
from spear.serve.latency.deployment import Deployment

log = logging.getLogger(__name__)

FORMAT = "spear-latency-table"
# 2: mixed steps replay CUDA graphs of padded token counts (version 1 tables timed them eagerly,
# up to twice as slow on an H200, so their predictions no longer hold)
# 3: the second axis is the step's tokens (decodes included), no longer its prefill tokens
VERSION = 3
MARGIN_QUANTILE = 0.9
DEFAULT_MARGIN = 0.10  # a table with nothing to learn from (no interior points, no repeats)
CORRECTION_WEIGHT = 0.1          # the newest step's weight in a step kind's running residual
CORRECTION_BOUNDS = (-0.5, 1.0)  # the running residual stays within these (a factor of 0.5 to 2)


def _bracket(axis: tuple[int, ...], x: float) -> tuple[int, int, float]:
    """(i, j, t) with value = v[i] (1 - t) + v[j] t: held below the first point, extrapolated
    along the last segment beyond the last (t > 1)."""
    if len(axis) == 1 or x <= axis[0]:
        return 0, 0, 0.0
    i = min(bisect.bisect_right(axis, x) - 1, len(axis) - 2)
    return i, i + 1, (x - axis[i]) / (axis[i + 1] - axis[i])


def quantile(values: list[float], q: float) -> float:
    """The ``q``-quantile with linear interpolation between order statistics (numpy's default)."""
    s = sorted(values)
    h = (len(s) - 1) * q
    lo = math.floor(h)
    return s[lo] if lo + 1 >= len(s) else s[lo] + (h - lo) * (s[lo + 1] - s[lo])


def loo_residuals(axes: tuple[tuple[int, ...], ...], values, first=(0, 0, 0)) -> list[float]:
    """Relative residuals (measured - predicted) / predicted of each grid point predicted from
    its neighbours along each axis (module docstring); ``values[i][j][k]`` on ``axes``. Along
    axis a only the points from index ``first[a]`` on take part (the tokens axis: 1, its mixed steps)."""
    out = []
    shape = tuple(len(a) for a in axes)
    for idx in _indices(shape):
        for ax, axis in enumerate(axes):
            i, n, f = idx[ax], len(axis), first[ax]
            if f < i < n - 1:
                lo, hi = i - 1, i + 1
            elif i == n - 1 and n - f >= 3:
                lo, hi = i - 2, i - 1
            else:
                continue
            t = (axis[i] - axis[lo]) / (axis[hi] - axis[lo])
            pred = _at(values, idx, ax, lo) * (1 - t) + _at(values, idx, ax, hi) * t
            if pred > 0:
                out.append((_at(values, idx, ax, i) - pred) / pred)
    return out


def _at(values, idx, axis: int, j: int) -> float:
    """values at ``idx`` with its ``axis`` coordinate replaced by ``j``."""
    i = list(idx)
    i[axis] = j
    return values[i[0]][i[1]][i[2]]


def _indices(shape):
    for i in range(shape[0]):
        for j in range(shape[1]):
            for k in range(shape[2]):
                yield i, j, k


def _axis(name: str, values, minimum: int, where: str) -> tuple[int, ...]:
    if not isinstance(values, (list, tuple)) or not values:
        raise SpearError(f"{where}: grid.{name} must be a non-empty list of whole numbers, got {values!r}")
    if any(isinstance(v, bool) or not isinstance(v, int) or v < minimum for v in values):
        raise SpearError(f"{where}: grid.{name} must hold whole numbers >= {minimum}, got {list(values)}")
    if any(b <= a for a, b in zip(values, values[1:])):
        raise SpearError(f"{where}: grid.{name} must be strictly increasing, got {list(values)}")
    return tuple(values)


@dataclass(frozen=True)
class LatencyTable:
    """Step times in ms, ``step_ms[i][j][k]`` at (decodes[i], tokens[j], contexts[k])."""

    decodes: tuple[int, ...]
    tokens: tuple[int, ...]
    contexts: tuple[int, ...]
    step_ms: tuple
    margin: float
    deployment: Deployment | None = None  # None: a synthetic table, which no engine accepts
    margin_quantile: float = MARGIN_QUANTILE
    margin_source: str = "given"
    created: str = ""
    profile: dict = field(default_factory=dict, compare=False)  # how it was measured

    def __post_init__(self, where: str = "latency table"):
        axes = (_axis("decodes", list(self.decodes), 1, where), _axis("tokens", list(self.tokens), 0, where),
                _axis("contexts", list(self.contexts), 1, where))
        if axes[1][0] != 0:
            raise SpearError(f"{where}: grid.tokens must start at 0 (the decode-only step), got {list(axes[1])}")
        if len(axes[1]) > 1 and axes[1][1] <= axes[0][-1]:
            raise SpearError(f"{where}: grid.tokens' mixed steps must exceed the most decodes ({axes[0][-1]}): a "
                             f"step of T tokens holds d decodes and T - d >= 1 prefill tokens; got {list(axes[1])}")
        rows = self.step_ms
        try:
            ok = len(rows) == len(axes[0]) and all(len(r) == len(axes[1]) and all(
                len(c) == len(axes[2]) for c in r) for r in rows)
        except TypeError:
            ok = False
        if not ok:
            raise SpearError(f"{where}: step_ms must be nested lists of shape decodes x tokens x contexts = "
                             f"{len(axes[0])} x {len(axes[1])} x {len(axes[2])}")
        vals = tuple(tuple(tuple(c) for c in r) for r in rows)
        for i, j, k in _indices((len(axes[0]), len(axes[1]), len(axes[2]))):
            v = vals[i][j][k]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
                raise SpearError(f"{where}: step_ms at decodes={axes[0][i]}, tokens={axes[1][j]}, "
                                 f"context={axes[2][k]} must be a finite number of ms > 0, got {v!r}")
        m = self.margin
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not (math.isfinite(m) and m >= 0):
            raise SpearError(f"{where}: margin must be a finite number >= 0, got {m!r}")
        if not 0 < self.margin_quantile < 1:
            raise SpearError(f"{where}: margin quantile must be in (0, 1), got {self.margin_quantile!r}")
        if self.deployment is not None and not isinstance(self.deployment, Deployment):
            raise SpearError(f"{where}: deployment must be a Deployment, got {type(self.deployment).__name__}")
        for name, v in zip(("decodes", "tokens", "contexts"), axes):
            object.__setattr__(self, name, v)
        object.__setattr__(self, "step_ms", vals)
        object.__setattr__(self, "margin", float(m))

    # ------------------------------------------------------------------ prediction
    def predict(self, decodes: float, tokens: float, context: float) -> float:
        """Predicted time in ms of a step of ``decodes`` decodes and ``tokens`` tokens in all (0: a
        decode-only step) at mean decode context ``context`` (module docstring), without the margin."""
        di, dj, dt = _bracket(self.decodes, decodes)
        if tokens <= 0 or len(self.tokens) == 1:
            ci = cj = 0
            ct = 0.0
        else:  # the mixed steps' points only, held below the first
            ci, cj, ct = _bracket(self.tokens[1:], tokens)
            ci, cj = ci + 1, cj + 1
        li, lj, lt = _bracket(self.contexts, context)
        v = self.step_ms

        def along_l(a, b):
            return v[a][b][li] * (1 - lt) + v[a][b][lj] * lt

        def along_c(a):
            return along_l(a, ci) * (1 - ct) + along_l(a, cj) * ct

        return along_c(di) * (1 - dt) + along_c(dj) * dt

    def fits(self, decodes: float, tokens: float, context: float, target_ms: float) -> bool:
        return self.predict(decodes, tokens, context) * (1 + self.margin) <= target_ms

    def max_chunk(self, decodes: int, context: float, target_ms: float, limit: int) -> int:
        """The largest prefill chunk c in [0, limit] whose step (d decodes and c prefill tokens:
        ``d + c`` tokens, or the decode-only step for c = 0) has predict · (1 + margin) <=
        target_ms; -1 when not even the decodes alone fit. The prediction is linear in c between
        grid points, so each piece is solved directly, from the top piece down."""
        d = decodes
        fits = lambda c: self.fits(d, d + c if c else 0, context, target_ms)  # noqa: E731
        if limit < 0:
            return -1
        if limit >= 1:
            if fits(limit):
                return limit
            # top piece down: each piece's upper knot is known not to fit, so one that fits at its
            # lower knot holds the answer
            knots = [1] + [t - d for t in self.tokens[1:] if 1 < t - d < limit] + [limit]
            for a, b in zip(reversed(knots[:-1]), reversed(knots[1:])):
                if fits(a):
                    fa = self.predict(d, d + a, context) * (1 + self.margin)
                    fb = self.predict(d, d + b, context) * (1 + self.margin)
                    c = a + math.floor((target_ms - fa) / (fb - fa) * (b - a)) if fb > fa else a
                    return self._settle(min(max(c, a), b), limit, fits)
        return 0 if fits(0) else -1

    @staticmethod
    def _settle(c: int, limit: int, fits) -> int:
        """Move ``c`` to the exact boundary the piece's float arithmetic may miss by one."""
        while c < limit and fits(c + 1):
            c += 1
        while c > 0 and not fits(c):
            c -= 1
        return c

    # ------------------------------------------------------------------ building, files
    @classmethod
    def from_measurements(cls, decodes, tokens, contexts, step_ms, deployment: Deployment | None,
                          repeat_deviations=(), q: float = MARGIN_QUANTILE, profile: dict | None = None,
                          created: str | None = None) -> "LatencyTable":
        """A table whose margin is learned from the grid and the repeats (module docstring)."""
        table = cls(decodes, tokens, contexts, step_ms, 0.0, deployment, q)  # validates the grid
        loo = loo_residuals((table.decodes, table.tokens, table.contexts), table.step_ms, first=(0, 1, 0))
        parts, sources = [], []
        if loo:
            parts.append(max(0.0, quantile(loo, q)))
            sources.append(f"{len(loo)} leave-one-out residuals")
        if repeat_deviations:
            parts.append(max(0.0, quantile(list(repeat_deviations), q)))
            sources.append(f"{len(repeat_deviations)} repeat deviations")
        margin = max(parts) if parts else DEFAULT_MARGIN
        source = f"max of the {q:g}-quantiles of " + " and ".join(sources) if parts else "default (nothing to learn)"
        return replace(table, margin=margin, margin_source=source, profile=dict(profile or {}),
                       created=created or datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))

    def to_dict(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "created": self.created,
                "deployment": None if self.deployment is None else self.deployment.to_dict(),
                "grid": {"decodes": list(self.decodes), "tokens": list(self.tokens), "contexts": list(self.contexts)},
                "step_ms": [[list(c) for c in r] for r in self.step_ms],
                "margin": {"value": self.margin, "quantile": self.margin_quantile, "source": self.margin_source},
                "profile": self.profile}

    @classmethod
    def from_dict(cls, data, where: str = "latency table") -> "LatencyTable":
        if not isinstance(data, dict):
            raise SpearError(f"{where}: a latency table is a JSON object, got {type(data).__name__}")
        if data.get("format") != FORMAT:
            raise SpearError(f"{where}: format must be {FORMAT!r}, got {data.get('format')!r}")
        if data.get("version") != VERSION:
            raise SpearError(f"{where}: version {data.get('version')!r} is not supported (this spear reads "
                             f"version {VERSION}); profile again with `spear profile`")
        known = {"format", "version", "created", "deployment", "grid", "step_ms", "margin", "profile"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SpearError(f"{where}: unknown keys {unknown}")
        for key in ("grid", "step_ms", "margin"):
            if key not in data:
                raise SpearError(f"{where}: lacks {key!r}")
        grid, margin = data["grid"], data["margin"]
        if not isinstance(grid, dict) or set(grid) != {"decodes", "tokens", "contexts"}:
            raise SpearError(f"{where}: grid must be an object with decodes, tokens and contexts")
        if not isinstance(margin, dict) or "value" not in margin:
            raise SpearError(f"{where}: margin must be an object with a value")
        q = margin.get("quantile", MARGIN_QUANTILE)
        if isinstance(q, bool) or not isinstance(q, (int, float)):
            raise SpearError(f"{where}: margin quantile must be a number, got {q!r}")
        dep = data.get("deployment")
        profile = data.get("profile") or {}
        if not isinstance(profile, dict):
            raise SpearError(f"{where}: profile must be an object")
        table = cls.__new__(cls)
        for k, v in dict(decodes=grid["decodes"], tokens=grid["tokens"], contexts=grid["contexts"],
                         step_ms=data["step_ms"], margin=margin["value"],
                         deployment=None if dep is None else Deployment.from_dict(dep, where),
                         margin_quantile=float(q), margin_source=str(margin.get("source", "given")),
                         created=str(data.get("created", "")), profile=profile).items():
            object.__setattr__(table, k, v)
        table.__post_init__(where)
        return table

    def save(self, path: str | Path) -> Path:
        from spear.fileio import write_text_atomic

        return write_text_atomic(path, json.dumps(self.to_dict(), indent=1))

    def check_for(self, deployment: Deployment, where: str = "the latency table") -> None:
        """SpearError unless this table was measured on ``deployment``."""
        if self.deployment is None:
            raise SpearError(f"{where} records no deployment (a synthetic table); profile this one with "
                             "`spear profile`")
        bad = self.deployment.mismatches(deployment)
        if bad:
            raise SpearError(f"{where} was measured on another deployment: {'; '.join(bad)}; profile this one "
                             "with `spear profile`")


class Correction:
    """The relative error of a table's predictions while serving, per kind of step, learned online.

    A table is measured under the profile's conditions (every decode at the same context, a fresh
    prompt admitted and finished in each timed mixed step); served steps differ (decodes of mixed
    contexts, chunks of long prompts, the GPU's clocks under sustained load), and the difference is
    mostly a steady bias of each kind of step. After each step with a prediction the engine reports
    the measured time (its interval): the kind's running residual r, an exponentially weighted mean
    with ``CORRECTION_WEIGHT`` of each step's measured / table - 1 held within ``CORRECTION_BOUNDS``,
    multiplies the next predictions of that kind by (1 + r). A kind is the step's padded size on
    CUDA graphs (the decode-only steps are kind 0), or 0 / 1 (decode-only / mixed) without them.
    Pure Python."""

    def __init__(self, weight: float = CORRECTION_WEIGHT, bounds: tuple[float, float] = CORRECTION_BOUNDS):
        if not 0 < weight <= 1:
            raise ValueError(f"the correction's weight must be in (0, 1], got {weight!r}")
        self.weight, self.bounds = weight, bounds
        self.residual: dict[int, float] = {}

    def factor(self, kind: int) -> float:
        return 1.0 + self.residual.get(kind, 0.0)

    def observe(self, kind: int, table_ms: float, measured_ms: float) -> None:
        """A step of ``kind`` the table priced at ``table_ms`` (uncorrected) took ``measured_ms``."""
        if not (table_ms > 0 and math.isfinite(measured_ms) and measured_ms > 0):
            return
        # each step's residual is held within the bounds before it is weighed in, so one odd step (a
        # pause of the caller between steps, a collection) moves the running one by at most
        # weight x the bound, never straight to it
        r = min(max(measured_ms / table_ms - 1.0, self.bounds[0]), self.bounds[1])
        old = self.residual.get(kind, 0.0)  # from the table as measured
        self.residual[kind] = old + self.weight * (r - old)


def load_table(path: str | Path) -> LatencyTable:
    """Read and validate a table file; every problem is a SpearError naming the file."""
    path = Path(path)
    return LatencyTable.from_dict(read_json(path, "latency table"), str(path))


def given_table(table: "LatencyTable | str | Path | None", deployment: Deployment) -> LatencyTable | None:
    """An engine's configured table (an object or a path), checked against its deployment."""
    if table is None:
        return None
    if isinstance(table, LatencyTable):
        table.check_for(deployment)
        return table
    loaded = load_table(table)
    loaded.check_for(deployment, f"latency table {table}")
    return loaded


def cache_path(deployment: Deployment) -> Path:
    from spear.models.loading import cache_dir

    return cache_dir() / "latency" / f"{deployment.key()}.json"


def load_cached(deployment: Deployment) -> LatencyTable | None:
    """The cached table of ``deployment``, or None when there is none."""
    path = cache_path(deployment)
    if not path.is_file():
        return None
    try:
        data = read_json(path)
    except SpearError:
        data = None  # load_table names the problem
    version = data.get("version") if isinstance(data, dict) else None
    if isinstance(version, int) and version < VERSION:
        log.warning("cached latency table %s is version %d, measured on an older engine; profiling again",
                    path, version)
        return None
    table = load_table(path)
    table.check_for(deployment, f"cached latency table {path}")
    return table
