"""The online whole-step cost model (core/steps.py, core/prices.py) against independent references: numpy's
interpolation for the knot basis, the closed-form Bayesian least-squares posterior for the filter without drift, and
synthetic machines whose true costs are known."""

import numpy as np
import pytest
import torch

from echo_trtllm.core.cost import CostModel, budget_rates, choose_budget
from echo_trtllm.core.prices import KalmanLinear, StepCostModel
from echo_trtllm.core.steps import (KNOTS, StepSample, drafting_features, hat, hat_at, sample_features,
                                    verification_features)


def test_the_knot_basis_is_linear_interpolation():
    y = np.random.default_rng(0).random(len(KNOTS))
    x = np.array([1, 1.5, 3, 7, 100, 1000, 4096])
    assert np.allclose(hat(x) @ y, np.interp(x, KNOTS, y))
    assert np.allclose(hat(x).sum(axis=1), 1.0)
    assert hat(np.array([0.0])).sum() == 0.0  # no forward, no weight
    # beyond the last knot: the last segment extended
    slope = (y[-1] - y[-2]) / (KNOTS[-1] - KNOTS[-2])
    assert float((hat(np.array([5000.0])) @ y)[0]) == pytest.approx(y[-1] + slope * (5000 - KNOTS[-1]))
    for v in (1, 3, 17, 4096, 6000):
        i, u = hat_at(v)
        row = np.zeros(len(KNOTS))
        row[i], row[i + 1] = 1 - u, u
        assert np.allclose(row, hat(np.array([float(v)]))[0])


def test_one_samples_features_are_the_batch_features():
    samples = [StepSample(4, 4, 100.0), StepSample(16, 40, 300.0, (48, 64, 64), 0.01, 0.02, 16),
               StepSample(1, 7, 12.0, (3,), 0.001, 0.002)]
    levels = max(len(s.draft_tokens) for s in samples)
    draft = np.zeros((len(samples), levels))
    for i, s in enumerate(samples):
        draft[i, : len(s.draft_tokens)] = s.draft_tokens
    ctx = np.array([s.context for s in samples])
    d = drafting_features(draft, ctx)
    v = verification_features([s.batch_size for s in samples], [s.verified_tokens for s in samples], ctx,
                              [float(s.speculated) for s in samples])
    for i, s in enumerate(samples):
        sd, sv = sample_features(s)
        assert np.allclose(sd, d[i]) and np.allclose(sv, v[i])


def test_a_sample_refuses_what_no_step_can_be():
    with pytest.raises(ValueError, match="verified_tokens"):
        StepSample(4, 3, 0.0)
    with pytest.raises(ValueError, match="batch_size"):
        StepSample(0, 1, 0.0)
    with pytest.raises(ValueError, match="catch_up_tokens"):
        StepSample(1, 2, 0.0, (3,), catch_up_tokens=4)
    with pytest.raises(ValueError, match="draft_tokens"):
        StepSample(1, 2, 0.0, (0,))


def test_without_drift_the_filter_is_the_bayesian_least_squares_posterior():
    """Kalman updates with no drift and no clipping equal the closed-form posterior mean of linear regression with
    the same Gaussian prior and the same per-measurement noise variances (the filter records the ones it used)."""
    rng = np.random.default_rng(1)
    truth = np.array([0.002, 0.004, 0.001, 0.003, 0.005])
    n = truth.size
    # a prior near the truth, so no update would push a coefficient below zero (the filter's projection)
    m0, p0 = truth * (0.7 + 0.6 * rng.random(n)), np.diag((0.3 * truth) ** 2)
    kf = KalmanLinear(m0, p0, drift_common=0.0, drift_each=0.0, huber=1e9)
    phis, ys, noise = [], [], []
    for _ in range(30):
        phi = rng.random(n)
        y = float(phi @ truth) * (1 + 0.05 * rng.normal())
        kf.update(phi, y)
        assert (kf.theta > 0).all()
        phis.append(phi)
        ys.append(y)
        noise.append(kf.last_noise_var)
    x, r = np.array(phis), np.diag(noise)
    precision = np.linalg.inv(p0) + x.T @ np.linalg.inv(r) @ x
    mean = np.linalg.solve(precision, np.linalg.inv(p0) @ m0 + x.T @ np.linalg.inv(r) @ np.array(ys))
    assert np.allclose(kf.theta, np.maximum(mean, 0), rtol=1e-6, atol=1e-9)
    assert np.allclose(kf.cov, np.linalg.inv(precision), rtol=1e-5, atol=1e-12)


