"""ppo_rnn.py: where the GRU state is reset, its gradient (jax.grad through the scan) against finite
differences, the rollout and the greedy policy against a plain Python loop, the update replaying
exactly what acted, the velocity-hiding wrapper.

The checks every algorithm shares (vmap, determinism, sweeps, chunking, the command line) live in
tests/test_train.py and tests/test_cli.py; memory against no memory on CartPole without velocities
is tests/test_learning.py's check for this file. Each compiled program here is built once per module.
"""

import gymnax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import SHORT_LIMIT, TERMINATED, TRUNCATED, load_algorithm, short_episodes

ENV = "CartPole-v1-no-velocity"


@pytest.fixture(scope="module")
def rnn():
    module = load_algorithm("ppo_rnn")
    module.validate(module.Config())  # registers MEMORY_ENVS with gymnax, as make_train does first
    return module


@pytest.fixture(scope="module")
def short(rnn):
    """3 updates of 8 envs x 20 steps, one epoch of one minibatch each, time limit SHORT_LIMIT."""
    config = rnn.Config(
        num_envs=8,
        num_steps=20,
        total_timesteps=8 * 20 * 3,
        num_minibatches=1,
        update_epochs=1,
        hidden_size=8,
        num_seeds=1,
    )
    return config, rnn.make_train(config, short_episodes(rnn, config.num_envs))


def init_params(rnn, config, key=0, obs_dim=2):
    network = rnn.make_networks(config, 2, (obs_dim,)).actor_critic
    params = network.init(jax.random.PRNGKey(key), jnp.zeros((1, config.hidden_size)), jnp.zeros((1, obs_dim)))
    return network, params


def replay(network, params, hidden, obs, start):
    """(states, logits, values) of stored sequences, as the update's loss replays them."""
    return jax.jit(lambda *args: network.apply(params, *args, method=type(network).unroll))(hidden, obs, start)


def python_loop(network, params, hidden, obs, start, final_obs=None):
    """The network stepped env by env, step by step, resetting the state where an episode starts:
    (the state fed to each step, the state after it, logits, values, V(final_obs) from the state
    after the step), every array [T, N, ...]."""
    T, N = start.shape
    step = jax.jit(network.apply)
    out = {k: [[None] * N for _ in range(T)] for k in ("fed", "after", "logits", "value", "next_value")}
    for n in range(N):
        h = np.asarray(hidden[n])
        for t in range(T):
            fed = np.zeros_like(h) if start[t, n] else h
            h, logits, value = (np.asarray(x[0]) for x in step(params, fed[None], obs[t, n][None]))
            for k, v in (("fed", fed), ("after", h), ("logits", logits), ("value", value)):
                out[k][t][n] = v
            if final_obs is not None:
                out["next_value"][t][n] = np.asarray(step(params, h[None], final_obs[t, n][None])[2][0])
    return {k: np.array(v) for k, v in out.items() if v[0][0] is not None}


# --------------------------------------------------------------------------------------
# The GRU over a stored sequence
# --------------------------------------------------------------------------------------
def hand_made_sequence(rnn, hidden_size=8, seed=0):
    """conftest's [T=6, N=5] boundary patterns as episode starts (the obs after a done begins a new
    episode; envs 1 and 3 also begin one at t=0), with random observations and a random state
    before the first step, so that a reset is visible wherever it happens."""
    done = TERMINATED | TRUNCATED
    start = np.concatenate([np.array([[False, True, False, True, False]]), done[:-1]])
    rng = np.random.default_rng(seed)
    obs = rng.normal(size=(*start.shape, 2)).astype(np.float32)
    hidden = rng.normal(size=(start.shape[1], hidden_size)).astype(np.float32)
    return hidden, obs, start


