"""pqn.make_train on a tiny config: vmap consistency, determinism, sweeps, epsilon schedule, the
epsilon-greedy action, metric bookkeeping.

Every compiled program here is built once per module (fixtures) and shared between tests.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import load_algorithm


@pytest.fixture(scope="module")
def name():
    """The algorithm whose small config conftest's config/train/single/batched fixtures build."""
    return "pqn"


@pytest.fixture(scope="module")
def pqn():
    return load_algorithm("pqn")


def test_epsilon_metric_follows_the_configured_schedule(config, batched):
    """0.9 -> 0.1 over half of the 6 updates (3 updates), then flat: 0.9, 0.633, 0.367, 0.1, 0.1, 0.1."""
    _, metrics = batched
    decay_updates = config.eps_fraction * config.num_updates
    want = [
        config.eps_start + (config.eps_end - config.eps_start) * min(1.0, u / decay_updates)
        for u in range(config.num_updates)
    ]
    np.testing.assert_allclose(metrics["epsilon"], np.broadcast_to(want, metrics["epsilon"].shape), rtol=1e-6)


def test_epsilon_is_the_exploration_rate(pqn):
    """With epsilon 1 throughout the agent acts uniformly at random whatever its Q-values: a
    random CartPole policy's episodes last ~22 steps; with epsilon 0 a fresh network's greedy
    policy mostly pushes one way and falls in ~10. Only the sweepable epsilon differs."""
    config = pqn.Config(
        num_envs=16,
        num_steps=32,
        total_timesteps=16 * 32 * 4,
        num_minibatches=2,
        update_epochs=1,
        hidden_size=32,
        lr=1e-9,
        eps_start=1.0,
        eps_end=1.0,
        num_seeds=1,
    )
    train = pqn.make_train(config)
    hparams = jax.tree.map(lambda x: jnp.stack([x, x]), pqn.hparams_from(config))._replace(
        eps_start=jnp.array([1.0, 0.0]), eps_end=jnp.array([1.0, 0.0])
    )
    keys = jax.random.split(jax.random.PRNGKey(7), 4)
    _, metrics = jax.device_get(jax.jit(jax.vmap(jax.vmap(train, (0, None)), (None, 0)))(keys, hparams))
    lengths = metrics["episode_length"] * metrics["episodes_finished"]
    mean_length = np.nansum(lengths, axis=(1, 2)) / metrics["episodes_finished"].sum(axis=(1, 2))
    np.testing.assert_allclose(metrics["epsilon"][0], 1.0)
    np.testing.assert_allclose(metrics["epsilon"][1], 0.0)
    assert 18 < mean_length[0] < 27, mean_length
    assert mean_length[1] < 15, mean_length


def test_epsilon_greedy_draws_from_its_key(pqn, config):
    """The acting rule itself, drawn where it is used: with epsilon 0 the greedy action; with epsilon
    e a uniformly random action with probability e (so it differs from the greedy one with probability
    e (A - 1) / A); the same key gives the same actions and other keys other ones."""
    networks = pqn.make_networks(config, 2, (4,))
    params = jax.jit(pqn.make_train(config).init)(jax.random.PRNGKey(0)).params
    obs = jax.random.normal(jax.random.PRNGKey(1), (20_000, 4))
    greedy = np.asarray(jnp.argmax(networks.q.apply(params["q"], obs), -1))
    act = jax.jit(lambda epsilon, key: pqn.epsilon_greedy(networks.q.apply(params["q"], obs), epsilon, key))
    key = jax.random.PRNGKey(2)
    np.testing.assert_array_equal(act(0.0, key), greedy)
    uniform = np.asarray(act(1.0, key))
    assert abs(uniform.mean() - 0.5) < 0.02, uniform.mean()
    assert abs((np.asarray(act(0.3, key)) != greedy).mean() - 0.3 / 2) < 0.01
    np.testing.assert_array_equal(act(0.5, key), act(0.5, key))
    assert (np.asarray(act(0.5, key)) != np.asarray(act(0.5, jax.random.PRNGKey(3)))).any()


def test_metric_ranges(batched):
    _, metrics = batched
    finished = metrics["episodes_finished"]
    # 4-step rollouts: updates with and without a finished episode both occur (NaN vs value).
    assert (finished == 0).any() and (finished > 0).any()
    assert (metrics["grad_norm"] > 0).all() and (metrics["loss"] > 0).all()


def test_greedy_evaluation_follows_the_q_network(pqn, config):
    """evaluate() acts greedily on the Q-values it is given: a Q-network whose output layer
    prefers one action whatever the input pushes the cart one way (episodes of ~10 steps)."""
    evaluate = jax.jit(pqn.make_evaluate(config))
    params = jax.jit(pqn.make_train(config).init)(jax.random.PRNGKey(0)).params["q"]
    out = params["params"]["Dense_2"]
    params["params"]["Dense_2"] = {"kernel": jnp.zeros_like(out["kernel"]), "bias": jnp.array([0.0, 1.0])}
    result = float(evaluate({"q": params}, jax.random.PRNGKey(1)))
    assert 7 <= result <= 15, result
