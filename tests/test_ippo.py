"""ippo.py and mappo.py: GAE per agent against NumPy on hand-made trajectories; JaxMARL's env through the files'
VecEnv (MPE's time limit a truncation, with JaxMARL's own final observations and rewards); mappo.py's global state
against NumPy; and, trained end to end, a never-ending env cut by a time limit, whose every agent's value is
1 / (1 - gamma), not what a termination there would teach."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_gae import reference_gae

from conftest import TERMINATED, TRUNCATED, load_algorithm

AGENTS = 3


@pytest.fixture(scope="module")
def ippo():
    return load_algorithm("ippo")


def test_mappos_global_state_is_the_envs_own_or_every_observation_joined_and_the_agents_id():
    mappo, rng = load_algorithm("mappo"), np.random.default_rng(0)
    obs = rng.normal(size=(4, 5, AGENTS, 2, 3)).astype(np.float32)  # [T, N, A, *obs_shape]
    got = np.asarray(mappo.global_state(jnp.asarray(obs), (2, 3)))
    assert got.shape == (4, 5, AGENTS, AGENTS * 6 + AGENTS)
    for t, n, agent in np.ndindex(4, 5, AGENTS):
        want = np.concatenate([obs[t, n].reshape(-1), np.eye(AGENTS)[agent]])
        np.testing.assert_array_equal(got[t, n, agent], want)
    world = rng.normal(size=(4, 5, 7)).astype(np.float32)  # the env's own global state (SMAX's world_state)
    got = np.asarray(mappo.global_state(jnp.asarray(obs), (2, 3), jnp.asarray(world)))
    assert got.shape == (4, 5, AGENTS, 7 + AGENTS)
    for t, n, agent in np.ndindex(4, 5, AGENTS):
        np.testing.assert_array_equal(got[t, n, agent], np.concatenate([world[t, n], np.eye(AGENTS)[agent]]))


@pytest.mark.parametrize("gamma, lam", [(0.99, 0.95), (0.9, 1.0), (0.5, 0.7)])
def test_gae_per_agent_matches_numpy(ippo, gamma, lam):
    """[T, N, A] as ippo.py's rollout gives it: each agent's own rewards and values, its env's terminations and
    truncations (conftest's patterns, one env per column) for every agent of that env."""
    rng = np.random.default_rng(0)
    shape = (*TERMINATED.shape, AGENTS)
    reward, value, next_value = (rng.normal(size=shape).astype(np.float32) for _ in range(3))
    terminated, truncated = (np.broadcast_to(x[..., None], shape) for x in (TERMINATED, TRUNCATED))
    done = jnp.asarray(terminated | truncated)
    gae = jax.jit(ippo.compute_gae)(reward, value, next_value, jnp.asarray(terminated, jnp.float32), done, gamma, lam)
    for agent in range(AGENTS):
        want = reference_gae(*(x[..., agent] for x in (reward, value, next_value)), TERMINATED, TRUNCATED, gamma, lam)
        for got, expected in zip(gae, want, strict=True):
            np.testing.assert_allclose(np.asarray(got)[..., agent], expected, rtol=1e-5, atol=1e-5)


def test_mpe_time_limit_is_a_truncation_with_jaxmarls_own_final_observations(ippo):
    """MPE's episodes end after max_steps + 1 steps, at its time limit: truncated, never terminated; each step's
    final observations and rewards are JaxMARL's step_env's on the same state and key, and the next episode starts."""
    vec = ippo.VecEnv("MPE_simple_spread_v3", 2)
    agents, stack = vec.env.agents, lambda values: np.stack([values[agent] for agent in vec.env.agents], -1)

    def jaxmarl_step(key, state, action):  # the file's VecEnv splits each env's key as JaxMARL's own step does
        return vec.env.step_env(jax.random.split(key)[0], state, dict(zip(agents, action, strict=True)))

    obs, state = vec.reset(jax.random.PRNGKey(0))
    assert obs.shape == (2, AGENTS, 18) and vec.max_episode_steps == vec.env.max_steps + 1
    step = jax.jit(vec.step)
    for t, key in enumerate(jax.random.split(jax.random.PRNGKey(1), vec.max_episode_steps + 1)):
        action = jax.random.randint(jax.random.fold_in(key, 1), (2, AGENTS), 0, vec.num_actions)
        want_obs, _, want_reward, want_done, _ = jax.vmap(jaxmarl_step)(jax.random.split(key, 2), state, action)
        got = step(key, state, action)
        np.testing.assert_array_equal(got.final_obs, np.moveaxis(stack(want_obs), -1, 1))
        np.testing.assert_allclose(got.agent_reward, stack(want_reward), rtol=1e-6)
        np.testing.assert_allclose(got.reward, stack(want_reward).mean(-1), rtol=1e-6)
        ended = t == vec.max_episode_steps - 1
        assert (np.asarray(got.truncated) == ended).all() and not got.terminated.any(), t
        np.testing.assert_array_equal(want_done["__all__"], ended)
        assert (np.asarray(got.state.step) == (t + 1) % vec.max_episode_steps).all(), t  # 0: a new episode
        state = got.state


def never_ending(ippo, max_steps: int = 20):
    """A JaxMARL env that never terminates: both agents see the same constant observation and earn 1 per step,
    whatever they do; the episode is cut after `max_steps` + 1 steps by the time limit (MPE's convention)."""
    ippo.import_jaxmarl()
    from jaxmarl.environments import MultiAgentEnv, spaces
    from jaxmarl.environments.multi_agent_env import State

    class NeverEnding(MultiAgentEnv):
        def __init__(self):
            super().__init__(num_agents=2)
            self.max_steps = max_steps
            self.action_spaces = {agent: spaces.Discrete(2) for agent in self.agents}
            self.observation_spaces = {agent: spaces.Box(-1.0, 1.0, (3,)) for agent in self.agents}

        def reset(self, key):
            return {agent: jnp.ones(3) for agent in self.agents}, State(done=jnp.array(False), step=jnp.array(0))

        def step_env(self, key, state, actions):
            done = state.step >= self.max_steps
            dones = {agent: done for agent in [*self.agents, "__all__"]}
            obs, reward = self.reset(key)[0], {agent: jnp.float32(1.0) for agent in self.agents}
            return obs, State(done=done, step=state.step + 1), reward, dones, {}

    return NeverEnding()


@pytest.mark.parametrize("name", ["ippo", "mappo"])
def test_a_time_limit_is_bootstrapped_for_every_agent(name):
    """Trained on never_ending's env with gamma 0.9, every agent's value of its observation (mappo.py: of the global
    state) is 1 / (1 - 0.9) = 10 within 5%; a truncation taken for a termination would teach about 6 (the mean of the
    rest of an episode)."""
    module = load_algorithm(name)
    config = module.Config(gamma=0.9, lr=3e-3, num_envs=8, num_steps=16, total_timesteps=8 * 16 * 150, num_seeds=1)
    env = module.VecEnv("NeverEnding", config.num_envs, env=never_ending(module))
    runner, metrics = jax.jit(module.make_train(config, env))(jax.random.PRNGKey(0))
    assert bool(metrics["finite"].all()) and np.asarray(metrics["episode_length"])[-1] == 21
    obs = jnp.ones((2, 3))  # both agents' observation
    critic_input = module.global_state(obs, (3,)) if name == "mappo" else obs
    critic = module.make_networks(config, 2, (3,), *([2] if name == "mappo" else [])).critic
    np.testing.assert_allclose(critic.apply(runner.params["critic"], critic_input), 10.0, rtol=0.05)


def test_without_jaxmarl_the_file_says_what_to_install(ippo, tmp_path, monkeypatch, capsys):
    """Copied alone where jaxmarl is not installed: one line naming the package and its pip install, exit 2, nothing
    written."""
    monkeypatch.setitem(sys.modules, "jaxmarl", None)  # `import jaxmarl` raises ImportError
    assert ippo.main(["--runs-dir", str(tmp_path / "runs")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "needs jaxmarl" in err and "pip install jaxmarl" in err, err
    assert not (tmp_path / "runs").exists()
