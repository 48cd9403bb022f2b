"""ippo_rnn.py: every agent's GRU state through the rollout against a plain Python loop (reset where its env's episode
starts, bootstrapped from the state after the step at a truncation), the update replaying exactly what acted
through its shuffle of agent sequences, a time limit bootstrapped for every agent, masked actions never taken, and
the policy carrying each agent's memory.

The GRU itself (shared with ppo_rnn.py, tests/test_files.py) is tested in tests/test_ppo_rnn.py; GAE per agent in
tests/test_ippo.py (the same function); the checks every algorithm shares through tests/specs/ippo_rnn.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_action_masks import parity_env, random_masked_obs
from test_ippo import never_ending

from conftest import load_algorithm

AGENTS, OBS = 2, 3


@pytest.fixture(scope="module")
def rnn():
    return load_algorithm("ippo_rnn")


def coin_env(module, max_steps: int = 11):
    """A JaxMARL env of 2 agents and 3 actions, each seeing its own random observation [3]; the episode terminates
    with probability 0.15 a step, else is cut after `max_steps` + 1 steps; each agent earns its action minus 1."""
    module.import_jaxmarl()
    from jaxmarl.environments import MultiAgentEnv, spaces
    from jaxmarl.environments.multi_agent_env import State

    class Coin(MultiAgentEnv):
        def __init__(self):
            super().__init__(num_agents=AGENTS)
            self.max_steps = max_steps
            self.action_spaces = {agent: spaces.Discrete(3) for agent in self.agents}
            self.observation_spaces = {agent: spaces.Box(-9.0, 9.0, (OBS,)) for agent in self.agents}

        def observe(self, key):
            keys = jax.random.split(key, self.num_agents)
            return {agent: jax.random.normal(k, (OBS,)) for agent, k in zip(self.agents, keys, strict=True)}

        def reset(self, key):
            return self.observe(key), State(done=jnp.array(False), step=jnp.array(0))

        def step_env(self, key, state, actions):
            obs_key, end_key = jax.random.split(key)
            done = (jax.random.uniform(end_key) < 0.15) | (state.step >= self.max_steps)
            dones = {agent: done for agent in [*self.agents, "__all__"]}
            reward = {agent: actions[agent] - 1.0 for agent in self.agents}
            return self.observe(obs_key), State(done=done, step=state.step + 1), reward, dones, {}

    return Coin()


@pytest.fixture(scope="module")
def short(rnn):
    """3 updates of 4 envs x 2 agents x 20 steps, one epoch of one minibatch each, on coin_env."""
    steps = dict(num_envs=4, num_steps=20, total_timesteps=4 * 20 * 3, num_minibatches=1, update_epochs=1)
    config = rnn.Config(**steps, hidden_size=8, num_seeds=1)
    return config, rnn.make_train(config, rnn.VecEnv("Coin", config.num_envs, env=coin_env(rnn)))


def python_loop(network, params, hidden, obs, start, final_obs):
    """Step by step, every agent of every env alone: the state after each step, logits, value and V(final_obs)."""
    want = {"after": [], "logits": [], "value": [], "next_value": []}
    step = jax.jit(network.apply)
    for t in range(len(obs)):
        hidden = np.where(start[t][..., None], 0.0, hidden)
        row = [
            [step(params, hidden[n, a][None], obs[t, n, a][None]) for a in range(AGENTS)] for n in range(len(obs[t]))
        ]
        hidden = np.array([[np.asarray(out[0][0]) for out in env] for env in row])
        want["after"].append(hidden)
        want["logits"].append(np.array([[np.asarray(out[1][0]) for out in env] for env in row]))
        want["value"].append(np.array([[float(out[2][0]) for out in env] for env in row]))
        want["next_value"].append(np.asarray(step(params, hidden, final_obs[t])[2]))
    return {name: np.stack(value) for name, value in want.items()}


def test_rollout_matches_a_python_loop_and_the_replay_what_acted(rnn, short):
    """Two rollouts in a row with terminations and truncations: every agent's state, log-prob, value and bootstrap
    value equal a plain loop that resets its state exactly where its env's episode starts and bootstraps from the
    state after the step; `unroll` of the stored sequences (as the update replays them) gives back what acted."""
    config, train = short
    network = rnn.make_networks(config, 3, (OBS,)).actor_critic
    runner = jax.jit(train.init)(jax.random.PRNGKey(0))
    saw = {"terminated": 0, "truncated": 0}
    for key in jax.random.split(jax.random.PRNGKey(1), 2):
        hidden = np.asarray(runner.hidden)
        episodes, new_hidden, tr = jax.device_get(
            jax.jit(train.rollout)(runner.params, runner.episodes, runner.hidden, 0.0, key)
        )
        np.testing.assert_array_equal(tr.start[1:], tr.done[:-1])  # done at t: step t+1 starts an episode
        assert (tr.start == tr.start[..., :1]).all()  # an env's agents start together
        want = python_loop(network, runner.params, hidden, tr.obs, tr.start, tr.final_obs)
        log_prob = np.take_along_axis(jax.nn.log_softmax(want["logits"]), tr.action[..., None], -1)[..., 0]
        np.testing.assert_allclose(tr.log_prob, log_prob, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(tr.value, want["value"], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(tr.next_value, want["next_value"], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(new_hidden, want["after"][-1], rtol=1e-5, atol=1e-6)  # not reset
        np.testing.assert_array_equal(tr.reward, tr.action - 1.0)  # each agent's own reward

        _, logits, value = jax.jit(network.apply, static_argnames="method")(
            runner.params, hidden, tr.obs, tr.start, method="unroll"
        )
        replayed = np.take_along_axis(jax.nn.log_softmax(logits), tr.action[..., None], -1)[..., 0]
        np.testing.assert_allclose(replayed, tr.log_prob, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(value, tr.value, rtol=1e-5, atol=1e-5)
        saw["terminated"] += int(tr.terminated.sum())
        saw["truncated"] += int((tr.done & ~tr.terminated).sum())
        runner = runner._replace(episodes=episodes, hidden=new_hidden)
    assert saw["terminated"] > 0 and saw["truncated"] > 0, saw


def test_first_gradient_step_sees_ratio_one(short):
    """One epoch of one minibatch per update: the only gradient step replays the policy that acted, through the
    update's shuffle of the N * A agent sequences and of the states they started from, so the ratio is 1 on every
    update. The actor's output is scaled up first: a near-uniform policy would hide a state given to another agent."""
    _, train = short
    runner = jax.jit(train.init)(jax.random.PRNGKey(1))
    params = runner.params
    params["params"]["actor_out"]["kernel"] = 300.0 * params["params"]["actor_out"]["kernel"]
    runner, update = runner._replace(params=params), jax.jit(train.update)
    for index in range(3):  # the first starts from zero states, the others from the last rollout's
        runner, metrics = jax.device_get(update(runner, index))
        assert metrics["finite"] and metrics["episodes_finished"] > 0 and metrics["grad_norm"] > 0
        assert metrics["entropy"] < 1.0  # far from uniform over 3 actions (1.1)
        np.testing.assert_allclose(metrics["approx_kl"], 0.0, atol=1e-7)
        np.testing.assert_array_equal(metrics["clip_fraction"], 0.0)


