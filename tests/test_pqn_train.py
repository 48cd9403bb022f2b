"""pqn.make_train on a tiny config: vmap consistency, determinism, sweeps, epsilon schedule,
metric bookkeeping.

Every compiled program here is built once per module (fixtures) and shared between tests.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import load_algorithm

METRIC_NAMES = {"env_steps", "episode_return", "episode_length", "episodes_finished", "loss", "q_mean",
                "epsilon", "grad_norm", "finite"}


@pytest.fixture(scope="module")
def name():
    """The algorithm whose small config conftest's config/train/single/batched fixtures build."""
    return "pqn"


@pytest.fixture(scope="module")
def pqn():
    return load_algorithm("pqn")


def test_different_keys_differ(train, keys, single, batched):
    init = jax.jit(train.init)
    params = [jax.device_get(init(key).params) for key in keys[:2]]
    again = jax.device_get(init(keys[0]).params)
    jax.tree.map(np.testing.assert_array_equal, params[0], again)
    kernels = 0
    for a, b in zip(jax.tree.leaves(params[0]), jax.tree.leaves(params[1])):
        if np.abs(a - 1).sum() > 0 and np.abs(a).sum() > 0:  # biases start at 0, LayerNorm scales at 1
            assert not np.array_equal(a, b)
            kernels += 1
    assert kernels == 3  # two hidden Dense kernels and the output kernel
    # The vmapped seeds start from different parameters too (not one copy broadcast).
    (_, metrics_a), (_, metrics_b), _ = single
    assert not np.array_equal(metrics_a["loss"], metrics_b["loss"])
    assert not np.array_equal(metrics_a["q_mean"], metrics_b["q_mean"])
    runner, _ = batched
    for leaf in jax.tree.leaves(runner.params):
        assert not np.array_equal(leaf[0], leaf[1])


def test_epsilon_metric_follows_the_configured_schedule(config, batched):
    """0.9 -> 0.1 over half of the 6 updates (3 updates), then flat: 0.9, 0.633, 0.367, 0.1, 0.1, 0.1."""
    _, metrics = batched
    decay_updates = config.eps_decay * config.num_updates
    want = [config.eps_start + (config.eps_end - config.eps_start) * min(1.0, u / decay_updates)
            for u in range(config.num_updates)]
    np.testing.assert_allclose(metrics["epsilon"], np.broadcast_to(want, metrics["epsilon"].shape), rtol=1e-6)


def test_epsilon_is_the_exploration_rate(pqn):
    """With epsilon 1 throughout the agent acts uniformly at random whatever its Q-values: a
    random CartPole policy's episodes last ~22 steps; with epsilon 0 a fresh network's greedy
    policy mostly pushes one way and falls in ~10. Only the sweepable epsilon differs."""
    config = pqn.Config(num_envs=16, num_steps=32, total_timesteps=16 * 32 * 4, num_minibatches=2,
                        update_epochs=1, hidden_size=32, lr=1e-9, eps_start=1.0, eps_end=1.0, num_seeds=1)
    train = pqn.make_train(config)
    hparams = jax.tree.map(lambda x: jnp.stack([x, x]), pqn.hparams_from(config))._replace(
        eps_start=jnp.array([1.0, 0.0]), eps_end=jnp.array([1.0, 0.0]))
    keys = jax.random.split(jax.random.PRNGKey(7), 4)
    _, metrics = jax.device_get(jax.jit(jax.vmap(jax.vmap(train, (0, None)), (None, 0)))(keys, hparams))
    lengths = metrics["episode_length"] * metrics["episodes_finished"]
    mean_length = np.nansum(lengths, axis=(1, 2)) / metrics["episodes_finished"].sum(axis=(1, 2))
    np.testing.assert_allclose(metrics["epsilon"][0], 1.0)
    np.testing.assert_allclose(metrics["epsilon"][1], 0.0)
    assert 18 < mean_length[0] < 27, mean_length
    assert mean_length[1] < 15, mean_length


def test_metric_shapes_and_bookkeeping(config, single, batched):
    runner, metrics = single[0]
    assert METRIC_NAMES == set(metrics)
    U = config.num_updates
    for name, value in metrics.items():
        assert np.shape(value) == (U,), name
    _, all_metrics = batched
    for name, value in all_metrics.items():
        assert np.shape(value) == (3, U), name

    # env_steps: cumulative over all envs.
    np.testing.assert_array_equal(metrics["env_steps"], np.arange(1, U + 1) * config.batch_size)

    finished = all_metrics["episodes_finished"]
    assert np.issubdtype(finished.dtype, np.integer)
    assert (finished >= 0).all()
    # NaN exactly where no episode ended; both cases must occur for this check to mean anything.
    assert (finished == 0).any() and (finished > 0).any()
    for name in ("episode_return", "episode_length"):
        np.testing.assert_array_equal(np.isnan(all_metrics[name]), finished == 0, err_msg=name)

    assert metrics["finite"].dtype == bool and all_metrics["finite"].all()
    for name in METRIC_NAMES - {"finite"}:
        assert np.isfinite(np.nan_to_num(all_metrics[name], nan=0.0)).all(), name
    assert (all_metrics["grad_norm"] > 0).all()
    assert (all_metrics["loss"] > 0).all()


def test_episode_accounting_adds_up(config, single, batched):
    """Every env step belongs to a finished episode (logged) or to the episode still running
    (in the runner). CartPole pays 1 per step, so a return equals its length."""
    runner, metrics = batched
    finished = metrics["episodes_finished"]
    lengths = np.where(finished > 0, metrics["episode_length"], 0.0) * finished
    total = lengths.sum(-1) + runner.episode_length.sum(-1)
    np.testing.assert_allclose(total, config.num_updates * config.batch_size, rtol=1e-6)
    np.testing.assert_array_equal(metrics["episode_return"], metrics["episode_length"])
    np.testing.assert_array_equal(runner.episode_return, runner.episode_length)
    valid = finished > 0
    assert (metrics["episode_length"][valid] >= 1).all()
    assert (metrics["episode_length"][valid] <= 500).all()


def test_greedy_evaluation_follows_the_q_network(pqn, config):
    """evaluate() acts greedily on the Q-values it is given: a Q-network whose output layer
    prefers one action whatever the input pushes the cart one way (episodes of ~10 steps)."""
    evaluate = jax.jit(pqn.make_evaluate(config))
    params = jax.jit(pqn.make_train(config).init)(jax.random.PRNGKey(0)).params["q"]
    out = params["params"]["Dense_2"]
    params["params"]["Dense_2"] = {"kernel": jnp.zeros_like(out["kernel"]), "bias": jnp.array([0.0, 1.0])}
    result = float(evaluate(params, jax.random.PRNGKey(1)))
    assert 7 <= result <= 15, result
