"""The latency table: interpolation against closed forms, scipy and brute force; the learned
margin by hand; validation of malformed tables; the deployment key and the cache."""

import json
import random

import pytest

from spear.errors import SpearError
from spear.serve.latency.deployment import Density, Deployment
from spear.serve.latency.table import (
    DEFAULT_MARGIN,
    VERSION,
    LatencyTable,
    cache_path,
    load_cached,
    load_table,
    loo_residuals,
    quantile,
)


def _multilinear(d, t, L):
    # linear in each axis separately, with cross terms: what trilinear interpolation reproduces exactly
    return 3.0 + 0.25 * d + 0.01 * t + 0.002 * L + 0.0005 * d * t + 0.0001 * d * L + 1e-6 * t * L


def _table(decodes, tokens, contexts, f, margin=0.0, deployment=None):
    return LatencyTable(decodes, tokens, contexts, [[[f(d, t, L) for L in contexts] for t in tokens]
                                                    for d in decodes], margin, deployment)


def _deployment(**changes):
    base = dict(checkpoint="/ckpt", checkpoint_hash="ab" * 32, device="NVIDIA H200", dtype="float16",
                policy_hash="cd" * 12, block_size=16, cuda_graphs=True, density=Density(3, 210, 0.98),
                policy_op_args=(1, 64, 128))
    base.update(changes)
    return Deployment(**base)


def test_predict_reproduces_a_multilinear_step_time_inside_and_beyond_the_grid():
    """Catches: the decode-only row interpolated with the mixed steps (a small mixed step priced
    between a decode graph and the first mixed size), a wrong extrapolation or hold."""
    rng = random.Random(0)
    decode_only = lambda d, t, L: 100.0 + d + L / 1000  # noqa: E731  a row of its own kind
    f = lambda d, t, L: _multilinear(d, t, L) if t else decode_only(d, t, L)  # noqa: E731
    t = _table((1, 8, 32, 63), (0, 64, 256, 1024, 2048), (256, 1024, 4096), f)
    for _ in range(300):
        d, n, L = rng.uniform(1, 100), rng.uniform(64, 4000), rng.uniform(256, 9000)
        assert t.predict(d, n, L) == pytest.approx(_multilinear(d, n, L), rel=1e-12)
        # the decode-only step is its row, never interpolated with the mixed steps
        assert t.predict(d, 0, L) == pytest.approx(decode_only(d, 0, L), rel=1e-12)
        # a mixed step below the first size costs that size (held: the safe side)
        assert t.predict(d, rng.uniform(1, 64), L) == pytest.approx(_multilinear(d, 64, L), rel=1e-12)
    # below the first point of an axis: held at the first point (the safe side)
    assert t.predict(0, 100, 100) == pytest.approx(_multilinear(1, 100, 256), rel=1e-12)


def test_predict_equals_scipy_inside_the_grid_on_irregular_data():
    from scipy.interpolate import RegularGridInterpolator

    rng = random.Random(1)
    axes = ((1, 4, 16, 63), (0, 64, 128, 512, 2048), (128, 1024, 8192))
    vals = [[[rng.uniform(2, 50) for _ in axes[2]] for _ in axes[1]] for _ in axes[0]]
    t = LatencyTable(*axes, vals, 0.0)
    mixed = RegularGridInterpolator((axes[0], axes[1][1:], axes[2]), [row[1:] for row in vals],
                                    method="linear")
    decode_only = RegularGridInterpolator((axes[0], axes[2]), [row[0] for row in vals], method="linear")
    for _ in range(300):
        d, n, L = rng.uniform(1, 63), rng.uniform(64, 2048), rng.uniform(128, 8192)
        assert t.predict(d, n, L) == pytest.approx(float(mixed([(d, n, L)])[0]), rel=1e-12)
        assert t.predict(d, 0, L) == pytest.approx(float(decode_only([(d, L)])[0]), rel=1e-12)
    for i, d in enumerate(axes[0]):  # grid points come back as measured
        for j, n in enumerate(axes[1]):
            for k, L in enumerate(axes[2]):
                assert t.predict(d, n, L) == vals[i][j][k]


@pytest.mark.parametrize("seed", range(4))
def test_max_chunk_is_the_largest_chunk_that_fits_by_brute_force(seed):
    rng = random.Random(seed)
    tokens = (0, 64, 256, 512, 1024)
    # noisy, not monotone in the step size: the search must still find the largest fitting chunk
    vals = [[[rng.uniform(4, 12) + n / rng.uniform(40, 200) for _ in (256, 2048)] for n in tokens] for _ in (1, 16)]
    t = LatencyTable((1, 16), tokens, (256, 2048), vals, rng.uniform(0, 0.3))
    for _ in range(40):
        d, L, limit = rng.randint(1, 30), rng.uniform(100, 4000), rng.randint(0, 1500)
        target = rng.uniform(3, 25)
        brute = max((c for c in range(limit + 1) if t.predict(d, d + c if c else 0, L) * (1 + t.margin) <= target),
                    default=-1)
        assert t.max_chunk(d, L, target, limit) == brute


