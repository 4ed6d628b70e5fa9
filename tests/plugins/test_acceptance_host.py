"""The online acceptance estimates read on the plugin's host library (`kernels.host_estimate_reader`, what the
runtime installs) against the fit read directly (`OnlineAcceptance.reference_estimate`) and the NumPy read of the
same segments, on random traffic with and without a calibration; bad arrays refused by name."""

import numpy as np
import pytest
import torch

from echo_trtllm import kernels
from echo_trtllm.core.acceptance import BIN_EDGES, OnlineAcceptance
from tests.helpers import random_online_acceptance


def _traffic(seed: int, calibrated: bool):
    depth = 1 + seed % 5
    online, gen = random_online_acceptance(seed, depth, calibrated, 1.0 + seed, 30.0, 1 + seed % 3)
    return online, gen, depth


def _close_or_at_a_step(got, online, p, depths, greedy):
    """got equals the reference to rounding, except where the reference is discontinuous (a bin edge or
    calibration step hit exactly; for the greedy rows below depth 1 their per-token probability c^(1/d) hit one:
    NumPy's vectorised power and the C library's may round it to either side): there it equals the reference just
    below or just above c."""
    want = online.reference_estimate(p, depths, greedy)
    off = (got - want).abs() > 1e-12
    if off.any():
        below = online.reference_estimate(p * (1 - 1e-9), depths, greedy)
        above = online.reference_estimate((p * (1 + 1e-9)).clamp(max=1.0), depths, greedy)
        sides = torch.minimum((got - below).abs(), (got - above).abs())
        assert bool((sides[off] < 1e-6).all()), (p[off], got[off], want[off])
        assert int(off.sum()) <= max(1, p.numel() // 100)  # a few points placed on the steps, not a drift


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("calibrated", [False, True])
def test_the_host_library_reads_the_estimates_the_fit_gives(host_backend, seed, calibrated):
    reader = kernels.host_estimate_reader()
    assert reader is not None
    online, gen, depth = _traffic(seed, calibrated)
    numpy_read, _, _ = _traffic(seed, calibrated)
    for step in range(10):
        n = int(torch.randint(0, 50, (1,), generator=gen))
        c = torch.rand(n, generator=gen, dtype=torch.float64) ** (1 + step % 5)
        args = (torch.randint(1, depth + 3, (n,), generator=gen), c,
                torch.rand(n, generator=gen, dtype=torch.float64) < c.sqrt(), torch.rand(n, generator=gen) < 0.6)
        online.observe(*args)
        numpy_read.observe(*args)
        points = [torch.rand(64, generator=gen, dtype=torch.float64), 10 ** (-7 * torch.rand(32, generator=gen)),
                  torch.tensor(BIN_EDGES, dtype=torch.float64), torch.tensor([0.0, 1.0, 1e-300])]
        if calibrated:
            points += [starts.double() for starts, _ in online.prior.fits.values()]
        p = torch.cat(points).clamp(0, 1)
        p = torch.cat([p, (p - 1e-12).clamp(0, 1), (p + 1e-12).clamp(0, 1)])
        depths = torch.randint(1, depth + 2, p.shape, generator=gen)
        greedy = torch.rand(p.shape, generator=gen) < 0.5
        online.reader = reader
        got = online.estimate(p, depths, greedy)
        _close_or_at_a_step(got, online, p, depths, greedy)
        torch.testing.assert_close(numpy_read.estimate(p, depths, greedy), online.reference_estimate(p, depths, greedy),
                                   rtol=0, atol=1e-12)
        for d in range(1, depth + 2):
            _close_or_at_a_step(online.estimate(p.float(), d), online, p.float().double(), d, True)
        for d in range(1, depth + 1):  # the gate's thresholds read through the host library
            assert online.threshold(d, 0.3) == pytest.approx(numpy_read.threshold(d, 0.3), abs=1e-12)
        odd = torch.tensor([-0.5, 1.5, float("inf"), -float("inf"), float("nan")], dtype=torch.float64)
        got, want = online.estimate(odd, 1, False), online.reference_estimate(odd, 1, False)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12, equal_nan=True)
        torch.testing.assert_close(got, numpy_read.estimate(odd, 1, False), rtol=0, atol=1e-12, equal_nan=True)
        online.reader = None


def test_bad_arrays_are_refused_by_name(host_backend):
    lib = kernels._lib("host")
    online = OnlineAcceptance(3)
    online.estimate(torch.tensor([0.5]), 1)
    table = online._segments_table()
    with pytest.raises(kernels.PluginError, match=r"rows\[1\] = 6 is outside \[0, 6\)"):
        kernels._estimate_host(lib, table, np.array([0.5, 0.5]), np.array([0, 6]))
    assert np.isnan(kernels._estimate_host(lib, table, np.array([np.nan]), np.array([0]))[0])
    shifted = dict(table, keys=table["keys"] + 0.5, host=None)
    with pytest.raises(kernels.PluginError, match="first segment must start at key 0"):
        kernels._estimate_host(lib, shifted, np.array([0.5]), np.array([0]))
    bad = dict(table, keys=np.concatenate([[0.0], table["keys"][1:][::-1]]), host=None)
    with pytest.raises(kernels.PluginError, match="keys must be ascending"):
        kernels._estimate_host(lib, bad, np.array([0.5]), np.array([0]))
    assert kernels._estimate_host(lib, table, np.zeros(0), np.zeros(0, dtype=np.int32)).shape == (0,)