def test_replay_resets_the_state_where_a_python_loop_does(rnn):
    config = rnn.Config(hidden_size=8)
    network, params = init_params(rnn, config, key=3)
    hidden, obs, start = hand_made_sequence(rnn)

    states, logits, value = (np.asarray(x) for x in replay(network, params, hidden, obs, start))
    fed = np.where(start[..., None], 0.0, np.concatenate([hidden[None], states[:-1]]))

    want = python_loop(network, params, hidden, obs, start)
    np.testing.assert_allclose(fed, want["fed"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(states, want["after"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(logits, want["logits"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(value, want["value"], rtol=1e-5, atol=1e-6)
    # The pattern does reset mid-sequence and does carry the state across steps elsewhere.
    assert (want["fed"][start] == 0).all() and (np.abs(want["fed"][~start]) > 0).all()


def numpy_unroll(kernel, bias, hidden, gates, start):
    """The GRU over a sequence in float64 NumPy, step by step (flax GRUCell's equations), reset at starts."""
    sigmoid = lambda x: 1 / (1 + np.exp(-x))  # noqa: E731
    states = []
    for gates_t, start_t in zip(gates, start, strict=True):
        fed = np.where(start_t[:, None], 0.0, hidden)
        x_r, x_z, x_n = np.split(gates_t, 3, -1)
        h_r, h_z, h_n = np.split(fed @ kernel + bias, 3, -1)
        r, z = sigmoid(x_r + h_r), sigmoid(x_z + h_z)
        hidden = (1 - z) * np.tanh(x_n + r * h_n) + z * fed
        states.append(hidden)
    return np.stack(states)


def gru_arguments(rnn, H=8, seed=1):
    hidden, _, start = hand_made_sequence(rnn, H)
    rng = np.random.default_rng(seed)
    kernel = rng.normal(size=(H, 3 * H)).astype(np.float32) * 0.5
    bias = rng.normal(size=3 * H).astype(np.float32) * 0.1
    gates = rng.normal(size=(*start.shape, 3 * H)).astype(np.float32)
    weights = rng.normal(size=(*start.shape, H)).astype(np.float32)
    return (kernel, bias, hidden, gates), start, weights


def test_gru_gradient_matches_finite_differences(rnn):
    """jax.grad of gru_unroll (a plain scan of gru_cell) == central differences of a float64 NumPy
    GRU along random directions, for every input, resets included, alone and vmapped."""
    args, start, weights = gru_arguments(rnn)
    unroll = np.asarray(jax.jit(rnn.gru_unroll)(*args, start))
    np.testing.assert_allclose(unroll, numpy_unroll(*args, start), rtol=1e-5, atol=1e-5)

    def loss(*args):
        return jnp.sum(weights * jnp.tanh(rnn.gru_unroll(*args, start)))

    def numpy_loss(*args):
        return np.sum(weights * np.tanh(numpy_unroll(*(a.astype(np.float64) for a in args), start)))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args)
    rng, eps = np.random.default_rng(2), 1e-4
    for i, name in enumerate(("kernel", "bias", "hidden", "gates")):
        for _ in range(3):
            direction = rng.normal(size=args[i].shape)
            shifted = [[np.asarray(a, np.float64) for a in args] for _ in range(2)]
            shifted[0][i], shifted[1][i] = shifted[0][i] + eps * direction, shifted[1][i] - eps * direction
            numeric = (numpy_loss(*shifted[0]) - numpy_loss(*shifted[1])) / (2 * eps)
            np.testing.assert_allclose(np.sum(grads[i] * direction), numeric, rtol=1e-4, atol=1e-4, err_msg=name)

    batched = jax.tree.map(lambda x: np.stack([x, 0.5 * x]), args)
    got = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2, 3))))(*batched)
    for name, g, w in zip(("kernel", "bias", "hidden", "gates"), got, grads, strict=True):
        np.testing.assert_allclose(g[0], w, rtol=1e-5, atol=1e-6, err_msg=f"vmapped {name}")


def test_no_gradient_crosses_an_episode_start(rnn):
    """A loss on each env's last episode alone: nothing before that episode's start (the state before
    the sequence, earlier steps' gates) gets a gradient, and everything from the start on does."""
    args, start, weights = gru_arguments(rnn)
    T, N = start.shape
    last_start = np.array([max([t for t in range(T) if start[t, n]], default=0) for n in range(N)])
    in_last = np.arange(T)[:, None] >= last_start[None]
    assert (last_start > 0).sum() >= 2  # episodes do start mid-sequence

    def loss(hidden, gates):
        return jnp.sum(in_last[..., None] * weights * jnp.tanh(rnn.gru_unroll(args[0], args[1], hidden, gates, start)))

    d_hidden, d_gates = (np.asarray(g) for g in jax.jit(jax.grad(loss, argnums=(0, 1)))(*args[2:]))
    np.testing.assert_array_equal(d_gates[~in_last], 0.0)
    assert (np.abs(d_gates[in_last]).sum(-1) > 0).all()
    started = start.any(0)  # envs with a start in the sequence: the state before it is forgotten
    np.testing.assert_array_equal(d_hidden[started], 0.0)
    assert (np.abs(d_hidden[~started]).sum(-1) > 0).all()


def test_act_carries_the_memory_it_is_given(rnn):
    """make_act: act.memory is the zero state; act, vmapped over envs and fed act.memory where an episode
    starts, gives the state and the most probable action of the plain loop, which resets at `start`."""
    config = rnn.Config(hidden_size=8)
    network, params = init_params(rnn, config, key=4)
    hidden, obs, start = hand_made_sequence(rnn)
    act = rnn.make_act(config)
    np.testing.assert_array_equal(act.memory, np.zeros(config.hidden_size))

    want = python_loop(network, params, hidden, obs, start)
    batched, memory = jax.jit(jax.vmap(act, in_axes=(None, 0, 0, 0))), hidden
    for t, key in enumerate(jax.random.split(jax.random.PRNGKey(0), len(start))):
        memory = np.where(start[t][:, None], act.memory, memory)
        action, memory = batched(params, obs[t], jax.random.split(key, len(memory)), memory)
        np.testing.assert_allclose(memory, want["after"][t], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(action, want["logits"][t].argmax(-1))


# --------------------------------------------------------------------------------------
# Rollout and update
# --------------------------------------------------------------------------------------
def test_rollout_matches_a_python_loop(rnn, short):
    """Two rollouts in a row with terminations and truncations: every step's state, log-prob,
    value and bootstrap value V(final_obs) equal a plain loop that resets the state exactly at
    episode starts and bootstraps from the state after the step (never the reset one)."""
    config, train = short
    network = rnn.make_networks(config, 2, (2,)).actor_critic
    rollout = jax.jit(train.rollout)
    runner = jax.jit(train.init)(jax.random.PRNGKey(0))
    saw = {"terminated": 0, "truncated": 0}
    for key in jax.random.split(jax.random.PRNGKey(1), 2):
        hidden, start = np.asarray(runner.hidden), np.asarray(runner.episodes.episode_length == 0)
        episodes, new_hidden, tr = jax.device_get(rollout(runner.params, runner.episodes, runner.hidden, key))
        np.testing.assert_array_equal(tr.start[0], start)
        np.testing.assert_array_equal(tr.start[1:], tr.done[:-1])  # done at t: step t+1 starts an episode
        np.testing.assert_array_equal(episodes.episode_length == 0, tr.done[-1])

        want = python_loop(network, runner.params, hidden, tr.obs, tr.start, tr.final_obs)
        log_prob = np.take_along_axis(jax.nn.log_softmax(want["logits"]), tr.action[..., None], -1)[..., 0]
        np.testing.assert_allclose(tr.log_prob, log_prob, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(tr.value, want["value"], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(tr.next_value, want["next_value"], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(new_hidden, want["after"][-1], rtol=1e-5, atol=1e-6)  # not reset

        # Where no episode ended, V(final_obs) is the next step's value: the same obs and state.
        going_on = ~tr.done[:-1]
        np.testing.assert_allclose(tr.next_value[:-1][going_on], tr.value[1:][going_on], rtol=1e-5, atol=1e-5)
        # At a truncation the state matters: bootstrapping from a reset state would differ.
        truncated = tr.done & ~tr.terminated
        reset_value = jax.jit(network.apply)(runner.params, np.zeros_like(want["after"]), tr.final_obs)[2]
        assert (np.abs(tr.next_value - reset_value)[truncated] > 1e-6).all()

        # The update relearns from the same sequences: replayed from the stored state, they give
        # back what acted.
        _, logits, value = replay(network, runner.params, hidden, tr.obs, tr.start)
        replayed = np.take_along_axis(jax.nn.log_softmax(logits), tr.action[..., None], -1)[..., 0]
        np.testing.assert_allclose(replayed, tr.log_prob, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(value, tr.value, rtol=1e-5, atol=1e-5)

        saw["terminated"] += int(tr.terminated.sum())
        saw["truncated"] += int(truncated.sum())
        runner = runner._replace(episodes=episodes, hidden=new_hidden)
    assert saw["terminated"] > 0 and saw["truncated"] > 0, saw


def test_first_gradient_step_sees_ratio_one(short):
    """One epoch of one minibatch per update: the only gradient step replays the policy that
    acted, through the update's own env shuffle, so the ratio is 1 (KL 0, nothing clipped) on
    every update, with truncations and terminations in the rollouts."""
    config, train = short
    _, metrics = jax.device_get(jax.jit(train)(jax.random.PRNGKey(1)))
    assert metrics["finite"].all() and (metrics["episodes_finished"] > 0).all()
    np.testing.assert_allclose(metrics["approx_kl"], 0.0, atol=1e-7)
    np.testing.assert_array_equal(metrics["clip_fraction"], 0.0)
    assert (metrics["grad_norm"] > 0).all()  # and yet it learns: params move between updates


# --------------------------------------------------------------------------------------
# Environments
# --------------------------------------------------------------------------------------
def test_no_velocity_wrapper_is_cartpole_with_positions_only(rnn):
    vec_env = rnn.VecEnv(ENV, 1)
    env, params = vec_env.env, vec_env.params
    full, full_params = gymnax.make("CartPole-v1")
    assert params == full_params
    space, full_space = env.observation_space(params), full.observation_space(full_params)
    assert space.shape == (2,) and env.action_space(params).n == 2
    assert env.name == full.name  # CartPole's class: gymnax draws its states (--render)
    np.testing.assert_array_equal(space.low, np.asarray(full_space.low)[[0, 2]])
    np.testing.assert_array_equal(space.high, np.asarray(full_space.high)[[0, 2]])

    # Same keys and actions through gymnax's own step (auto-reset included), with a time limit
    # short enough that random play truncates as well as terminates.
    params = params.replace(max_steps_in_episode=SHORT_LIMIT)

    def run(env, key):
        reset_key, key = jax.random.split(key)
        obs, state = env.reset(reset_key, params)

        def step(carry, key):
            obs, state = carry
            action_key, step_key = jax.random.split(key)
            action = jax.random.randint(action_key, (), 0, 2)
            next_obs, state, reward, terminated, truncated, info = env.step(step_key, state, action, params)
            return (next_obs, state), (obs, state, reward, terminated, truncated, info["final_observation"])

        return jax.lax.scan(step, (obs, state), jax.random.split(key, 200))[1]

    key = jax.random.PRNGKey(7)
    obs, state, reward, terminated, truncated, final_obs = jax.jit(lambda k: run(env, k))(key)
    f_obs, f_state, f_reward, f_terminated, f_truncated, f_final_obs = jax.jit(lambda k: run(full, k))(key)
    np.testing.assert_array_equal(obs, f_obs[:, [0, 2]])
    np.testing.assert_array_equal(final_obs, f_final_obs[:, [0, 2]])
    jax.tree.map(np.testing.assert_array_equal, state, f_state)
    for got, want in ((reward, f_reward), (terminated, f_terminated), (truncated, f_truncated)):
        np.testing.assert_array_equal(got, want)
    assert terminated.any() and truncated.any()


def test_vec_env_names_and_refusals(rnn):
    assert ENV in gymnax.registered_envs and rnn.VecEnv(ENV, 3).obs_shape == (2,)  # registered by validate
    with pytest.raises(rnn.ConfigError, match="--env-name") as error:
        rnn.VecEnv("Nope-v0", 3)
    # The refusal names the bad name and the list to choose from, which holds the partial envs.
    assert "Nope-v0" in str(error.value) and "gymnax.registered_envs" in str(error.value)
    with pytest.raises(rnn.ConfigError, match="continuous"):
        rnn.VecEnv("Pendulum-v1", 3)
    env = rnn.VecEnv("MemoryChain-bsuite", 3)
    assert env.env.action_space(env.params).n == env.num_actions == 2


@pytest.mark.slow
def test_memory_chain_smoke(rnn):
    """A smoke test, not a learning test: a few updates on MemoryChain-bsuite run and stay finite.
    That ppo_rnn.py learns it (and ppo.py does not) is shown by benchmarks/bench_results.py."""
    config = rnn.Config(
        env_name="MemoryChain-bsuite",
        num_envs=4,
        num_steps=8,
        total_timesteps=4 * 8 * 2,
        num_minibatches=2,
        hidden_size=8,
    )
    _, metrics = jax.jit(rnn.make_train(config))(jax.random.PRNGKey(0))
    assert np.asarray(metrics["finite"]).all()