def test_a_time_limit_is_bootstrapped_for_every_agent(rnn):
    """Trained on never_ending's env (test_ippo.py) with gamma 0.9, every agent's value at every step of an episode
    is 1 / (1 - 0.9) = 10 within 5%: the GRU could count the steps to the time limit, and a truncation taken for a
    termination would teach it 10 (1 - 0.9^k) for k steps left."""
    config = rnn.Config(gamma=0.9, lr=3e-3, num_envs=8, num_steps=16, total_timesteps=8 * 16 * 150, num_seeds=1)
    env = rnn.VecEnv("NeverEnding", config.num_envs, env=never_ending(rnn))
    train = rnn.make_train(config, env)
    runner, metrics = jax.jit(train)(jax.random.PRNGKey(0))
    assert bool(metrics["finite"].all()) and np.asarray(metrics["episode_length"])[-1] == 21
    tr = jax.jit(train.rollout)(runner.params, runner.episodes, runner.hidden, 0.0, jax.random.PRNGKey(1))[2]
    np.testing.assert_allclose(tr.value, 10.0, rtol=0.05)


def test_masked_actions_are_never_taken(rnn):
    """The logits of illegal actions are -1e9 at every step of an unroll; in parity_env (test_action_masks.py), whose
    legal actions alternate, the rollout's and make_act's actions (greedy and sampled) are all legal."""
    config = rnn.Config(num_envs=8, num_steps=16, total_timesteps=8 * 16 * 2, num_seeds=1)
    network = rnn.make_networks(config, 6, (11,), masked=True).actor_critic
    obs = jnp.asarray(random_masked_obs(6, (4, 8)))  # [T, n, 5 + 6]
    params = network.init(jax.random.PRNGKey(0), jnp.zeros((1, config.hidden_size)), obs[0, :1])
    logits = network.apply(params, jnp.zeros((8, config.hidden_size)), obs, obs[..., 0] > 1, method="unroll")[1]
    legal = np.asarray(obs[..., -6:]) > 0
    assert (np.asarray(logits)[~legal] == -1e9).all() and (np.asarray(logits)[legal] > -1e8).all()

    rollout_and_act_take_legal_actions(rnn, config)


