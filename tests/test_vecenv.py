"""VecEnv, the vectorised gymnax env every file has (gymnax's own auto-resetting `step` under vmap):
terminations, truncation at the time limit with the true final observation, envs that override
gymnax's step; and the run harness's pooled resets (onefile_harness/suites.py) for envs whose reset
costs more than a step, which reach make_train through its `env` argument."""

import jax
import jax.numpy as jnp
import numpy as np

from onefile_harness import suites


def rollout(venv, key, actions):
    """Steps `venv` with per-step `actions` [num_steps, num_envs]; returns the states and observations
    each step started from, and the steps."""
    reset_key, step_key = jax.random.split(key)
    obs, state = venv.reset(reset_key)

    def body(carry, xs):
        obs, state = carry
        key, action = xs
        step = venv.step(key, state, action)
        return (step.obs, step.state), (obs, state, step)

    keys = jax.random.split(step_key, len(actions))
    _, (obs_in, state_in, steps) = jax.lax.scan(body, (obs, state), (keys, actions))
    return jax.device_get((obs_in, state_in, steps))


def test_vecenv_cartpole_terminations(ppo):
    num_envs, num_steps = 8, 40
    venv = ppo.VecEnv("CartPole-v1", num_envs)
    assert venv.max_episode_steps == 500
    # Constant push: left in half the envs, right in the rest; every pole falls within ~10 steps.
    actions = jnp.broadcast_to(jnp.arange(num_envs) % 2, (num_steps, num_envs))
    obs_in, state_in, steps = rollout(venv, jax.random.PRNGKey(0), actions)
    terminated, truncated = steps.terminated, steps.truncated
    done = terminated | truncated
    assert terminated.any(axis=0).all(), "every env should have fallen at least once"
    assert not truncated.any(), "no episode is near 500 steps"
    check_auto_reset(venv, state_in, steps, actions)
    # A terminal final observation is out of bounds; a continuing one is not.
    params = venv.params
    x, theta = steps.final_obs[..., 0], steps.final_obs[..., 2]
    out = (np.abs(x) > params.x_threshold) | (np.abs(theta) > params.theta_threshold_radians)
    np.testing.assert_array_equal(out, terminated)
    np.testing.assert_array_equal(steps.state.time, np.where(done, 0, state_in.time + 1))


def test_vecenv_truncation_at_max_steps(ppo):
    num_envs, num_steps, limit = 4, 12, 5
    venv = ppo.VecEnv("CartPole-v1", num_envs)
    venv.params = venv.params.replace(max_steps_in_episode=limit)
    # Alternating pushes keep the pole up: only the time limit ends episodes.
    actions = jnp.broadcast_to((jnp.arange(num_steps) % 2)[:, None], (num_steps, num_envs))
    obs_in, state_in, steps = rollout(venv, jax.random.PRNGKey(1), actions)
    assert not steps.terminated.any()
    want = ((np.arange(num_steps) + 1) % limit == 0)[:, None].repeat(num_envs, 1)
    np.testing.assert_array_equal(steps.truncated, want)
    check_auto_reset(venv, state_in, steps, actions)


def test_vecenv_non_stock_step_env(ppo):
    """DeepSea overrides gymnax's `step`; VecEnv takes the same bookkeeping from it."""
    num_envs, num_steps = 4, 30
    venv = ppo.VecEnv("DeepSea-bsuite", num_envs)
    actions = jax.random.randint(jax.random.PRNGKey(2), (num_steps, num_envs), 0, venv.num_actions)
    _, _, steps = rollout(venv, jax.random.PRNGKey(3), actions)
    done = steps.terminated | steps.truncated
    assert done.any()
    assert steps.obs.shape == steps.final_obs.shape == (num_steps, num_envs, *venv.obs_shape)
    assert steps.obs.dtype == np.float32
    np.testing.assert_array_equal(steps.obs[~done], steps.final_obs[~done])
    assert (steps.obs[done] != steps.final_obs[done]).reshape(done.sum(), -1).any(-1).all()  # [8, 8] grids