def plain(b: int, seconds: float, context: float = 64.0) -> StepSample:
    return StepSample(b, b, context, (), 0.0001, seconds)


def test_prices_learn_the_machine_and_price_an_unseen_batch_from_its_neighbours():
    """The docstring's example: truth 2 ms + 0.1 ms per token, a prior that believes 4 ms + 0.1 ms per token; after
    30 plain steps at 8, 16 and 64 tokens the prices there are within 3 %, and 32 tokens, never measured, is priced
    from its neighbours within 5 %."""
    model = StepCostModel.from_cost_model(CostModel.linear(0.004, 0.0001))
    truth = lambda t: 0.0001 + 0.002 + 0.0001 * t  # noqa: E731 - drafting phase + verification
    for i in range(30):
        t = (8, 16, 64)[i % 3]
        model.observe(plain(t, truth(t) - 0.0001))
    for t in (8, 16, 64):
        assert model.plain_seconds(t, 64.0) == pytest.approx(truth(t), rel=0.03)
    assert model.plain_seconds(32, 64.0) == pytest.approx(truth(32), rel=0.05)
    assert model.median_relative_error(10) < 0.03


def test_prices_follow_a_machine_that_slows_by_half():
    rng = np.random.default_rng(2)
    model = StepCostModel.from_cost_model(CostModel.linear(0.004, 0.0001))
    for i in range(400):
        speed = 1.0 if i < 200 else 2.0
        t = int(rng.choice([4, 16, 48]))
        seconds = speed * (0.003 + 0.00015 * t) * float(np.exp(rng.normal(0, 0.03)))
        model.observe(plain(t, seconds))
        if i == 199:
            before = model.plain_seconds(16, 64.0)
    after = model.plain_seconds(16, 64.0)
    assert before == pytest.approx(0.003 + 0.00015 * 16, rel=0.05)
    assert after == pytest.approx(2 * (0.003 + 0.00015 * 16), rel=0.05)
    assert model.median_relative_error(150) < 0.06  # within 50 steps of the change the error is noise again


def test_one_burst_moves_the_prices_a_bounded_amount():
    model = StepCostModel.from_cost_model(CostModel.linear(0.004, 0.0001))
    for _ in range(100):
        model.observe(plain(16, 0.0056))
    steady = model.plain_seconds(16, 64.0)
    model.observe(plain(16, 0.056))  # another process took the machine for one step: 10 x
    assert model.plain_seconds(16, 64.0) < 1.15 * steady


def test_speculative_steps_teach_the_drafting_prices():
    """Draft forwards and a speculative step's host work, absent from the load-time prior, are learned: after 60
    speculative steps of 1 to 4 draft levels on a machine whose drafting costs 1 ms per forward + 20 us per token
    + 2 ms per step, the prices of a draft level and of the whole step match it."""
    rng = np.random.default_rng(3)
    model = StepCostModel.from_cost_model(CostModel((1, 64), (0.004, 0.01), (1, 64), (0.0003, 0.0006)))
    for _ in range(60):
        b = int(rng.choice([1, 4, 16]))
        forwards = (2 * b,) + (b,) * int(rng.integers(0, 4))
        drafting = 0.002 + sum(0.001 + 0.00002 * f for f in forwards)
        model.observe(StepSample(b, 3 * b, 64.0, forwards, drafting, 0.004 + 0.0001 * 3 * b))
    assert float(model.prices.draft_time(4, 64.0)) == pytest.approx(0.001 + 0.00002 * 4, rel=0.15)
    assert float(model.prices.draft_time(16, 64.0)) == pytest.approx(0.001 + 0.00002 * 16, rel=0.15)
    whole = model.predict_sample(StepSample(4, 12, 64.0, (8, 4, 4), 0, 0))
    assert whole == pytest.approx(0.002 + 3 * 0.001 + 0.00002 * 16 + 0.004 + 0.0012, rel=0.05)