def test_max_chunk_exact_values_on_a_linear_table():
    # a step of d decodes and c prefill tokens (T = d + c) takes 4 + d/4 + c/64 + L/1024 ms, margin 25%:
    # the largest c has predict <= target / 1.25
    f = lambda d, t, L: 4 + d / 4 + (t - d if t else 0) / 64 + L / 1024  # noqa: E731
    t = _table((1, 32), (0, 512, 2048), (256, 4096), f, margin=0.25)
    assert t.max_chunk(4, 512, 20.0, 4096) == 64 * (16 - 4 - 1 - 0.5)   # 672
    assert t.max_chunk(4, 512, 20.0, 500) == 500                        # capped by the limit
    assert t.max_chunk(40, 4096, 20.0, 4096) == -1                      # decodes alone: 4 + 10 + 4 > 16
    # 4 decodes at 8192: the decode-only step fits (4 + 1 + 8 = 13 <= 16), and a chunk is priced at least
    # as the first mixed size, T = 512: 13 + 508 / 64 > 16, so no chunk fits
    assert t.max_chunk(4, 8192, 20.0, 4096) == 0


def test_margin_learned_from_leave_one_out_and_repeats_by_hand():
    """Catches: leave-one-out residuals across the decode-only row (its jump to the mixed steps is
    not an interpolation error the scheduler makes), a wrong quantile."""
    # the mixed steps T = 256, 512, 768 at 12, 16, 18 ms; the decode-only step (10 ms) takes no part
    vals = [[[10.0], [12.0], [16.0], [18.0]]]
    axes = ((1,), (0, 256, 512, 768), (256,))
    r_mid = (16 - 15) / 15      # from its neighbours: (12 + 18) / 2
    r_last = (18 - 20) / 20     # extrapolated from T = 256 and 512: 16 + 4
    assert sorted(loo_residuals(axes, vals, first=(0, 1, 0))) == pytest.approx([r_last, r_mid])
    t = LatencyTable.from_measurements(*axes, vals, None)
    assert t.margin == pytest.approx(r_last + 0.9 * (r_mid - r_last))
    t = LatencyTable.from_measurements(*axes, vals, None, repeat_deviations=[0.01, 0.5, 0.02, 0.03])
    assert t.margin == pytest.approx(0.03 + 0.7 * 0.47)  # the repeats' 0.9-quantile is the larger
    flat = LatencyTable.from_measurements((1, 2), (0, 64), (256,), [[[5.0], [6.0]], [[5.5], [6.5]]], None)
    assert flat.margin == DEFAULT_MARGIN  # two points per axis: nothing to leave out
    # a straight line over the mixed steps is predicted exactly, however far the decode-only step lies
    line = LatencyTable.from_measurements((1,), (0, 256, 512, 768), (256,), [[[2.0], [12.0], [14.0], [16.0]]], None)
    assert line.margin == 0.0
    # five mixed sizes along a concave curve: residuals of both signs, the 0.9-quantile of them
    vals = [[[v] for v in (1.0, 10.0, 13.0, 15.0, 16.0, 16.5)]]
    res = [(13 - 12.5) / 12.5, (15 - 14.5) / 14.5, (16 - 15.75) / 15.75, (16.5 - 17) / 17]
    t = LatencyTable.from_measurements((1,), (0, 2, 3, 4, 5, 6), (256,), vals, None)
    s = sorted(res)
    assert t.margin == pytest.approx(s[2] + 0.7 * (s[3] - s[2]))


def test_quantile_matches_numpy():
    import numpy as np

    rng = random.Random(2)
    for n in (1, 2, 7, 50):
        xs = [rng.uniform(-1, 1) for _ in range(n)]
        for q in (0.0, 0.5, 0.9, 1.0):
            assert quantile(xs, q) == pytest.approx(float(np.quantile(xs, q)))


def test_round_trip_and_deployment_checks(tmp_path):
    dep = _deployment()
    t = LatencyTable.from_measurements((1, 8), (0, 64, 128), (256, 1024), [[[1.0, 2.0]] * 3] * 2, dep,
                                       profile={"repeats": 3})
    path = t.save(tmp_path / "t.json")
    back = load_table(path)
    assert back == t and back.profile == {"repeats": 3} and back.deployment.density == Density(3, 210, 0.98)
    back.check_for(dep)
    assert _deployment(checkpoint="/elsewhere", density=Density()).key() == dep.key()  # informative fields
    other = _deployment(device="NVIDIA A100", policy_hash="ef" * 12)
    assert other.key() != dep.key()
    with pytest.raises(SpearError, match="device 'NVIDIA H200' .this engine: 'NVIDIA A100'.*policy_hash"):
        back.check_for(other)
    with pytest.raises(SpearError, match="synthetic"):
        LatencyTable((1,), (0,), (1,), [[[1.0]]], 0.0).check_for(dep)


