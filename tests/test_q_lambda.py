"""PQN's Q(lambda) returns against independent NumPy references, and its epsilon schedule."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TERMINATED, TRUNCATED, check_bootstrap_at_truncation_only, load_algorithm


@pytest.fixture(scope="module")
def pqn():
    return load_algorithm("pqn")


def reference_backward(reward, next_q, terminated, truncated, gamma, lam):
    """The recursion as the paper writes it, a plain double loop in float64.

    G_t = r_t + gamma (1 - terminated_t) [lam G_{t+1} + (1 - lam) next_q_t], where G_{t+1} is
    replaced by next_q_t when the episode ended at t (terminated or truncated) or t = T - 1.
    """
    T, N = reward.shape
    done = terminated | truncated
    returns = np.zeros((T, N))
    for n in range(N):
        for t in reversed(range(T)):
            later = next_q[t, n] if done[t, n] or t == T - 1 else returns[t + 1, n]
            returns[t, n] = reward[t, n] + gamma * (1.0 - terminated[t, n]) * (lam * later + (1.0 - lam) * next_q[t, n])
    return returns


def n_step_return(reward, next_q, terminated, t, n, k, gamma):
    """sum_{i<k} gamma^i r_{t+i} + gamma^k (1 - terminated) max_a Q at step t+k-1 of env n."""
    rewards = sum(gamma**i * reward[t + i, n] for i in range(k))
    last = t + k - 1
    return rewards + gamma**k * (1.0 - terminated[last, n]) * next_q[last, n]


def reference_forward(reward, next_q, terminated, truncated, gamma, lam):
    """The forward view: a lambda-weighted mix of n-step returns, no recursion.

    From step t, K steps remain of the episode inside the rollout (up to and including the
    step where it ends, or the rollout's last step). G_t = (1 - lam) sum_{k<K} lam^(k-1) G^(k)
    + lam^(K-1) G^(K); the longest return takes all the remaining weight.
    """
    T, N = reward.shape
    done = terminated | truncated
    returns = np.zeros((T, N))
    for n in range(N):
        for t in range(T):
            end = t
            while end < T - 1 and not done[end, n]:
                end += 1
            K = end - t + 1
            g = sum(
                (1.0 - lam) * lam ** (k - 1) * n_step_return(reward, next_q, terminated, t, n, k, gamma)
                for k in range(1, K)
            )
            returns[t, n] = g + lam ** (K - 1) * n_step_return(reward, next_q, terminated, t, n, K, gamma)
    return returns


# TERMINATED, TRUNCATED: the [T=6, N=5] episode-boundary patterns shared with every return test.


def trajectory(seed):
    rng = np.random.default_rng(seed)
    shape = TERMINATED.shape
    return (
        rng.normal(size=shape).astype(np.float32),  # reward
        rng.normal(size=shape).astype(np.float32),
    )  # next_q: max_a Q(final obs)


_compiled = {}


def call_q_lambda(pqn, reward, next_q, terminated, truncated, gamma, lam):
    """Inputs typed the way pqn's update passes them: float terminated, bool done."""
    if "fn" not in _compiled:
        _compiled["fn"] = jax.jit(pqn.compute_q_lambda)
    returns = _compiled["fn"](
        jnp.asarray(reward),
        jnp.asarray(next_q),
        jnp.asarray(terminated, jnp.float32),
        jnp.asarray(terminated | truncated),
        jnp.float32(gamma),
        jnp.float32(lam),
    )
    return np.asarray(returns, np.float64)


def test_references_agree():
    """The two references are different formulas; they must agree before either is trusted."""
    for seed in range(3):
        reward, next_q = (x.astype(np.float64) for x in trajectory(seed))
        for gamma, lam in [(0.99, 0.65), (0.5, 0.3), (1.0, 1.0), (0.9, 0.0)]:
            np.testing.assert_allclose(
                reference_backward(reward, next_q, TERMINATED, TRUNCATED, gamma, lam),
                reference_forward(reward, next_q, TERMINATED, TRUNCATED, gamma, lam),
                rtol=1e-10,
                atol=1e-10,
            )


@pytest.mark.parametrize("gamma, lam", [(0.99, 0.65), (0.9, 1.0), (1.0, 0.0), (0.5, 0.7), (0.99, 0.95)])
@pytest.mark.parametrize("seed", [0, 1])
def test_q_lambda_matches_reference(pqn, gamma, lam, seed):
    reward, next_q = trajectory(seed)
    returns = call_q_lambda(pqn, reward, next_q, TERMINATED, TRUNCATED, gamma, lam)
    assert returns.shape == reward.shape
    want = reference_forward(reward.astype(np.float64), next_q.astype(np.float64), TERMINATED, TRUNCATED, gamma, lam)
    np.testing.assert_allclose(returns, want, rtol=1e-5, atol=1e-5)


def test_lambda_0_is_one_step_q_learning(pqn):
    reward, next_q = trajectory(2)
    gamma = 0.97
    returns = call_q_lambda(pqn, reward, next_q, TERMINATED, TRUNCATED, gamma, 0.0)
    np.testing.assert_allclose(returns, reward + gamma * (1.0 - TERMINATED) * next_q, rtol=1e-6, atol=1e-6)


def test_lambda_1_is_monte_carlo_with_bootstrap(pqn):
    """Discounted rewards to the episode's end, plus next_q there unless it terminated; an
    episode still running at the rollout's end bootstraps from its last next_q."""
    reward, next_q = trajectory(3)
    gamma = 0.9
    returns = call_q_lambda(pqn, reward, next_q, TERMINATED, TRUNCATED, gamma, 1.0)
    T, N = reward.shape
    done = TERMINATED | TRUNCATED
    for n in range(N):
        for t in range(T):
            end = next((s for s in range(t, T) if done[s, n]), T - 1)
            want = sum(gamma ** (s - t) * reward[s, n] for s in range(t, end + 1))
            want += gamma ** (end - t + 1) * (not TERMINATED[end, n]) * next_q[end, n]
            assert returns[t, n] == pytest.approx(want, rel=1e-5, abs=1e-5), (t, n)


def test_hand_computed_single_env(pqn):
    """A 3-step case small enough to check by hand, independent of the reference loops."""
    gamma, lam = 0.5, 0.5
    reward = np.array([[1.0], [2.0], [4.0]], np.float32)
    next_q = np.array([[8.0], [16.0], [32.0]], np.float32)
    truncated = np.array([[False], [True], [False]])  # episode 1 cut off at t=1
    terminated = np.array([[False], [False], [True]])  # episode 2 terminates at t=2
    returns = call_q_lambda(pqn, reward, next_q, terminated, truncated, gamma, lam)
    # t=2: terminal, no bootstrap: 4
    # t=1: truncation bootstraps fully from Q(final obs): 2 + 0.5 * 16 = 10
    # t=0: 1 + 0.5 * (0.5 * G_1 + 0.5 * 8) = 1 + 0.5 * 9 = 5.5
    np.testing.assert_allclose(returns[:, 0], [5.5, 10.0, 4.0], rtol=1e-6)


def test_last_step_bootstraps_from_its_own_final_obs(pqn):
    """No boundary anywhere: the last step's return is r + gamma * next_q[T-1] for every lambda."""
    reward, next_q = trajectory(4)
    none = np.zeros_like(TERMINATED)
    for lam in (0.0, 0.65, 1.0):
        returns = call_q_lambda(pqn, reward, next_q, none, none, 0.9, lam)
        np.testing.assert_allclose(returns[-1], reward[-1] + 0.9 * next_q[-1], rtol=1e-6)


def test_final_obs_q_matters_at_truncation_not_at_termination(pqn):
    """At a truncation Q of the final observation is bootstrapped with full weight (the episode's
    return cannot continue past it); where the episode terminated it is irrelevant."""
    gamma, lam = 0.9, 0.8
    reward, next_q = trajectory(5)
    check_bootstrap_at_truncation_only(
        lambda next_q: call_q_lambda(pqn, reward, next_q, TERMINATED, TRUNCATED, gamma, lam), next_q, gamma, lam
    )


def test_episode_end_stops_the_recursion(pqn):
    """Rewards after an episode boundary (termination or truncation) do not leak backwards."""
    gamma, lam = 0.99, 0.95
    reward, next_q = trajectory(6)
    base = call_q_lambda(pqn, reward, next_q, TERMINATED, TRUNCATED, gamma, lam)
    for t, n in [(3, 1), (2, 2), (4, 3), (3, 4), (4, 4)]:  # first steps of a new episode
        assert (TERMINATED | TRUNCATED)[t - 1, n]
        bumped = reward.copy()
        bumped[t, n] += 5.0
        changed = call_q_lambda(pqn, bumped, next_q, TERMINATED, TRUNCATED, gamma, lam)
        np.testing.assert_array_equal(changed[:t, n], base[:t, n])
        assert changed[t, n] == pytest.approx(base[t, n] + 5.0, rel=1e-5)
    # ...while without a boundary they do, discounted by gamma * lambda per step.
    bumped = reward.copy()
    bumped[5, 0] += 5.0
    changed = call_q_lambda(pqn, bumped, next_q, TERMINATED, TRUNCATED, gamma, lam)
    assert changed[0, 0] == pytest.approx(base[0, 0] + 5.0 * (gamma * lam) ** 5, rel=1e-5)


@pytest.mark.parametrize("start, end, decay", [(1.0, 0.05, 0.2), (0.5, 0.1, 1.0), (1.0, 0.0, 0.0), (0.3, 0.3, 0.5)])
def test_epsilon_schedule_is_linear_then_flat(pqn, start, end, decay):
    num_updates = 50
    config = pqn.Config(total_timesteps=num_updates * pqn.Config().steps_per_update)
    hp = pqn.hparams_from(config)._replace(eps_start=start, eps_end=end, eps_fraction=decay)
    got = np.asarray(jax.vmap(lambda u: pqn.epsilon(config, hp, u))(jnp.arange(num_updates)))
    decay_updates = decay * num_updates
    want = [
        end if decay_updates == 0 else start + (end - start) * min(1.0, u / decay_updates) for u in range(num_updates)
    ]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    if decay_updates <= num_updates - 1:  # eps_end is reached within training, and stays
        np.testing.assert_allclose(got[int(math.ceil(decay_updates)) :], end, rtol=1e-6)