def test_the_rules_read_the_same_prices():
    """The read interface the budget rule uses (StepPrices) is the model: scalars and tensors agree with the
    model's own prediction, and choose_budget works on it."""
    model = StepCostModel.from_cost_model(CostModel.linear(0.004, 0.0001))
    prices = model.prices
    for b, t, c in ((1, 5, 30.0), (16, 40, 300.0)):
        spec = StepSample(b, t, c, (2 * b,))
        scalar = float(prices.verify_time(t, c, b))
        tensor = float(prices.verify_time(torch.tensor([t]), c, b)[0])
        assert scalar == pytest.approx(tensor)
        whole = prices.drafting_time([2 * b], c) + scalar + prices.control_seconds
        assert whole == pytest.approx(model.predict_sample(spec))
    rates = budget_rates(torch.tensor([0.9, 0.5]), 4, prices, 0.001, 64.0)
    assert rates.shape == (3,) and choose_budget(torch.tensor([0.9, 0.5]), 4, prices, 0.001, 64.0) >= 4


def test_the_curves_read_in_numpy_are_the_tensor_reads_bit_for_bit():
    """A CPU tensor of tokens is read in NumPy (`StepPrices._curve_np`); the tensor branch of `_curve` is its
    oracle, equal bit for bit on and beyond the knots (extrapolated segments, fractional tokens), and the whole
    verification and draft prices equal each token read as a scalar. Knot values drawn at random, not monotone."""
    from echo_trtllm.core.prices import StepPrices

    rng = np.random.default_rng(3)
    knots_t = torch.tensor(KNOTS, dtype=torch.float64)
    x = torch.tensor([0.0, 0.5, 1, 1.5, 2, 3, 16, 17, 100.25, 4095, 4096, 5000, 9000], dtype=torch.float64)
    for _ in range(5):
        values = rng.random(len(KNOTS)) * 0.1
        oracle = StepPrices._curve(values.tolist(), torch.from_numpy(values), knots_t, x)
        got = StepPrices._curve_np(values, knots_t.numpy(), x.numpy())
        assert np.array_equal(got, oracle.numpy())
    prices = StepCostModel.from_cost_model(CostModel.linear(0.004, 0.0001)).prices
    tokens = torch.arange(1, 300)
    for b, c in ((1, 30.0), (16, 300.0)):
        verify = prices.verify_time(tokens, c, b)
        assert verify.dtype == torch.float64
        assert verify.tolist() == pytest.approx([prices.verify_time(int(t), c, b) for t in tokens], rel=1e-12)
        draft = prices.draft_time(tokens, c)
        assert draft.tolist() == pytest.approx([prices.draft_time(int(t), c) for t in tokens], rel=1e-12)


def test_what_no_step_can_measure_is_refused_before_it_poisons_the_prices():
    with pytest.raises(ValueError, match="finite"):
        StepSample(1, 1, 0.0, (), 0.0, float("inf"))
    with pytest.raises(ValueError, match="finite"):
        StepSample(1, 1, float("nan"))
    kf = KalmanLinear(np.ones(2), np.eye(2))
    with pytest.raises(ValueError, match="finite"):
        kf.update(np.ones(2), float("nan"))
    assert np.isfinite(kf.theta).all()


def test_a_step_that_drafts_but_verifies_its_roots_only_is_no_tree():
    drafted_only = StepSample(4, 4, 64.0, (8,), 0.002, 0.01)
    assert drafted_only.speculated and not drafted_only.verified_drafts
    _, v = sample_features(drafted_only)
    assert v[-2] == 1.0 and v[-1] == 0.0  # the draft's commit yes, a tree's verification no


def test_a_step_cheaper_than_its_price_lowers_its_price():
    """Coefficients are costs (>= 0). Fitted on speculative steps of 64 rows (3.7 s), the model held its per-row
    and attention coefficients at zero; a plain step of 64 rows measured at 0.59 s where it predicted 1.9 s pushed
    the per-row coefficient below zero: clipped back alone, it left the prediction 17 % higher than before. The
    mean is now projected onto the costs' bounds in the covariance's metric: the plain price falls to within 25 %
    of the measurement, the speculative steps' stays within 10 % of theirs."""
    model = StepCostModel.from_cost_model(CostModel((1, 4096), (1.9015, 1.9 + 0.0015 * 4096), (1, 4096),
                                                    (0.201, 0.2 + 0.001 * 4096)))
    spec = StepSample(64, 320, 400.0, (128, 64, 64, 64), 1.48, 2.22)
    plain = StepSample(64, 64, 400.0, (), 0.002, 0.59)
    for _ in range(12):
        model.observe(spec)
    before = model.predict_sample(plain)
    model.observe(plain)
    after = model.predict_sample(plain)
    assert after < before and after == pytest.approx(plain.seconds, rel=0.25)
    assert model.predict_sample(spec) == pytest.approx(spec.seconds, rel=0.1)
    assert (model.theta_verification >= 0).all() and (model.theta_drafting >= 0).all()