def test_cache_location_and_lookup(tmp_path, monkeypatch):
    monkeypatch.setenv("SPEAR_CACHE", str(tmp_path))
    dep = _deployment()
    assert cache_path(dep) == tmp_path / "latency" / f"{dep.key()}.json"
    assert load_cached(dep) is None
    t = _table((1,), (0, 16), (64,), _multilinear, 0.1, dep)
    t.save(cache_path(dep))
    assert load_cached(dep) == t
    # a file under this key that records another deployment is refused, never used
    _table((1,), (0, 16), (64,), _multilinear, 0.1, _deployment(dtype="bfloat16")).save(cache_path(dep))
    with pytest.raises(SpearError, match="dtype"):
        load_cached(dep)
    # a table of an older version (timed before mixed-step graphs) is profiled again, not used;
    # Catches: an old cached table failing every engine start, or being used as is
    old = t.to_dict()
    old["version"] = VERSION - 1
    cache_path(dep).write_text(json.dumps(old))
    assert load_cached(dep) is None


def _good() -> dict:
    return _table((1, 8), (0, 64), (256, 1024), _multilinear, 0.05, _deployment()).to_dict()


@pytest.mark.parametrize("change,message", [
    (lambda d: d.update(format="other"), "format must be 'spear-latency-table'"),
    (lambda d: d.update(version=VERSION + 1), f"version {VERSION + 1} is not supported"),
    (lambda d: d.update(extra=1), "unknown keys"),
    (lambda d: d.pop("step_ms"), "lacks 'step_ms'"),
    (lambda d: d["grid"].update(decodes=[8, 1]), "grid.decodes must be strictly increasing"),
    (lambda d: d["grid"].update(decodes=[0, 8]), "grid.decodes must hold whole numbers >= 1"),
    (lambda d: d["grid"].update(tokens=[16, 64]), "grid.tokens must start at 0"),
    (lambda d: d["grid"].update(tokens=[0, 8]), "mixed steps must exceed the most decodes"),
    (lambda d: d["grid"].update(contexts=[]), "grid.contexts must be a non-empty list"),
    (lambda d: d["grid"].update(contexts=[256.5, 1024]), "whole numbers"),
    (lambda d: d["step_ms"].pop(), "shape decodes x tokens x contexts = 2 x 2 x 2"),
    (lambda d: d["step_ms"][1][0].__setitem__(1, float("nan")), "decodes=8, tokens=0, context=1024"),
    (lambda d: d["step_ms"][0][1].__setitem__(0, -1.0), "finite number of ms > 0"),
    (lambda d: d["margin"].update(value=-0.1), "margin must be a finite number >= 0"),
    (lambda d: d["margin"].update(quantile=1.5), "quantile must be in"),
    (lambda d: d["deployment"].pop("device"), "lacks 'device'"),
    (lambda d: d["deployment"].update(block_size=0), "block_size"),
    (lambda d: d.update(grid=[1, 2]), "grid must be an object"),
])
def test_malformed_tables_are_refused_with_the_rule(tmp_path, change, message):
    data = _good()
    change(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(SpearError, match=message) as exc:
        load_table(path)
    assert str(path) in str(exc.value)


def test_unreadable_files(tmp_path):
    with pytest.raises(SpearError, match="cannot read latency table"):
        load_table(tmp_path / "missing.json")
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(SpearError, match="not valid JSON"):
        load_table(tmp_path / "x.json")


def test_correction_weighs_each_step_held_within_the_bounds():
    """Correction: residual_k = residual_(k-1) + 0.1 (r_k - residual_(k-1)), r_k = measured / table - 1
    held within (-0.5, 1), by hand. One step 100x slower than the table (a pause of the caller) moves
    the residual by 0.1, not to the bound; steady 3x and 0.1x steps approach the bounds; kinds are
    apart; a step without a valid time is ignored.
    Catches: the bound applied after the mean (one odd step would jump to x2), kinds mixed."""
    from spear.serve.latency.table import Correction

    c = Correction()
    c.observe(128, 10.0, 1000.0)
    assert c.residual == {128: pytest.approx(0.1)} and c.factor(128) == pytest.approx(1.1) and c.factor(0) == 1.0
    c.observe(128, 10.0, 11.0)  # r = 0.1: stays
    assert c.residual[128] == pytest.approx(0.1)
    for _ in range(60):
        c.observe(128, 10.0, 30.0)
        c.observe(0, 10.0, 1.0)
    assert c.residual[128] == pytest.approx(1 - 0.9 * 0.9 ** 60)
    assert c.residual[0] == pytest.approx(-0.5 * (1 - 0.9 ** 60))
    before = dict(c.residual)
    for table, measured in ((0.0, 5.0), (10.0, float("nan")), (10.0, 0.0), (-1.0, 5.0)):
        c.observe(0, table, measured)
    assert c.residual == before
    with pytest.raises(ValueError, match="weight"):
        Correction(weight=0)
