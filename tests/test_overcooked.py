"""Overcooked in the multi-agent files (ippo.py, mappo.py, pqn_vdn.py): a layout is named overcooked-<layout>, and
--shaping-horizon adds the env's shaped reward (Overcooked's info["shaped_reward"], each agent's) to each agent's
reward with a weight falling linearly from 1 to 0 over that many env steps, as JaxMARL's Overcooked baselines do;
episode returns stay the env's own reward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import load_algorithm

MULTI_AGENT = ["ippo", "mappo", "pqn_vdn"]
IPPO_FAST = ["ippo", *(pytest.param(name, marks=pytest.mark.slow) for name in MULTI_AGENT[1:])]  # 8 s each


@pytest.mark.slow
def test_a_layout_is_named_overcooked_layout_and_an_unknown_one_is_refused():
    ippo = load_algorithm("ippo")
    import jaxmarl
    from jaxmarl.environments.overcooked import overcooked_layouts

    for layout in ("cramped_room", "counter_circuit"):
        env = jaxmarl.make("overcooked", layout=overcooked_layouts[layout])
        vec = ippo.VecEnv(f"overcooked-{layout}", 2)
        obs, _ = env.reset(jax.random.PRNGKey(0))  # its observation_space says (width, height, 26), obs differ
        assert vec.obs_shape == obs["agent_0"].shape and vec.shapes_reward()
        # uint8 0/1 planes given as float32 0/1: a torso would read uint8 as pixels (/ 255)
        got = np.asarray(vec.reset(jax.random.PRNGKey(0))[0])
        assert obs["agent_0"].dtype == jnp.uint8 and got.dtype == vec.obs_dtype == np.float32 and got.max() == 1.0
    assert ippo.VecEnv("overcooked", 2).obs_shape == ippo.VecEnv("overcooked-cramped_room", 2).obs_shape
    with pytest.raises(ippo.ConfigError, match="--env-name overcooked-kitchen cannot be built"):
        ippo.VecEnv("overcooked-kitchen", 2)
    assert not ippo.VecEnv("MPE_simple_spread_v3", 2).shapes_reward()


@pytest.mark.slow
def test_each_steps_shaped_reward_is_overcookeds_own():
    """Over 300 random steps of 8 envs (auto-resets included), EnvStep.shaped_reward is the shaped reward
    Overcooked's step_env gives for that step, per agent, and some of it is not zero."""
    ippo = load_algorithm("ippo")
    vec = ippo.VecEnv("overcooked", 8)
    obs, state = vec.reset(jax.random.PRNGKey(0))

    def one(carry, key):
        (state,) = carry
        action_key, step_key = jax.random.split(key)
        action = jax.random.randint(action_key, (8, 2), 0, vec.num_actions)
        step = vec.step(step_key, state, action)
        actions = lambda a: dict(zip(vec.env.agents, a, strict=True))  # noqa: E731
        own = jax.vmap(lambda k, s, a: vec.env.step_env(jax.random.split(k)[0], s, actions(a))[4])
        shaped = own(jax.random.split(step_key, 8), state, action)["shaped_reward"]
        return (step.state,), (step.shaped_reward, jnp.stack([shaped[a] for a in vec.env.agents], -1))

    _, (got, want) = jax.jit(lambda s: jax.lax.scan(one, (s,), jax.random.split(jax.random.PRNGKey(1), 300)))(state)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert (np.asarray(got) != 0).any()


def bandit_env(module):
    """Two agents, two actions, one-step episodes: action 0 earns 0.5 (the env's reward), action 1 earns a shaped
    reward of 2 (info["shaped_reward"], as Overcooked's): with the shaped reward weighted over 0.25, 1 is better."""
    module.import_jaxmarl()
    from jaxmarl.environments import MultiAgentEnv, spaces
    from jaxmarl.environments.multi_agent_env import State

    class Bandit(MultiAgentEnv):
        def __init__(self):
            super().__init__(num_agents=2)
            self.max_steps = 100
            self.action_spaces = {agent: spaces.Discrete(2) for agent in self.agents}
            self.observation_spaces = {agent: spaces.Box(-1.0, 1.0, (1,)) for agent in self.agents}

        def reset(self, key):
            return {agent: jnp.ones(1) for agent in self.agents}, State(done=jnp.array(False), step=jnp.array(0))

        def step_env(self, key, state, actions):
            reward = {agent: jnp.where(actions[agent] == 0, 0.5, 0.0) for agent in self.agents}
            shaped = {agent: jnp.where(actions[agent] == 1, 2.0, 0.0) for agent in self.agents}
            dones = {agent: jnp.array(True) for agent in [*self.agents, "__all__"]}
            obs, state = self.reset(key)
            return obs, state.replace(done=jnp.array(True)), reward, dones, {"shaped_reward": shaped}

    return Bandit()


@pytest.mark.parametrize("name", IPPO_FAST)
def test_the_shaped_reward_weighs_in_then_fades_out(name):
    """On bandit_env: with a horizon far beyond the run (weight near 1 throughout) every agent's greedy action is
    the shaped reward's, 1; with a horizon of a fifth of the run (weight 0 for its last 4/5) it is the env's own, 0.
    The returns reported are the env's own reward (0.5 per step at most)."""
    module = load_algorithm(name)
    total = 8 * 8 * 40
    for horizon, best in ((total * 100, 1), (total // 5, 0)):
        config = module.Config(
            num_envs=8, num_steps=8, total_timesteps=total, num_minibatches=2, num_seeds=1, shaping_horizon=horizon
        )
        config = config if name != "pqn_vdn" else module.Config(**{**vars(config), "lr": 1e-3, "eps_fraction": 0.2})
        env = module.VecEnv("Bandit", config.num_envs, env=bandit_env(module))
        runner, metrics = jax.jit(module.make_train(config, env))(jax.random.PRNGKey(0))
        assert bool(metrics["finite"].all()) and (np.asarray(metrics["episode_return"]) <= 0.5).all()
        act = module.make_act(config, env=env)
        action = act(module.saved_params(runner), jnp.ones((2, 1)), jax.random.PRNGKey(1))
        np.testing.assert_array_equal(np.asarray(action), best, err_msg=f"horizon {horizon}")


@pytest.mark.parametrize("name", MULTI_AGENT)
def test_a_shaping_horizon_needs_a_shaped_reward(name):
    module = load_algorithm(name)
    with pytest.raises(module.ConfigError, match="--shaping-horizon: MPE_simple_spread_v3 has no shaped reward$"):
        module.make_train(module.Config(shaping_horizon=1000))
