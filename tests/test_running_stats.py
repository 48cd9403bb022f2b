"""ppo_continuous.py's normalisers: running observation statistics against NumPy over a whole
stream, the normalisation itself, and the reward scaler's discounted returns against a NumPy loop
with terminations and truncations."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TERMINATED, TRUNCATED, load_algorithm

pc = load_algorithm("ppo_continuous")


def test_running_stats_equal_numpy_over_the_whole_stream():
    rng = np.random.default_rng(0)
    # Features on very different scales and offsets; batches of different sizes and layouts.
    scale, offset = np.array([0.01, 1.0, 30.0]), np.array([5.0, -2.0, 100.0])
    batches = [rng.normal(size=shape + (3,)) * scale + offset for shape in [(7,), (4, 5), (1,), (3, 2, 6), (50,)]]
    update = jax.jit(pc.update_stats)
    stats = pc.RunningStats.empty((3,))
    seen = []
    for batch in batches:
        stats = update(stats, jnp.asarray(batch, jnp.float32))
        seen.append(batch.reshape(-1, 3).astype(np.float32).astype(np.float64))
        stream = np.concatenate(seen)
        assert stats.mean.shape == stats.var.shape == (3,)
        assert float(stats.count) == len(stream)
        # float32 arithmetic: the mean to a small fraction of each feature's spread.
        np.testing.assert_allclose((stats.mean - stream.mean(0)) / scale, 0.0, atol=1e-4)
        np.testing.assert_allclose(stats.var, stream.var(0), rtol=1e-3)

    # Scalar statistics (the discounted return's) work the same way.
    returns = rng.normal(size=(6, 5)) * 40 - 300
    scalar = pc.update_stats(pc.update_stats(pc.RunningStats.empty(), returns[:2]), returns[2:])
    assert scalar.mean.shape == ()
    np.testing.assert_allclose([scalar.mean, scalar.var], [returns.mean(), returns.var()], rtol=1e-5)


def test_normalize_uses_mean_and_std_and_clips():
    stats = pc.RunningStats(jnp.array([1.0, -3.0]), jnp.array([4.0, 1e-12]), jnp.float32(10))
    got = np.asarray(pc.normalize(stats, jnp.array([[5.0, -3.0], [-1.0, -2.0]])))
    np.testing.assert_allclose(got, [[2.0, 0.0], [-1.0, 10.0]], rtol=1e-6)  # 1 / sqrt(1e-12 + 1e-8) clips


def reference_discounted_returns(reward, done, gamma, initial):
    T, N = reward.shape
    returns, g = np.zeros((T, N)), np.array(initial, np.float64)
    for t in range(T):
        g = gamma * g + reward[t]
        returns[t] = g
        g = np.where(done[t], 0.0, g)
    return returns, g


@pytest.mark.parametrize("gamma", [0.99, 0.5])
def test_discounted_returns_restart_at_every_episode_end(gamma):
    rng = np.random.default_rng(1)
    reward = rng.normal(size=TERMINATED.shape).astype(np.float32)
    initial = rng.normal(size=TERMINATED.shape[1]).astype(np.float32)
    done = TERMINATED | TRUNCATED
    returns, last = pc.discounted_returns(
        jnp.asarray(reward), jnp.asarray(done), jnp.float32(gamma), jnp.asarray(initial)
    )
    want, want_last = reference_discounted_returns(reward, done, gamma, initial)
    np.testing.assert_allclose(returns, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(last, want_last, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(last)[done[-1]], 0.0)