def test_a_held_update_is_the_update_of_the_free_coefficients_alone():
    """`KalmanLinear.update(free=...)` reads the held coefficients as known: the measurement less their part is a
    measurement of the free ones. Against two references: with a prior that does not correlate free and held
    coefficients, the closed-form Bayesian least-squares posterior of the free ones on y - phi_h . theta_h over 30
    updates (the held ones, their block and the cross-covariance untouched); with any prior, the dense Joseph form
    (I - K phi_f')P(I - K phi_f')' + K R K' of the gain K = P phi_f / (phi_f' P phi_f + R), zero on the held rows.
    No free coefficient becomes more uncertain than it was; with every coefficient free it is the plain update."""
    rng = np.random.default_rng(5)
    n = 6
    free = np.array([False, True, False, True, True, False])
    f, h = np.flatnonzero(free), np.flatnonzero(~free)
    m0 = 0.002 + 0.001 * rng.random(n)
    # 1. a block-diagonal prior: the free block's regression posterior
    p0 = np.diag((0.3 * m0) ** 2)
    truth = m0 * (0.8 + 0.4 * rng.random(n))
    kf = KalmanLinear(m0, p0, drift_common=0.0, drift_each=0.0, huber=1e9)
    phis, ys, noise = [], [], []
    for _ in range(30):
        phi = rng.random(n)
        y = float(phi @ truth) * (1 + 0.05 * rng.normal())
        kf.update(phi, y, free=free)
        phis.append(phi[f])
        ys.append(y - float(phi[h] @ m0[h]))
        noise.append(kf.last_noise_var)
    x, r_inv = np.array(phis), np.diag(1 / np.array(noise))
    precision = np.linalg.inv(p0[np.ix_(f, f)]) + x.T @ r_inv @ x
    mean = np.linalg.solve(precision, np.linalg.inv(p0[np.ix_(f, f)]) @ m0[f] + x.T @ r_inv @ np.array(ys))
    assert (mean > 0).all()  # no projection in play: the reference has none
    assert np.allclose(kf.theta[f], mean, rtol=1e-6) and np.array_equal(kf.theta[h], m0[h])
    assert np.allclose(kf.cov[np.ix_(f, f)], np.linalg.inv(precision), rtol=1e-5, atol=1e-16)
    assert np.array_equal(kf.cov[np.ix_(h, h)], p0[np.ix_(h, h)]) and not kf.cov[np.ix_(f, h)].any()
    # 2. a prior that correlates everything: the dense Joseph form of the gain
    a = rng.normal(size=(n, n))
    p0 = a @ a.T * 1e-6 + np.eye(n) * 1e-7
    kf = KalmanLinear(m0, p0, drift_common=0.0, drift_each=0.0, huber=1e9)
    theta, cov = m0.copy(), p0.copy()
    for _ in range(5):
        phi = rng.random(n)
        y = float(phi @ theta) * 1.1
        before = np.diag(kf.cov).copy()
        kf.update(phi, y, free=free)
        phi_f = np.where(free, phi, 0.0)
        gain = np.where(free, cov @ phi_f / (phi_f @ cov @ phi_f + kf.last_noise_var), 0.0)
        theta = theta + gain * (y - phi @ theta)
        j = np.eye(n) - np.outer(gain, phi_f)
        cov = j @ cov @ j.T + kf.last_noise_var * np.outer(gain, gain)
        assert (theta > 0).all()
        assert np.allclose(kf.theta, theta, rtol=1e-9, atol=1e-15)
        assert np.allclose(kf.cov, cov, rtol=1e-7, atol=1e-16)
        assert (np.diag(kf.cov) <= before * (1 + 1e-12)).all()
    assert np.array_equal(kf.theta[h], m0[h]) and np.array_equal(kf.cov[np.ix_(h, h)], p0[np.ix_(h, h)])
    phi = rng.random(n)
    every, plain_kf = (KalmanLinear(m0, p0, drift_common=0.0, drift_each=0.0, huber=1e9) for _ in range(2))
    every.update(phi, 0.01, free=np.ones(n, dtype=bool))
    plain_kf.update(phi, 0.01)
    assert np.allclose(every.theta, plain_kf.theta) and np.allclose(every.cov, plain_kf.cov)
    with pytest.raises(ValueError, match="free"):
        kf.update(phi, 0.01, free=np.ones(n - 1, dtype=bool))


