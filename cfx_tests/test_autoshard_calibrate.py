"""The cost model's calibration (``cfx/_src/autoshard/calibrate.py``): the alpha-beta fit recovers
exact synthetic lines and respects its constraints; on a 2x2 ``local`` mesh the measured model is
positive and finite, predicts payloads outside the sizes it was fitted on (both ends: a fit that
ignores bytes misses the large one, one that ignores latency the small one), and prices a 4-rank
axis's all-gather above a 2-rank one's."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

import cfx
from cfx._src.autoshard.calibrate import KiB, MiB, Point, Timings, calibrate, fit, from_timings, measure
from cfx._src.autoshard.cost import CostModel

# -- the fit ---------------------------------------------------------------------------------


@pytest.mark.timeout(10)
@pytest.mark.parametrize("alpha,beta", [(5e-4, 1 / 3e8), (2e-5, 1 / 1e10), (1e-3, 1 / 5e7), (3e-6, 1 / 2e9)])
def test_fit_recovers_an_exact_alpha_beta_line(alpha, beta):
    x = np.array([16 * KiB, 64 * KiB, 256 * KiB, MiB, 4 * MiB], dtype=float) * 1.5  # ring bytes of a psum
    a, b = fit(x, alpha + beta * x)
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(beta, rel=1e-6)


@pytest.mark.timeout(10)
def test_fit_minimises_relative_error():
    # noisy points: the fit is numpy's weighted least-squares line with weights 1/seconds, which
    # minimises sum(((y - line) / y)^2); a plain fit would let the 4 MiB points decide the latency
    rng = np.random.default_rng(0)
    x = np.repeat([16 * KiB, 64 * KiB, 256 * KiB, MiB, 4 * MiB], 4).astype(float)
    y = (3e-4 + x / 5e8) * rng.uniform(0.5, 2.0, x.size)
    a, b = fit(x, y)
    slope, intercept = np.polyfit(x, y, 1, w=1 / y)
    assert a == pytest.approx(intercept, rel=1e-6) and b == pytest.approx(slope, rel=1e-6)
    _, plain_intercept = np.polyfit(x, y, 1)
    assert abs(plain_intercept - intercept) > 0.1 * intercept  # the weighting matters on such data


@pytest.mark.timeout(10)
def test_fit_clamps_to_non_negative_coefficients():
    x = np.array([1.0, 2.0, 3.0, 4.0]) * MiB
    y = x / 1e9 - 1e-4
    a, b = fit(x, y)                   # a line through negative latency: latency clamped to 0,
    assert a == 0.0                    # beta the relative least-squares slope through the origin
    assert b == pytest.approx(float(np.sum(x / y) / np.sum((x / y) ** 2)), rel=1e-9)
    a, b = fit(x, 2e-3 - x / 1e12)     # time falling with bytes: no bandwidth, latency only
    assert b == 0.0 and a > 0
    with pytest.raises(ValueError, match="at least two points"):
        fit([1.0], [1.0])


@pytest.mark.timeout(10)
def test_a_model_with_no_bandwidth_is_refused_naming_the_fix():
    pts = {"data": tuple(Point("all_gather", s, float(s), 1e-3 - s * 1e-12) for s in (16 * KiB, MiB))}
    with pytest.raises(ValueError, match="Pass larger sizes="):
        from_timings(Timings(pts, 512, 1e-3))


@pytest.mark.timeout(10)
def test_bad_arguments_name_the_fix():
    with cfx.Mesh({"data": 2}) as mesh:
        with pytest.raises(ValueError, match="multiples of 512 bytes"):
            calibrate(mesh, sizes=(16 * KiB, 1000))
        with pytest.raises(ValueError, match="unknown moves"):
            calibrate(mesh, ops=("broadcast",))
        with pytest.raises(ValueError, match="at least two"):
            calibrate(mesh, sizes=(16 * KiB,))


# -- measured on a mesh ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_2x2() -> CostModel:
    with cfx.Mesh({"data": 2, "model": 2}) as mesh:
        return cfx.autoshard.calibrate(mesh)  # the public name


@pytest.mark.timeout(30)
def test_the_2x2_model_is_positive_and_finite(model_2x2):
    m = model_2x2
    assert 0 < m.flops_per_s < math.inf
    assert set(m.latency) == set(m.bandwidth) == {"data", "model", "*"}
    for axis in ("data", "model", "*"):
        assert 0 <= m.latency[axis] < 1.0 and 0 < m.bandwidth[axis] < math.inf
        assert 0 < m.step(axis, MiB) < math.inf


@pytest.mark.timeout(60)
def test_predictions_hold_beyond_the_sizes_fitted():
    # the points at 8 KiB and 8 MiB are timed in the same run (same load on the shared cores) but left
    # out of the fit; per axis, the geometric mean over the four moves of predicted / measured is
    # within 3x at 8 MiB and 15x at 8 KiB (a small step's time is mostly thread scheduling on the
    # shared cores: measured 0.3-1.3x, under load). On this machine a bytes-blind fit is ~10x off
    # at 8 MiB, a latency-blind one ~100x at 8 KiB.
    fitted = (16 * KiB, 64 * KiB, 256 * KiB, MiB, 4 * MiB)
    with cfx.Mesh({"data": 2, "model": 2}) as mesh:
        t = measure(mesh, sizes=(8 * KiB, *fitted, 8 * MiB))
    ring = {"all_gather": 1.0, "psum": 1.0, "psum_scatter": 0.5, "all_to_all": 0.5}  # x block at n = 2
    assert all(p.nbytes == ring[p.op] * p.block for pts in t.steps.values() for p in pts)  # reshard's charge
    inner = dataclasses.replace(t, steps={a: tuple(p for p in pts if p.block in fitted) for a, pts in t.steps.items()})
    model = from_timings(inner)
    for axis, pts in t.steps.items():
        for held in (8 * KiB, 8 * MiB):
            ratios = [model.step(axis, p.nbytes) / p.seconds for p in pts if p.block == held]
            gm = math.exp(np.mean(np.log(ratios)))
            bound = 3 if held == 8 * MiB else 15
            assert 1 / bound < gm < bound, (axis, held, ratios)


@pytest.mark.timeout(30)
def test_a_4_rank_axis_prices_an_all_gather_above_a_2_rank_one(model_2x2):
    # the same 1 MiB block: three blocks in, around a ring of four threads on the same cores, against one
    with cfx.Mesh({"ring": 4}) as mesh:
        m4 = calibrate(mesh, ops=("all_gather", "psum"), repeats=5)
    assert m4.step("ring", 3 * MiB) > max(model_2x2.step(a, MiB) for a in ("data", "model"))