@pytest.mark.parametrize("seed", range(6))
def test_the_refit_in_one_call_is_numpys(host_backend, seed):
    """`kernels.host_acceptance_refitter` (the fit, its segments and the gate's grids in one call) against
    `_fit`, `_segments_table` and `threshold` with NumPy on the same counts, step after step of random traffic
    (greedy and other rows, empty bins, one depth and several), then the estimates read off it."""
    refitter = kernels.host_acceptance_refitter()
    assert refitter is not None
    depth = 1 + seed % 5
    host, gen = random_online_acceptance(seed, depth, False, 1.0 + seed, 30.0, 1 + seed % 2)
    numpy_fit, _ = random_online_acceptance(seed, depth, False, 1.0 + seed, 30.0, 1 + seed % 2)
    # both read their grids through the host library's estimates, as the runtime did before the refit was one call
    # (NumPy's read differs from it at a few points exactly on a step: test_the_host_library_reads_the_estimates...)
    calls = []  # the host's refits are the library's: counted

    def counted(*args):
        calls.append(host.version)
        return refitter(*args)
    host.refitter, host.reader = counted, kernels.host_estimate_reader()
    numpy_fit.reader = host.reader
    for step in range(10):
        n = int(torch.randint(0, 60, (1,), generator=gen))
        c = torch.rand(n, generator=gen, dtype=torch.float64) ** (1 + step % 4)
        args = (torch.randint(1, depth + 3, (n,), generator=gen), c,
                torch.rand(n, generator=gen, dtype=torch.float64) < c.sqrt(), torch.rand(n, generator=gen) < 0.6)
        for online in (host, numpy_fit):
            online.observe(*args)
        for lam in (0.05, 0.3, 0.7):
            for d in range(1, depth + 2):
                assert host.threshold(d, lam) == pytest.approx(numpy_fit.threshold(d, lam), abs=1e-12)
        assert host._grid["version"] == host._table["version"] == host._fit_version == numpy_fit._fit_version
        assert calls and calls[-1] == host._fit_version  # this fit came from the library
        for got, want in zip(host._fit(), numpy_fit._fit()):
            np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-15)
        got, want = host._segments_table(), numpy_fit._segments_table()
        for key in ("keys", "start", "l0", "l1", "share", "e0", "e1"):
            np.testing.assert_allclose(got[key], want[key], rtol=1e-12, atol=1e-14, err_msg=key)
        assert (got["deep"] is None) == (want["deep"] is None) == (depth == 1)
        assert depth == 1 or np.array_equal(got["deep"], want["deep"])
        for d in range(1, depth + 1):
            np.testing.assert_allclose(host._grid[d], numpy_fit._grid[d], rtol=1e-12, atol=1e-14)
        p = torch.rand(200, generator=gen, dtype=torch.float64) ** 3
        rows, greedy = torch.randint(1, depth + 2, p.shape, generator=gen), torch.rand(p.shape, generator=gen) < 0.5
        torch.testing.assert_close(host.estimate(p, rows, greedy), numpy_fit.estimate(p, rows, greedy), rtol=0,
                                   atol=1e-12)
        host.reader = None  # the host's segments read with NumPy, against the fit read directly
        _close_or_at_a_step(host.estimate(p, rows, greedy), numpy_fit, p, rows, greedy)
        host.reader = numpy_fit.reader


def test_the_refit_refuses_bad_arrays_by_name(host_backend):
    refit = kernels.host_acceptance_refitter()
    online = OnlineAcceptance(2)
    arrays = [online.n.numpy(), online.k.numpy(), online.csum.numpy(), online.mid.numpy(), online.p0.numpy()]
    edges, grid = online._edges, np.linspace(0, 1, 5)
    assert refit(*arrays, edges, 2.0, grid)[2].shape == (2, 5)
    with pytest.raises(kernels.PluginError, match="prior_weight must be > 0, got 0"):
        refit(*arrays, edges, 0.0, grid)
    with pytest.raises(kernels.PluginError, match=r"counts must be finite and >= 0, n\[3\] = -1"):
        bad = arrays[0].copy()
        bad.reshape(-1)[3] = -1.0
        refit(bad, *arrays[1:], edges, 2.0, grid)
    with pytest.raises(kernels.PluginError, match="k, csum, p0 and mid must be finite, got 0, nan"):
        bad = arrays[2].copy()  # a NaN confidence counted
        bad.reshape(-1)[4] = np.nan
        refit(*arrays[:2], bad, *arrays[3:], edges, 2.0, grid)
    with pytest.raises(kernels.PluginError, match="edges must be ascending"):
        refit(*arrays, edges[[0, 2, 1, *range(3, edges.size)]], 2.0, grid)
    with pytest.raises(ValueError, match="must be \\(2 max_depth, bins\\)"):
        refit(arrays[0][:3], *arrays[1:], edges, 2.0, grid)