def rollout_and_act_take_legal_actions(module, config):
    """In parity_env (test_action_masks.py), whose legal actions alternate, a recurrent file's rollout and its
    make_act (greedy and sampled, carrying act.memory) take only legal actions (mappo_rnn.py's tests too)."""
    env = module.VecEnv("Parity", config.num_envs, env=parity_env(module))
    train = module.make_train(config, env)
    runner = jax.jit(train.init)(jax.random.PRNGKey(2))
    tr = jax.jit(train.rollout)(runner.params, runner.episodes, runner.hidden, 0.0, jax.random.PRNGKey(3))[2]
    assert (np.asarray(tr.reward) == 1.0).all()  # an illegal action earns -100
    for greedy in (True, False):
        act = module.make_act(config, greedy, env)
        memory = jnp.broadcast_to(act.memory, (config.num_envs, *act.memory.shape))
        act, episode_obs = jax.jit(jax.vmap(act, (None, 0, 0, 0))), np.asarray(tr.obs)
        for t in range(len(episode_obs)):
            action, memory = act(runner.params, episode_obs[t], jax.random.split(jax.random.PRNGKey(t), 8), memory)
            assert np.take_along_axis(episode_obs[t][..., -4:] > 0, np.asarray(action)[..., None], -1).all(), greedy


def test_act_carries_each_agents_memory(rnn, short):
    """make_act: act.memory is every agent's zero state; fed the states the rollout started from, act gives each
    agent's state after the step and the most probable action of the plain loop."""
    config, train = short
    env = rnn.VecEnv("Coin", 1, env=coin_env(rnn))
    act = rnn.make_act(config, True, env)
    np.testing.assert_array_equal(act.memory, np.zeros((AGENTS, config.hidden_size)))
    runner = jax.jit(train.init)(jax.random.PRNGKey(0))
    obs = np.asarray(runner.episodes.obs)  # [N, A, OBS]
    hidden = np.asarray(jax.random.normal(jax.random.PRNGKey(5), (len(obs), AGENTS, config.hidden_size)))
    network, fresh = rnn.make_networks(config, 3, (OBS,)).actor_critic, np.zeros((1, *obs.shape[:2]), bool)
    want = python_loop(network, runner.params, hidden, obs[None], fresh, obs[None])
    keys = jax.random.split(jax.random.PRNGKey(0), len(obs))
    action, memory = jax.vmap(act, (None, 0, 0, 0))(runner.params, obs, keys, hidden)
    np.testing.assert_allclose(memory, want["after"][0], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(action, want["logits"][0].argmax(-1))
