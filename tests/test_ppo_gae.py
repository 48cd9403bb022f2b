"""GAE against an independent NumPy reference, and VecEnv's auto-reset bookkeeping."""
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
    return (rng.normal(size=shape).astype(np.float32),   # reward
            rng.normal(size=shape).astype(np.float32),   # value
            rng.normal(size=shape).astype(np.float32))   # next_value


def call_gae(ppo, reward, value, next_value, terminated, truncated, gamma, lam):
    """Inputs typed the way ppo's update passes them: float terminated, bool done."""
    advantage, target = jax.jit(ppo.compute_gae)(
        jnp.asarray(reward), jnp.asarray(value), jnp.asarray(next_value),
        jnp.asarray(terminated, jnp.float32), jnp.asarray(terminated | truncated),
        jnp.float32(gamma), jnp.float32(lam))
    return np.asarray(advantage, np.float64), np.asarray(target, np.float64)


@pytest.mark.parametrize("gamma, lam", [(0.99, 0.95), (0.9, 1.0), (1.0, 0.0), (0.5, 0.7)])
@pytest.mark.parametrize("seed", [0, 1])
def test_gae_matches_reference(ppo, gamma, lam, seed):
    reward, value, next_value = trajectory(seed)
    advantage, target = call_gae(ppo, reward, value, next_value, TERMINATED, TRUNCATED, gamma, lam)
    want_advantage, want_target = reference_gae(reward.astype(np.float64), value.astype(np.float64),
                                                next_value.astype(np.float64), TERMINATED, TRUNCATED,
                                                gamma, lam)
    assert advantage.shape == target.shape == reward.shape
    np.testing.assert_allclose(advantage, want_advantage, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(target, want_target, rtol=1e-5, atol=1e-5)


def test_gae_accepts_bool_terminated(ppo):
    reward, value, next_value = trajectory(3)
    advantage, _ = ppo.compute_gae(reward, value, next_value, jnp.asarray(TERMINATED),
                                   jnp.asarray(TERMINATED | TRUNCATED), 0.99, 0.95)
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
        next_value, gamma, lam)


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


# --------------------------------------------------------------------------------------
# VecEnv auto-reset
# --------------------------------------------------------------------------------------
def rollout(venv, key, actions, num_steps):
    """Steps `venv` with per-step `actions` [num_steps, num_envs]; returns inputs and outputs."""
    reset_key, noise_key = jax.random.split(key)
    obs, state = venv.reset(reset_key)
    noise = venv.presample(noise_key, num_steps)

    def body(carry, xs):
        obs, state = carry
        step_noise, action = xs
        step = venv.step(step_noise, state, action)
        return (step.obs, step.state), (obs, state, step)

    _, (obs_in, state_in, steps) = jax.lax.scan(body, (obs, state), (noise, actions))
    return jax.device_get((obs_in, state_in, steps, noise))


def test_vecenv_cartpole_terminations(ppo):
    num_envs, num_steps = 8, 40
    venv = ppo.VecEnv("CartPole-v1", num_envs)
    assert venv.stock_step and venv.max_episode_steps == 500
    # Constant push: left in half the envs, right in the rest; every pole falls within ~10 steps.
    actions = jnp.broadcast_to(jnp.arange(num_envs) % 2, (num_steps, num_envs))
    obs_in, state_in, steps, noise = rollout(venv, jax.random.PRNGKey(0), actions, num_steps)

    terminated, truncated = steps.terminated, steps.truncated
    done = terminated | truncated
    assert terminated.any(axis=0).all(), "every env should have fallen at least once"
    assert not truncated.any(), "no episode is near 500 steps"
    check_auto_reset(venv, obs_in, state_in, steps, noise, actions)

    # A terminal final observation is out of bounds; a continuing one is not.
    params = venv.params
    x, theta = steps.final_obs[..., 0], steps.final_obs[..., 2]
    out = (np.abs(x) > params.x_threshold) | (np.abs(theta) > params.theta_threshold_radians)
    np.testing.assert_array_equal(out, terminated)
    # Episode clock: reset to 0 where done, otherwise one more than before.
    np.testing.assert_array_equal(steps.state.time, np.where(done, 0, state_in.time + 1))


def test_vecenv_truncation_at_max_steps(ppo):
    num_envs, num_steps, limit = 4, 12, 5
    venv = ppo.VecEnv("CartPole-v1", num_envs)
    venv.params = venv.params.replace(max_steps_in_episode=limit)
    # Alternating pushes keep the pole up: only the time limit ends episodes.
    actions = jnp.broadcast_to((jnp.arange(num_steps) % 2)[:, None], (num_steps, num_envs))
    obs_in, state_in, steps, noise = rollout(venv, jax.random.PRNGKey(1), actions, num_steps)

    assert not steps.terminated.any()
    want = ((np.arange(num_steps) + 1) % limit == 0)[:, None].repeat(num_envs, 1)
    np.testing.assert_array_equal(steps.truncated, want)
    check_auto_reset(venv, obs_in, state_in, steps, noise, actions)


def test_vecenv_non_stock_step_env(ppo):
    """DeepSea overrides gymnax's `step`; VecEnv must take the same bookkeeping from it."""
    num_envs, num_steps = 4, 30
    venv = ppo.VecEnv("DeepSea-bsuite", num_envs)
    assert not venv.stock_step
    actions = jax.random.randint(jax.random.PRNGKey(2), (num_steps, num_envs), 0, venv.num_actions)
    obs_in, state_in, steps, noise = rollout(venv, jax.random.PRNGKey(3), actions, num_steps)
    done = steps.terminated | steps.truncated
    assert done.any()
    assert steps.obs.shape == steps.final_obs.shape == (num_steps, num_envs, venv.obs_dim)
    assert steps.obs.dtype == np.float32
    np.testing.assert_array_equal(steps.obs[~done], steps.final_obs[~done])
    assert (steps.obs[done] != steps.final_obs[done]).any(axis=-1).all()


def check_auto_reset(venv, obs_in, state_in, steps, noise, actions):
    done = steps.terminated | steps.truncated
    assert done.any()
    # final_obs differs from obs exactly where the episode ended...
    differs = (steps.obs != steps.final_obs).any(axis=-1)
    np.testing.assert_array_equal(differs, done)
    # ...where obs is the presampled fresh start, and the state went with it.
    np.testing.assert_array_equal(steps.obs[done], noise.reset_obs[done])
    np.testing.assert_array_equal(steps.state.time[done], 0)
    # Observations are the flattened float32 view of the state they come with.
    assert steps.obs.dtype == steps.final_obs.dtype == np.float32
    state_obs = np.stack([steps.state.x, steps.state.x_dot, steps.state.theta, steps.state.theta_dot], -1)
    np.testing.assert_array_equal(steps.obs, state_obs.astype(np.float32))

    # Against gymnax's own auto-resetting `step` from the same state and action: the transition
    # (final observation, reward, flags) must agree; only the fresh start's randomness differs.
    env, params = venv.env, venv.params
    flat = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731
    keys = jax.random.split(jax.random.PRNGKey(99), done.size)
    _, _, reward, terminated, truncated, info = jax.vmap(env.step, in_axes=(0, 0, 0, None))(
        keys, jax.tree.map(flat, state_in), flat(np.asarray(actions)), params)
    np.testing.assert_allclose(flat(steps.final_obs), info["final_observation"], rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(flat(steps.reward), reward)
    np.testing.assert_array_equal(flat(steps.terminated), terminated)
    np.testing.assert_array_equal(flat(steps.truncated), truncated)
