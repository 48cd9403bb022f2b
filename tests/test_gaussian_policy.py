"""ppo_continuous.py's Gaussian policy: log-probabilities and entropy against closed forms and
numerical densities, for clipped and for tanh-squashed (rescaled) actions, and the rollout's
samples drawn from each step's key."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import load_algorithm

pc = load_algorithm("ppo_continuous")


def reference_log_prob(x, mean, log_std):
    """Sum over dimensions of log N(x; m, s^2) = -(x-m)^2 / (2 s^2) - log s - log(2 pi) / 2."""
    total = 0.0
    for xi, mi, li in zip(x, mean, log_std, strict=False):
        s = math.exp(li)
        total += -((xi - mi) ** 2) / (2 * s * s) - li - 0.5 * math.log(2 * math.pi)
    return total


def test_gaussian_log_prob_matches_closed_form():
    x = np.array([[0.3, -1.2], [2.5, 0.0], [-4.0, 7.0]], np.float32)
    mean = np.array([[0.0, 0.5], [2.0, -1.0], [1.0, 1.0]], np.float32)
    log_std = np.array([-0.7, 0.4], np.float32)  # state-independent: broadcast over the batch
    got = np.asarray(pc.policy(mean, log_std).log_prob(x))
    want = [reference_log_prob(x[i], mean[i], log_std) for i in range(3)]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_gaussian_entropy_matches_closed_form_and_numerical_integral():
    log_std = np.array([-1.5, 0.0, 0.8], np.float32)
    want = sum(0.5 * math.log(2 * math.pi * math.e * math.exp(2 * l)) for l in log_std)
    assert float(pc.policy(jnp.zeros(3), log_std).entropy()) == pytest.approx(want, rel=1e-6)
    # -integral of p log p, dimension by dimension (independent dimensions: entropies add).
    numeric = 0.0
    for l in log_std:
        grid = np.linspace(-12, 12, 200_001) * math.exp(l)
        log_p = np.asarray(pc.policy(jnp.zeros(1), jnp.array([l])).log_prob(grid[:, None])).astype(np.float64)
        p = np.exp(log_p)
        assert np.trapezoid(p, grid) == pytest.approx(1.0, abs=1e-6)
        numeric += -np.trapezoid(p * log_p, grid)
    assert numeric == pytest.approx(want, rel=1e-5)


def normal_cdf(z):
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


@pytest.mark.parametrize("low, high", [(-2.0, 2.0), (-1.0, 3.0)])
def test_squashed_log_prob_is_the_density_of_the_executed_action(low, high):
    """a = centre + half * tanh(u), u ~ N(m, s^2): P(a <= A) = Phi((atanh((A - centre) / half) - m) / s);
    its finite-difference derivative is the density that exp(log_prob) must equal."""
    mean, log_std = 0.4, -0.3
    squash = pc.ActionMap(jnp.array([low]), jnp.array([high]), True)
    centre, half, s = (high + low) / 2, (high - low) / 2, math.exp(log_std)

    def cdf(a):
        return normal_cdf((math.atanh((a - centre) / half) - mean) / s)

    u = np.array([-2.0, -0.5, 0.0, 0.3, 1.1, 2.5], np.float32)
    action = np.asarray(squash(u[:, None]))[:, 0]
    np.testing.assert_allclose(action, centre + half * np.tanh(u), rtol=1e-6)
    assert (action > low).all() and (action < high).all()
    log_prob = np.asarray(squash.log_prob(u[:, None], jnp.float32(mean), jnp.array([log_std])))
    for a, lp in zip(action.astype(np.float64), log_prob, strict=False):
        h = 1e-5 * half
        density = (cdf(a + h) - cdf(a - h)) / (2 * h)
        assert math.exp(lp) == pytest.approx(density, rel=1e-3), a
    # The correction is exactly log |da/du|, and stays finite where tanh(u) rounds to +-1.
    plain = np.asarray(pc.policy(mean, jnp.array([log_std])).log_prob(u[:, None]))
    np.testing.assert_allclose(
        plain - log_prob, np.log(half * (1 - np.tanh(u.astype(np.float64)) ** 2)), rtol=1e-5, atol=1e-5
    )
    extreme = squash.log_prob(jnp.array([[30.0], [-30.0]]), jnp.float32(0.0), jnp.array([0.0]))
    assert np.isfinite(np.asarray(extreme)).all()


def test_clipped_actions_keep_the_unclipped_samples_log_prob():
    clip = pc.ActionMap(jnp.array([-2.0, -1.0]), jnp.array([2.0, 1.0]), False)
    u = np.array([[3.0, -0.5], [-2.5, 1.5], [0.1, 0.2]], np.float32)
    np.testing.assert_array_equal(np.asarray(clip(u)), np.array([[2, -0.5], [-2, 1], [0.1, 0.2]], np.float32))
    mean, log_std = np.zeros((3, 2), np.float32), np.array([0.2, -0.1], np.float32)
    np.testing.assert_array_equal(
        np.asarray(clip.log_prob(u, mean, log_std)), np.asarray(pc.policy(mean, log_std).log_prob(u))
    )


@pytest.mark.parametrize("squash", [False, True])
def test_sample_action_is_drawn_from_the_steps_key(squash):
    """The rollout's action: u = mean + std * normal(key), drawn from the key the step is given (no noise
    drawn ahead), with the stored log-probability of the closed form (minus log|da/du| when squashed)."""
    config = pc.Config(hidden_size=8, num_layers=1, log_std_init=-0.4, squash=squash)
    networks = pc.make_networks(config, action_dim=2, obs_shape=(3,))
    params = {"actor": networks.actor.init(jax.random.PRNGKey(0), jnp.zeros((1, 3)))}
    to_env = pc.ActionMap(jnp.array([-2.0, -1.0]), jnp.array([2.0, 3.0]), squash)
    obs, key = jnp.asarray(np.random.default_rng(0).normal(size=(5, 3)), jnp.float32), jax.random.PRNGKey(7)
    mean, log_std = networks.actor.apply(params["actor"], obs)
    action, log_prob = pc.sample_action(mean, log_std, to_env, key)
    np.testing.assert_allclose(action, mean + np.exp(log_std) * jax.random.normal(key, (5, 2)), rtol=1e-6, atol=1e-7)
    want = np.array([reference_log_prob(u, m, log_std) for u, m in zip(action, mean, strict=True)])
    if squash:
        half = np.array([2.0, 2.0])
        want -= np.log(half * (1 - np.tanh(np.asarray(action, np.float64)) ** 2)).sum(-1)
    np.testing.assert_allclose(log_prob, want, rtol=1e-5)
    again, _ = pc.sample_action(mean, log_std, to_env, key)
    other, _ = pc.sample_action(mean, log_std, to_env, jax.random.PRNGKey(8))
    np.testing.assert_array_equal(again, action)
    assert (np.asarray(other) != np.asarray(action)).all()
    # Many draws: the Gaussian's own mean and std.
    many, _ = jax.vmap(lambda k: pc.sample_action(mean[:1], log_std, to_env, k))(jax.random.split(key, 20_000))
    np.testing.assert_allclose(many[:, 0].mean(0), mean[0], atol=0.02)
    np.testing.assert_allclose(many[:, 0].std(0), np.exp(log_std), rtol=0.02)