def check_auto_reset(venv, state_in, steps, actions):
    """final_obs differs from obs exactly where the episode ended, where the state starts afresh;
    observations are the flat float32 view of their state; and the transition equals gymnax's
    own `step` from the same state and action."""
    done = steps.terminated | steps.truncated
    assert done.any()
    np.testing.assert_array_equal((steps.obs != steps.final_obs).any(axis=-1), done)
    np.testing.assert_array_equal(steps.state.time[done], 0)
    assert steps.obs.dtype == steps.final_obs.dtype == np.float32
    state_obs = np.stack([steps.state.x, steps.state.x_dot, steps.state.theta, steps.state.theta_dot], -1)
    np.testing.assert_array_equal(steps.obs, state_obs.astype(np.float32))
    env, params = venv.env, venv.params
    flat = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731
    keys = jax.random.split(jax.random.PRNGKey(99), done.size)
    _, _, reward, terminated, truncated, info = jax.vmap(env.step, in_axes=(0, 0, 0, None))(
        keys, jax.tree.map(flat, state_in), flat(np.asarray(actions)), params
    )
    np.testing.assert_allclose(flat(steps.final_obs), info["final_observation"], rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(flat(steps.reward), reward)
    np.testing.assert_array_equal(flat(steps.terminated), terminated)
    np.testing.assert_array_equal(flat(steps.truncated), truncated)


def pooled_vecenv(ppo, monkeypatch, num_envs: int, envs_per_reset: int, limit: int):
    """CartPole as for an env whose reset costs more than a step (as the run harness's suites declare):
    the harness's pooled env, each env holding a fresh episode in reserve; episodes end at `limit`."""
    monkeypatch.setattr(type(ppo.VecEnv("CartPole-v1", 1).env), "envs_per_reset", envs_per_reset, raising=False)
    venv = suites.vec_env(ppo, "CartPole-v1", num_envs)
    venv.vec.params = venv.vec.params.replace(max_steps_in_episode=limit)
    return venv


def test_envs_that_finish_together_start_distinct_episodes(ppo, monkeypatch):
    """Every env truncates at the same step (a time limit and no termination, as on a Brax task): each
    starts its own reserved fresh episode, so they all differ, and so do the next ones; the reserves
    are those a plain loop gives: an env that finished starts its reserve, then this step's fresh
    episodes replace the next `num_resets` reserves in turn."""
    num_envs, num_steps, limit = 6, 6, 2
    venv = pooled_vecenv(ppo, monkeypatch, num_envs, envs_per_reset=3, limit=limit)
    assert isinstance(venv, suites.PooledResets) and venv.num_resets == 2
    actions = jnp.broadcast_to((jnp.arange(num_steps) % 2)[:, None], (num_steps, num_envs))
    _, state_in, steps = rollout(venv, jax.random.PRNGKey(4), actions)
    done = steps.terminated | steps.truncated
    assert done[1::2].all() and not done[::2].any()  # every env at the limit together
    for t in (1, 3, 5):
        assert len({tuple(obs) for obs in steps.obs[t]}) == num_envs, f"envs share a fresh episode at step {t}"
    reserve = np.array(state_in.obs[0])
    for t in range(num_steps):
        np.testing.assert_array_equal(steps.obs[t], np.where(done[t][:, None], reserve, steps.final_obs[t]))
        slots = (2 * t + np.arange(2)) % num_envs
        np.testing.assert_array_equal(np.delete(steps.state.obs[t], slots, 0), np.delete(reserve, slots, 0))
        reserve = np.array(steps.state.obs[t])
    np.testing.assert_array_equal(steps.state.env.time[done], 0)
    np.testing.assert_array_equal(steps.state.redrawn, 2 * np.arange(1, num_steps + 1))


def test_envs_declare_a_costly_reset_with_envs_per_reset(ppo, monkeypatch):
    """Without `envs_per_reset` a run steps the file's own VecEnv (gymnax's auto-reset); with it, the
    pooled env redraws one reserve per envs_per_reset envs at every step, at least one."""
    assert type(suites.vec_env(ppo, "CartPole-v1", 16)) is ppo.VecEnv
    monkeypatch.setattr(type(ppo.VecEnv("CartPole-v1", 1).env), "envs_per_reset", 256, raising=False)
    for num_envs, num_resets in [(16, 1), (64, 1), (300, 2), (1024, 4)]:
        assert suites.vec_env(ppo, "CartPole-v1", num_envs).num_resets == num_resets, num_envs


def test_a_pooled_env_trains_through_make_train(ppo, monkeypatch):
    """make_train and make_evaluate take the harness's env through their `env` argument."""
    venv = pooled_vecenv(ppo, monkeypatch, 4, envs_per_reset=8, limit=20)
    config = ppo.Config(num_envs=4, num_steps=8, total_timesteps=64, num_minibatches=2, update_epochs=1)
    runner, metrics = jax.jit(ppo.make_train(config, venv))(jax.random.PRNGKey(0))
    assert isinstance(runner.episodes.env_state, suites.Reserved) and metrics["finite"].all()
    assert (metrics["episodes_finished"] > 0).any()
    greedy = jax.jit(ppo.make_evaluate(config, pooled_vecenv(ppo, monkeypatch, 3, 8, 20)))
    assert 1 <= float(greedy(runner.params, jax.random.PRNGKey(1))) <= 20
