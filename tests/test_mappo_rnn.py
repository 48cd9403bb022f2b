"""mappo_rnn.py: every agent's actor and critic GRU states through the rollout against a plain Python loop (the critic
reading the global state, both reset where its env's episode starts, the bootstrap value from the critic's state
after the step at a truncation), the update replaying exactly what acted through its shuffle of agent sequences (the
policy's ratio and the critic's values alike), a time limit bootstrapped for every agent, masked actions never taken,
and the policy carrying each agent's memory.

The GRU (shared with ppo_rnn.py) is tested in tests/test_ppo_rnn.py, global_state (shared with mappo.py) and GAE per
agent in tests/test_ippo.py; the checks every algorithm shares through tests/specs/mappo_rnn.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_action_masks import random_masked_obs
from test_ippo import never_ending
from test_ippo_rnn import AGENTS, OBS, coin_env, rollout_and_act_take_legal_actions

from conftest import load_algorithm


@pytest.fixture(scope="module")
def rnn():
    return load_algorithm("mappo_rnn")


@pytest.fixture(scope="module")
def short(rnn):
    """3 updates of 4 envs x 2 agents x 20 steps, one epoch of one minibatch each, on coin_env."""
    steps = dict(num_envs=4, num_steps=20, total_timesteps=4 * 20 * 3, num_minibatches=1, update_epochs=1)
    config = rnn.Config(**steps, hidden_size=8, num_seeds=1)
    return config, rnn.make_train(config, rnn.VecEnv("Coin", config.num_envs, env=coin_env(rnn)))


def joined(obs: np.ndarray) -> np.ndarray:
    """coin_env's global state, by hand: every agent's observation joined, then each agent's one-hot id."""
    joint = np.broadcast_to(obs.reshape(*obs.shape[:-2], 1, -1), (*obs.shape[:-1], AGENTS * OBS))
    return np.concatenate([joint, np.broadcast_to(np.eye(AGENTS), (*obs.shape[:-2], AGENTS, AGENTS))], -1)


def python_loop(networks, params, hidden, obs, start, final_obs):
    """Step by step, every agent of every env alone: its actor's and critic's states after each step, logits, value
    (of the global state) and V(final_obs' global state) from the critic's state after the step."""
    want = {"actor": [], "critic": [], "logits": [], "value": [], "next_value": []}
    actor, critic = (jax.jit(network.apply) for network in networks)
    actor_hidden, critic_hidden = (np.asarray(h) for h in hidden)
    for t in range(len(obs)):
        state, final_state = joined(obs[t]), joined(final_obs[t])
        actor_hidden, critic_hidden = (np.where(start[t][..., None], 0.0, h) for h in (actor_hidden, critic_hidden))
        actor_out, critic_out = [], []
        for n in range(len(obs[t])):
            actor_out.append(
                [actor(params["actor"], actor_hidden[n, a][None], obs[t, n, a][None]) for a in range(AGENTS)]
            )
            critic_out.append(
                [critic(params["critic"], critic_hidden[n, a][None], state[n, a][None]) for a in range(AGENTS)]
            )
        actor_hidden = np.array([[np.asarray(out[0][0]) for out in env] for env in actor_out])
        critic_hidden = np.array([[np.asarray(out[0][0]) for out in env] for env in critic_out])
        want["actor"].append(actor_hidden)
        want["critic"].append(critic_hidden)
        want["logits"].append(np.array([[np.asarray(out[1][0]) for out in env] for env in actor_out]))
        want["value"].append(np.array([[float(out[1][0, 0]) for out in env] for env in critic_out]))
        want["next_value"].append(np.asarray(critic(params["critic"], critic_hidden, final_state)[1][..., 0]))
    return {name: np.stack(value) for name, value in want.items()}


