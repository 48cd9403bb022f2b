"""VecEnv, the vectorised gymnax wrapper every file has: auto-reset from presampled resets,
terminations, truncation at the time limit with the true final observation, envs that override
gymnax's step, and the reserved fresh episodes of envs whose reset costs more than a step."""

import jax
import jax.numpy as jnp
import numpy as np


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
        keys, jax.tree.map(flat, state_in), flat(np.asarray(actions)), params
    )
    np.testing.assert_allclose(flat(steps.final_obs), info["final_observation"], rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(flat(steps.reward), reward)
    np.testing.assert_array_equal(flat(steps.terminated), terminated)
    np.testing.assert_array_equal(flat(steps.truncated), truncated)


def reserved_vecenv(ppo, monkeypatch, num_envs: int, envs_per_reset: int, limit: int):
    """CartPole's VecEnv as for an env whose reset costs more than a step (as the run harness's suites
    declare): each env holds a fresh episode in reserve; episodes end at `limit` steps."""
    monkeypatch.setattr(type(ppo.VecEnv("CartPole-v1", 1).env), "envs_per_reset", envs_per_reset, raising=False)
    venv = ppo.VecEnv("CartPole-v1", num_envs)
    venv.params = venv.params.replace(max_steps_in_episode=limit)
    return venv


def reserve_reference(venv, first_reserve, steps, noise):
    """What each step's observations must be, by a plain loop: an env that finished starts its reserve;
    then, at the steps that drew them, this step's fresh episodes replace the next reserves in turn."""
    reserve, redrawn, want = np.array(first_reserve), 0, []
    done = steps.terminated | steps.truncated
    for t in range(len(done)):
        want.append(np.where(done[t][:, None], reserve, steps.final_obs[t]))
        if noise.new[t]:
            for i in range(venv.num_resets):
                reserve[(redrawn + i) % venv.num_envs] = noise.reset_obs[t, i]
            redrawn += venv.num_resets
    return np.stack(want)


def test_envs_that_finish_together_start_distinct_episodes(ppo, monkeypatch):
    """Every env truncates at the same step (a time limit and no termination, as on a Brax task): each
    starts its own reserved fresh episode, so they all differ, and so do the next ones."""
    num_envs, num_steps, limit = 6, 6, 2
    venv = reserved_vecenv(ppo, monkeypatch, num_envs, envs_per_reset=3, limit=limit)
    assert venv.reserve and (venv.num_resets, venv.reset_every) == (2, 1)
    actions = jnp.broadcast_to((jnp.arange(num_steps) % 2)[:, None], (num_steps, num_envs))
    obs_in, state_in, steps, noise = rollout(venv, jax.random.PRNGKey(4), actions, num_steps)
    assert noise.reset_obs.shape == (num_steps, 2, venv.obs_dim)
    done = steps.terminated | steps.truncated
    assert done[1::2].all() and not done[::2].any()  # every env at the limit together
    for t in (1, 3, 5):
        assert len({tuple(obs) for obs in steps.obs[t]}) == num_envs, f"envs share a fresh episode at step {t}"
    np.testing.assert_array_equal(steps.obs, reserve_reference(venv, state_in.obs[0], steps, noise))
    np.testing.assert_array_equal(steps.state.env.time[done], 0)


def test_reserves_are_redrawn_one_every_few_steps_with_fewer_envs_than_envs_per_reset(ppo, monkeypatch):
    """One fresh episode per envs_per_reset env steps: with 4 envs and 12 per reset, one every 3
    steps, which replaces one reserve; the step keys stay one per env and step."""
    num_envs, num_steps = 4, 9
    venv = reserved_vecenv(ppo, monkeypatch, num_envs, envs_per_reset=12, limit=2)
    assert (venv.num_resets, venv.reset_every) == (1, 3)
    actions = jnp.broadcast_to((jnp.arange(num_steps) % 2)[:, None], (num_steps, num_envs))
    obs_in, state_in, steps, noise = rollout(venv, jax.random.PRNGKey(7), actions, num_steps)
    np.testing.assert_array_equal(noise.new, np.arange(num_steps) % 3 == 0)
    np.testing.assert_array_equal(steps.obs, reserve_reference(venv, state_in.obs[0], steps, noise))
    np.testing.assert_array_equal(steps.state.redrawn, np.arange(num_steps) // 3 + 1)  # after each step
    noise_key = jax.random.split(jax.random.PRNGKey(7))[1]  # as rollout() draws it
    plain = jax.device_get(ppo.VecEnv("CartPole-v1", num_envs).presample(noise_key, num_steps))
    np.testing.assert_array_equal(noise.key, plain.key)


def test_envs_declare_a_costly_reset_with_envs_per_reset(ppo, monkeypatch):
    """Without `envs_per_reset`, every env gets its own fresh episode at every step (gymnax's envs);
    with it, one per envs_per_reset env steps, into reserves."""
    venv = ppo.VecEnv("CartPole-v1", 16)
    assert (venv.num_resets, venv.reset_every, venv.reserve) == (16, 1, False)
    monkeypatch.setattr(type(venv.env), "envs_per_reset", 256, raising=False)
    for num_envs, num_resets, reset_every in [(16, 1, 16), (64, 1, 4), (300, 2, 1), (1024, 4, 1)]:
        venv = ppo.VecEnv("CartPole-v1", num_envs)
        assert (venv.num_resets, venv.reset_every, venv.reserve) == (num_resets, reset_every, True), num_envs


def test_vecenv_without_resets_keeps_ended_episodes_where_they_ended(ppo):
    """presample(resets=False), as evaluation steps: no fresh episode is drawn or started; the
    transitions (and the step keys) are those of the auto-resetting rollout with the same key."""
    num_envs, num_steps = 4, 20
    venv = ppo.VecEnv("CartPole-v1", num_envs)
    actions = jnp.zeros((num_steps, num_envs), jnp.int32)  # constant push: poles fall within ~10 steps
    obs, state = venv.reset(jax.random.PRNGKey(5))
    noise = venv.presample(jax.random.PRNGKey(6), num_steps, resets=False)
    with_resets = venv.presample(jax.random.PRNGKey(6), num_steps)
    assert noise.reset_obs is None and noise.reset_state is None
    np.testing.assert_array_equal(noise.key, with_resets.key)
    step = venv.step(jax.tree.map(lambda x: x[0], noise), state, actions[0])
    for t in range(1, num_steps):
        previous = step
        step = venv.step(jax.tree.map(lambda x, t=t: x[t], noise), step.state, actions[t])
        np.testing.assert_array_equal(step.obs, step.final_obs)  # never a fresh start
        np.testing.assert_array_equal(step.state.time, previous.state.time + 1)
    assert step.terminated.all()
