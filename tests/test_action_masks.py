"""Action masks in the multi-agent files (ippo.py, mappo.py, pqn_vdn.py): where a JaxMARL env masks actions (SMAX's
get_avail_actions, Hanabi's get_legal_moves), VecEnv appends each agent's legal actions (1/0) to its observation,
and the actor's logits (the Q-network's values) of the others are -1e9: a masked action is never sampled, in
training or by `make_act`. SMAX is named SMAX-<map>; its dead agents keep acting with "stop" their only legal action."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import load_algorithm

MULTI_AGENT = ["ippo", "mappo", "pqn_vdn"]


def stack(values: dict, agents) -> np.ndarray:
    return np.stack([np.asarray(values[agent]) for agent in agents], -2)


@pytest.mark.slow
def test_smax_observations_end_with_every_agents_legal_actions_and_dead_agents_may_only_stop():
    """SMAX-3m through VecEnv: JaxMARL's HeuristicEnemySMAX on map 3m; after every step (auto-reset included) each
    agent's observation ends with get_avail_actions of the env's state, and each step's final world state is SMAX's
    world_state of it (mappo.py's critic reads it); an agent that died may only stop; the 101st step, SMAX's time
    limit, is a truncation."""
    ippo = load_algorithm("ippo")
    vec = ippo.VecEnv("SMAX-3m", 8)
    assert type(vec.env).__name__ == "HeuristicEnemySMAX" and vec.masks_actions and vec.num_actions == 8
    legal_of = jax.jit(jax.vmap(vec.env.get_avail_actions))
    obs, state = vec.reset(jax.random.PRNGKey(0))
    np.testing.assert_array_equal(obs[..., -8:], stack(legal_of(state), vec.env.agents))
    step, died, ended = jax.jit(vec.step), False, False
    for key in jax.random.split(jax.random.PRNGKey(1), 60):
        legal = np.asarray(obs[..., -8:]) > 0
        logits = jnp.where(legal, 0.0, -jnp.inf)
        action = jax.random.categorical(key, logits)
        got = step(jax.random.fold_in(key, 1), state, action)
        want = stack(legal_of(got.state), vec.env.agents)
        np.testing.assert_array_equal(got.obs[..., -8:], want)
        going = ~np.asarray(got.terminated | got.truncated)  # their next state is the stepped one, not a reset
        world = np.asarray(jax.vmap(vec.env.get_world_state)(got.state))  # mappo.py's critic reads it
        np.testing.assert_array_equal(np.asarray(got.final_world_state)[going], world[going])
        dead = ~np.asarray(got.state.state.unit_alive[:, :3])
        stop_only = np.eye(8)[vec.env.num_movement_actions - 1]
        assert (want[dead] == stop_only).all()
        died, ended = died or dead.any(), ended or bool((got.terminated | got.truncated).any())
        obs, state = got.obs, got.state
    assert died and ended
    # SMAX's time limit truncates: its step count (in HeuristicEnemySMAX's wrapper state) past max_steps, step 101
    last = state.replace(state=state.state.replace(step=jnp.full_like(state.state.step, vec.time_limit)))
    got = step(jax.random.PRNGKey(2), last, jnp.full((8, 3), vec.env.num_movement_actions - 1))
    assert np.asarray(got.truncated).all() and not np.asarray(got.terminated).any()


def test_an_unknown_smax_map_is_refused_in_one_line():
    ippo = load_algorithm("ippo")
    with pytest.raises(ippo.ConfigError, match="--env-name SMAX-99z cannot be built"):
        ippo.VecEnv("SMAX-99z", 2)


@pytest.mark.slow
def test_hanabi_observations_end_with_its_legal_moves():
    ippo = load_algorithm("ippo")
    vec = ippo.VecEnv("hanabi", 2)
    obs, state = vec.reset(jax.random.PRNGKey(0))
    legal = stack(jax.vmap(vec.env.get_legal_moves)(state), vec.env.agents)
    assert vec.masks_actions and obs.shape[-1] == vec.obs_shape[0]
    np.testing.assert_array_equal(obs[..., -vec.num_actions :], legal)


def random_masked_obs(num_actions: int, shape=(512, 3), features: int = 5, seed: int = 0) -> np.ndarray:
    """Observations [*shape, features + num_actions] ending with random legal actions (at least one per row)."""
    rng = np.random.default_rng(seed)
    legal = rng.random((*shape, num_actions)) < 0.4
    legal[..., rng.integers(num_actions)] = True
    return np.concatenate([rng.normal(size=(*shape, features)), legal], -1).astype(np.float32)


@pytest.mark.parametrize("name", MULTI_AGENT)
def test_masked_actions_are_never_sampled(name):
    """On random observations with random legal sets: every action drawn (training's sampling or exploration, and
    make_act's greedy and sampled actions) is legal; an exploring agent draws each legal action about equally."""
    module, num_actions = load_algorithm(name), 6
    obs = jnp.asarray(random_masked_obs(num_actions))
    config = module.Config()
    networks = module.make_networks(config, num_actions, obs.shape[-1:], *([3] if name != "ippo" else []), True)
    network = networks.q if name == "pqn_vdn" else networks.actor
    params = network.init(jax.random.PRNGKey(0), obs[:1])
    out = network.apply(params, obs)
    legal = np.asarray(obs[..., -num_actions:]) > 0
    assert (np.asarray(out)[~legal] == -1e9).all() and (np.asarray(out)[legal] > -1e8).all()
    if name == "pqn_vdn":  # every action exploring: uniform over the legal ones
        draw = lambda key: module.epsilon_greedy(out, 1.0, key)  # noqa: E731
    else:
        draw = lambda key: module.sample_action(out, key)[0]  # noqa: E731
    draws = np.asarray(jax.jit(jax.vmap(draw))(jax.random.split(jax.random.PRNGKey(1), 20)))
    assert np.take_along_axis(np.broadcast_to(legal, (20, *legal.shape)), draws[..., None], -1).all()
    if name == "pqn_vdn":  # uniform over each row's legal actions: every legal one drawn about 1 / num_legal
        counts = (draws[..., None] == np.arange(num_actions)).mean(0)[legal]
        expected = np.broadcast_to(1 / legal.sum(-1, keepdims=True), legal.shape)[legal]
        assert abs((counts - expected).mean()) < 0.01
    env = module.VecEnv("Parity", 1, env=parity_env(module))
    params = module.make_train(config, env).init(jax.random.PRNGKey(2)).params
    obs = jnp.asarray(random_masked_obs(4, (256, 2), features=2, seed=1))
    for greedy in (True, False):
        act = jax.jit(jax.vmap(module.make_act(config, greedy, env), (None, 0, 0)))
        action = np.asarray(act(params, obs, jax.random.split(jax.random.PRNGKey(3), 256)))
        assert np.take_along_axis(np.asarray(obs[..., -4:]) > 0, action[..., None], -1).all(), greedy


def parity_env(module, max_steps: int = 9):
    """A JaxMARL env of 2 agents and 4 actions whose legal actions alternate: 0 and 1 on even steps, 2 and 3 on odd
    ones (get_avail_actions). A legal action earns 1, any other -100; the episode ends after max_steps + 1 steps."""
    module.import_jaxmarl()
    from jaxmarl.environments import MultiAgentEnv, spaces
    from jaxmarl.environments.multi_agent_env import State

    class Parity(MultiAgentEnv):
        def __init__(self):
            super().__init__(num_agents=2)
            self.max_steps = max_steps
            self.action_spaces = {agent: spaces.Discrete(4) for agent in self.agents}
            self.observation_spaces = {agent: spaces.Box(-1.0, 1.0, (2,)) for agent in self.agents}

        def reset(self, key):
            return self.observe(jnp.array(0)), State(done=jnp.array(False), step=jnp.array(0))

        def observe(self, step):
            return {agent: jnp.stack([step % 2, 1.0 - step % 2]).astype(jnp.float32) for agent in self.agents}

        def get_avail_actions(self, state):
            even = state.step % 2 == 0
            return {agent: jnp.array([even, even, ~even, ~even], jnp.float32) for agent in self.agents}

        def step_env(self, key, state, actions):
            legal = self.get_avail_actions(state)
            reward = {agent: jnp.where(legal[agent][actions[agent]] > 0, 1.0, -100.0) for agent in self.agents}
            done = state.step >= self.max_steps
            dones = {agent: done for agent in [*self.agents, "__all__"]}
            return self.observe(state.step + 1), State(done=done, step=state.step + 1), reward, dones, {}

    return Parity()


@pytest.mark.parametrize("name", MULTI_AGENT)
def test_training_on_a_masked_env_never_takes_an_illegal_action(name):
    """Trained (exploring from its first update) on parity_env, every episode's return is exactly its 10 steps:
    an illegal action anywhere would cost 100. Without the masks about half the exploring actions would be."""
    module = load_algorithm(name)
    config = module.Config(num_envs=8, num_steps=10, total_timesteps=8 * 10 * 6, num_minibatches=2, num_seeds=1)
    env = module.VecEnv("Parity", config.num_envs, env=parity_env(module))
    assert env.masks_actions and env.obs_shape == (6,)
    runner, metrics = jax.jit(module.make_train(config, env))(jax.random.PRNGKey(0))
    assert bool(metrics["finite"].all()) and (np.asarray(metrics["episodes_finished"]) > 0).all()
    np.testing.assert_array_equal(np.asarray(metrics["episode_return"]), 10.0)