def test_rollout_matches_a_python_loop_and_the_replay_what_acted(rnn, short):
    """Two rollouts in a row with terminations and truncations: every agent's actor and critic states, log-prob,
    value and bootstrap value equal a plain loop that resets both states exactly where its env's episode starts, gives
    the critic the global state built by hand, and bootstraps from the critic's state after the step; `unroll` of
    the stored sequences (as the update replays them) gives back what acted."""
    config, train = short
    networks = rnn.make_networks(config, 3, (OBS,), AGENTS)
    runner = jax.jit(train.init)(jax.random.PRNGKey(0))
    saw = {"terminated": 0, "truncated": 0}
    for key in jax.random.split(jax.random.PRNGKey(1), 2):
        hidden = jax.device_get(runner.hidden)
        episodes, new_hidden, tr = jax.device_get(
            jax.jit(train.rollout)(runner.params, runner.episodes, runner.hidden, 0.0, key)
        )
        np.testing.assert_array_equal(tr.start[1:], tr.done[:-1])  # done at t: step t+1 starts an episode
        np.testing.assert_allclose(tr.state, joined(tr.obs), rtol=1e-6)
        final_obs = tr.final_state[..., 0, : OBS * AGENTS].reshape(*tr.obs.shape[:2], AGENTS, OBS)
        np.testing.assert_allclose(tr.final_state, joined(final_obs), rtol=1e-6)
        going_on = ~tr.done[:-1, :, 0]  # there the true next observations are the next step's
        np.testing.assert_array_equal(final_obs[:-1][going_on], tr.obs[1:][going_on])
        want = python_loop(networks, runner.params, hidden, tr.obs, tr.start, final_obs)
        log_prob = np.take_along_axis(jax.nn.log_softmax(want["logits"]), tr.action[..., None], -1)[..., 0]
        np.testing.assert_allclose(tr.log_prob, log_prob, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(tr.value, want["value"], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(tr.next_value, want["next_value"], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(new_hidden[0], want["actor"][-1], rtol=1e-5, atol=1e-6)  # not reset
        np.testing.assert_allclose(new_hidden[1], want["critic"][-1], rtol=1e-5, atol=1e-6)

        unroll = jax.jit(lambda net, p, h, x, s: net.apply(p, h, x, s, method="unroll"), static_argnums=0)
        logits = unroll(networks.actor, runner.params["actor"], hidden[0], tr.obs, tr.start)[1]
        value = unroll(networks.critic, runner.params["critic"], hidden[1], tr.state, tr.start)[1][..., 0]
        replayed = np.take_along_axis(jax.nn.log_softmax(logits), tr.action[..., None], -1)[..., 0]
        np.testing.assert_allclose(replayed, tr.log_prob, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(value, tr.value, rtol=1e-5, atol=1e-5)
        saw["terminated"] += int(tr.terminated.sum())
        saw["truncated"] += int((tr.done & ~tr.terminated).sum())
        runner = runner._replace(episodes=episodes, hidden=new_hidden)
    assert saw["terminated"] > 0 and saw["truncated"] > 0, saw


def test_first_gradient_step_replays_the_policy_and_values_that_acted(rnn, short):
    """One epoch of one minibatch per update: the only gradient step replays, through the update's shuffle of the
    N * A agent sequences and of both networks' states they started from, the policy that acted (ratio 1) and the
    values the rollout stored (the clipped value loss is then the plain one of those values and GAE's targets). Both
    outputs are scaled up first: a near-uniform policy or flat values would hide a state given to another agent."""
    _, train = short
    runner = jax.jit(train.init)(jax.random.PRNGKey(1))
    params = runner.params
    params["actor"]["params"]["out"]["kernel"] = 300.0 * params["actor"]["params"]["out"]["kernel"]
    params["critic"]["params"]["out"]["kernel"] = 30.0 * params["critic"]["params"]["out"]["kernel"]
    runner, update = runner._replace(params=params), jax.jit(train.update)
    for index in range(3):  # the first starts from zero states, the others from the last rollout's
        rollout_key = jax.random.split(runner.rng, 3)[1]  # as update splits it
        tr = jax.jit(train.rollout)(runner.params, runner.episodes, runner.hidden, 0.0, rollout_key)[2]
        hp = runner.hparams
        target = rnn.compute_gae(tr.reward, tr.value, tr.next_value, tr.terminated, tr.done, hp.gamma, hp.gae_lambda)[1]
        runner, metrics = jax.device_get(update(runner, index))
        assert metrics["finite"] and metrics["episodes_finished"] > 0 and metrics["grad_norm"] > 0
        assert metrics["entropy"] < 1.0  # far from uniform over 3 actions (1.1)
        np.testing.assert_allclose(metrics["approx_kl"], 0.0, atol=1e-7)
        np.testing.assert_array_equal(metrics["clip_fraction"], 0.0)
        want = 0.5 * np.mean(np.square(np.asarray(tr.value) - np.asarray(target)))
        np.testing.assert_allclose(metrics["value_loss"], want, rtol=1e-4)


def test_a_time_limit_is_bootstrapped_for_every_agent(rnn):
    """Trained on never_ending's env (test_ippo.py) with gamma 0.9, every agent's value at every step of an episode
    is 1 / (1 - 0.9) = 10 within 5%: the critic's GRU could count the steps to the time limit, and a truncation
    taken for a termination would teach it 10 (1 - 0.9^k) for k steps left."""
    config = rnn.Config(gamma=0.9, lr=3e-3, num_envs=8, num_steps=16, total_timesteps=8 * 16 * 150, num_seeds=1)
    env = rnn.VecEnv("NeverEnding", config.num_envs, env=never_ending(rnn))
    train = rnn.make_train(config, env)
    runner, metrics = jax.jit(train)(jax.random.PRNGKey(0))
    assert bool(metrics["finite"].all()) and np.asarray(metrics["episode_length"])[-1] == 21
    tr = jax.jit(train.rollout)(runner.params, runner.episodes, runner.hidden, 0.0, jax.random.PRNGKey(1))[2]
    np.testing.assert_allclose(tr.value, 10.0, rtol=0.05)


def test_masked_actions_are_never_taken(rnn):
    """The actor's logits of illegal actions are -1e9 at every step of an unroll; in parity_env (test_action_masks.py),
    whose legal actions alternate, the rollout's and make_act's actions (greedy and sampled) are all legal."""
    config = rnn.Config(num_envs=8, num_steps=16, total_timesteps=8 * 16 * 2, num_seeds=1)
    actor = rnn.make_networks(config, 6, (11,), masked=True).actor
    obs = jnp.asarray(random_masked_obs(6, (4, 8)))  # [T, n, 5 + 6]
    params = actor.init(jax.random.PRNGKey(0), jnp.zeros((1, config.hidden_size)), obs[0, :1])
    logits = actor.apply(params, jnp.zeros((8, config.hidden_size)), obs, obs[..., 0] > 1, method="unroll")[1]
    legal = np.asarray(obs[..., -6:]) > 0
    assert (np.asarray(logits)[~legal] == -1e9).all() and (np.asarray(logits)[legal] > -1e8).all()

    rollout_and_act_take_legal_actions(rnn, config)


def test_act_carries_each_agents_memory(rnn, short):
    """make_act: act.memory is every agent's zero actor state; fed the states the rollout started from, act gives
    each agent's actor state after the step and the most probable action of the plain loop."""
    config, train = short
    env = rnn.VecEnv("Coin", 1, env=coin_env(rnn))
    act = rnn.make_act(config, True, env)
    np.testing.assert_array_equal(act.memory, np.zeros((AGENTS, config.hidden_size)))
    runner = jax.jit(train.init)(jax.random.PRNGKey(0))
    obs = np.asarray(runner.episodes.obs)  # [N, A, OBS]
    hidden = np.asarray(jax.random.normal(jax.random.PRNGKey(5), (2, len(obs), AGENTS, config.hidden_size)))
    networks, fresh = rnn.make_networks(config, 3, (OBS,), AGENTS), np.zeros((1, *obs.shape[:2]), bool)
    want = python_loop(networks, runner.params, hidden, obs[None], fresh, obs[None])
    keys = jax.random.split(jax.random.PRNGKey(0), len(obs))
    action, memory = jax.vmap(act, (None, 0, 0, 0))(runner.params, obs, keys, hidden[0])
    np.testing.assert_allclose(memory, want["actor"][0], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(action, want["logits"][0].argmax(-1))
