"""PPO's GAE (ppo.py; the other PPO files use the same function) against an independent NumPy
reference on hand-made trajectories with terminations and truncations."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TERMINATED, TRUNCATED, check_bootstrap_at_truncation_only


def reference_gae(reward, value, next_value, terminated, truncated, gamma, lam):
    """Plain double loop, float64.

    delta_t = r_t + gamma * (1 - terminated_t) * next_value_t - value_t
    A_t     = delta_t + gamma * lam * (1 - done_t) * A_{t+1},   A_T = 0,   done = terminated | truncated
    target  = A + value
    """
    T, N = reward.shape
    done = terminated | truncated
    advantage = np.zeros((T, N))
    for n in range(N):
        next_advantage = 0.0
        for t in reversed(range(T)):
            delta = reward[t, n] + gamma * (1.0 - terminated[t, n]) * next_value[t, n] - value[t, n]
            next_advantage = delta + gamma * lam * (1.0 - done[t, n]) * next_advantage
            advantage[t, n] = next_advantage
    return advantage, advantage + value


# TERMINATED, TRUNCATED: the [T=6, N=5] episode-boundary patterns shared with every return test.


def trajectory(seed):
    rng = np.random.default_rng(seed)
    shape = TERMINATED.shape
    return (
        rng.normal(size=shape).astype(np.float32),  # reward
        rng.normal(size=shape).astype(np.float32),  # value
        rng.normal(size=shape).astype(np.float32),
    )  # next_value


def call_gae(ppo, reward, value, next_value, terminated, truncated, gamma, lam):
    """Inputs typed the way ppo's update passes them: float terminated, bool done."""
    advantage, target = jax.jit(ppo.compute_gae)(
        jnp.asarray(reward),
        jnp.asarray(value),
        jnp.asarray(next_value),
        jnp.asarray(terminated, jnp.float32),
        jnp.asarray(terminated | truncated),
        jnp.float32(gamma),
        jnp.float32(lam),
    )
    return np.asarray(advantage, np.float64), np.asarray(target, np.float64)


@pytest.mark.parametrize("gamma, lam", [(0.99, 0.95), (0.9, 1.0), (1.0, 0.0), (0.5, 0.7)])
@pytest.mark.parametrize("seed", [0, 1])
def test_gae_matches_reference(ppo, gamma, lam, seed):
    reward, value, next_value = trajectory(seed)
    advantage, target = call_gae(ppo, reward, value, next_value, TERMINATED, TRUNCATED, gamma, lam)
    want_advantage, want_target = reference_gae(
        reward.astype(np.float64),
        value.astype(np.float64),
        next_value.astype(np.float64),
        TERMINATED,
        TRUNCATED,
        gamma,
        lam,
    )
    assert advantage.shape == target.shape == reward.shape
    np.testing.assert_allclose(advantage, want_advantage, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(target, want_target, rtol=1e-5, atol=1e-5)


def test_gae_accepts_bool_terminated(ppo):
    reward, value, next_value = trajectory(3)
    advantage, _ = ppo.compute_gae(
        reward, value, next_value, jnp.asarray(TERMINATED), jnp.asarray(TERMINATED | TRUNCATED), 0.99, 0.95
    )
    want, _ = reference_gae(reward, value, next_value, TERMINATED, TRUNCATED, 0.99, 0.95)
    np.testing.assert_allclose(np.asarray(advantage), want, rtol=1e-5, atol=1e-5)


def test_gae_hand_computed_single_env(ppo):
    """A 3-step case small enough to check by hand, independent of the reference loop."""
    gamma, lam = 0.5, 0.5
    reward = np.array([[1.0], [2.0], [4.0]], np.float32)
    value = np.array([[0.0], [1.0], [0.0]], np.float32)
    next_value = np.array([[8.0], [16.0], [32.0]], np.float32)
    truncated = np.array([[False], [True], [False]])  # episode 1 cut off at t=1
    terminated = np.array([[False], [False], [True]])  # episode 2 terminates at t=2
    advantage, target = call_gae(ppo, reward, value, next_value, terminated, truncated, gamma, lam)
    # t=2: terminal, no bootstrap: 4 - 0 = 4
    # t=1: truncation bootstraps but stops the recursion: 2 + 0.5*16 - 1 = 9
    # t=0: 1 + 0.5*8 - 0 + 0.25*9 = 7.25
    np.testing.assert_allclose(advantage[:, 0], [7.25, 9.0, 4.0], rtol=1e-6)
    np.testing.assert_allclose(target[:, 0], [7.25, 10.0, 4.0], rtol=1e-6)


def test_next_value_matters_at_truncation_not_at_termination(ppo):
    gamma, lam = 0.9, 0.8
    reward, value, next_value = trajectory(4)
    check_bootstrap_at_truncation_only(
        lambda next_value: call_gae(ppo, reward, value, next_value, TERMINATED, TRUNCATED, gamma, lam)[0],
        next_value,
        gamma,
        lam,
    )


def test_done_stops_the_recursion(ppo):
    """Rewards after an episode boundary (termination or truncation) do not leak backwards."""
    gamma, lam = 0.99, 0.95
    reward, value, next_value = trajectory(5)
    base, _ = call_gae(ppo, reward, value, next_value, TERMINATED, TRUNCATED, gamma, lam)
    for t, n in [(3, 1), (2, 2), (4, 3)]:  # first steps of a new episode
        assert (TERMINATED | TRUNCATED)[t - 1, n]
        bumped = reward.copy()
        bumped[t, n] += 5.0
        changed, _ = call_gae(ppo, bumped, value, next_value, TERMINATED, TRUNCATED, gamma, lam)
        np.testing.assert_array_equal(changed[:t, n], base[:t, n])
        assert changed[t, n] == pytest.approx(base[t, n] + 5.0, rel=1e-5)
    # ...while without a boundary they do.
    bumped = reward.copy()
    bumped[5, 0] += 5.0
    changed, _ = call_gae(ppo, bumped, value, next_value, TERMINATED, TRUNCATED, gamma, lam)
    assert changed[0, 0] == pytest.approx(base[0, 0] + 5.0 * (gamma * lam) ** 5, rel=1e-5)