def test_a_held_update_projects_the_free_coefficients_only():
    """A measurement far below the price drives free coefficients below zero: the projection pins and moves the
    free ones only (the held ones neither move nor constrain it), all stay costs >= 0. A step with no free
    feature teaches nothing, even with no noise (no division by zero)."""
    rng = np.random.default_rng(11)
    n = 5
    free = np.array([True, False, True, True, False])
    for _ in range(50):
        a = rng.normal(size=(n, n))
        p0 = a @ a.T * 1e-6 + np.eye(n) * 1e-8
        m0 = 0.001 + 0.001 * rng.random(n)
        kf = KalmanLinear(m0, p0, drift_common=0.0, drift_each=0.0, huber=1e9)
        kf.update(rng.random(n), 0.0001, free=free)
        assert (kf.theta >= 0).all() and np.array_equal(kf.theta[~free], m0[~free])
    kf = KalmanLinear(np.array([0.001, 0.002]), np.eye(2) * 1e-6, noise=0.0, noise_floor=0.0)
    kf.update(np.array([0.0, 1.0]), 0.003, free=np.array([True, False]))
    assert np.allclose(kf.theta, [0.001, 0.002]) and np.isfinite(kf.cov).all()


def test_warm_up_steps_teach_the_constants_and_leave_the_measured_forwards():
    """The engine's warm-up (a few steps at one context, 1 and 4 rows) learns with forwards=False. A machine whose
    forwards the load measured exactly (the prior: a target step of 100 ms + 6 ms a token, a draft level of 4 ms +
    0.1 ms a token) and whose speculative steps add host work the load never sees (8 ms drafting, 15 ms verifying a
    tree); the steps are noisy (5 %). Learnt so, the 16-row plain step and one more token there stay as the load
    priced them, and a speculative step is priced within 10 % of the truth; learnt on every coefficient, the same
    steps move the 16-row prices (by 2-9 % over seeds 0-5 here; on the Qwen pair, four builds priced the plain step at
    217-330 ms and one more token at 6.3-16.7 ms where the load alone priced them at 182-209 and 7.1-7.8)."""
    truth = CostModel((1, 4096), (0.106, 0.1 + 0.006 * 4096), (1, 4096), (0.0041, 0.004 + 0.0001 * 4096))
    rng = np.random.default_rng(7)

    def step(b, t, noise=1.0):
        forwards = (b, b) if t > b else ()
        drafting = 0.008 + float(truth.draft_level_time(torch.tensor(float(b)))) * 2 if forwards else 0.0005
        verify = float(truth.verify_time(t)) + (0.015 if t > b else 0.0)
        return StepSample(b, t, 200.0, forwards, drafting * noise, verify * noise)

    held, every = (StepCostModel.from_cost_model(truth) for _ in range(2))
    for b in (1, 4):
        for k in range(6):
            s = step(b, 3 * b if k % 2 == 0 else b, float(np.exp(rng.normal(0, 0.05))))
            held.observe(s, forwards=False)
            every.observe(s)

    def sixteen(model):
        plain16 = float(model.prices.verify_time(16, 200.0, 16))
        return plain16, float(model.prices.verify_time(17, 200.0, 16)) - plain16

    true16 = float(truth.verify_time(16))
    plain16, token = sixteen(held)
    assert plain16 == pytest.approx(true16, rel=1e-6) and token == pytest.approx(0.006, rel=1e-6)
    for b in (1, 4, 16):
        spec = step(b, 3 * b)
        assert held.predict_sample(spec) == pytest.approx(spec.seconds, rel=0.1)
        assert held.predict_sample(step(b, b)) == pytest.approx(step(b, b).seconds, rel=0.1)
    plain16, token = sixteen(every)
    assert abs(plain16 / true16 - 1) > 0.01 or abs(token / 0.006 - 1) > 0.01
