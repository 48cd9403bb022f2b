"""pqn.make_train on a tiny config: vmap consistency, determinism, sweeps, epsilon schedule,
metric bookkeeping.

Every compiled program here is built once per module (fixtures) and shared between tests.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import load_algorithm

# Tolerance for runs that must agree up to float reassociation (batched vs unbatched XLA code).
RTOL, ATOL = 1e-5, 1e-6
METRIC_NAMES = {"env_steps", "episode_return", "episode_length", "episodes_finished", "loss", "q_mean",
                "epsilon", "grad_norm", "finite"}
OTHER_LR = 3e-3  # a learning rate that is not the config's


@pytest.fixture(scope="module")
def pqn():
    return load_algorithm("pqn")


@pytest.fixture(scope="module")
def config(pqn):
    # 4-step rollouts: no CartPole episode ends within the first update, later ones do.
    config = pqn.Config(env_name="CartPole-v1", num_envs=8, num_steps=4, total_timesteps=8 * 4 * 6,
                        num_minibatches=2, update_epochs=2, num_seeds=1, hidden_size=32,
                        eps_start=0.9, eps_end=0.1, eps_decay=0.5)
    assert config.num_updates == 6 and config.lr != OTHER_LR
    return config


@pytest.fixture(scope="module")
def train(pqn, config):
    return pqn.make_train(config)


@pytest.fixture(scope="module")
def keys():
    return jax.random.split(jax.random.PRNGKey(42), 3)


@pytest.fixture(scope="module")
def single(train, keys):
    """jax.jit(train) on keys 0 and 1, and on key 0 a second time."""
    run = jax.jit(train)
    return [jax.device_get(run(key)) for key in (keys[0], keys[1], keys[0])]


@pytest.fixture(scope="module")
def batched(train, keys):
    """jax.jit(jax.vmap(train)) on all three keys at once."""
    return jax.device_get(jax.jit(jax.vmap(train))(keys))


def assert_metrics_close(got, want, exact_keys=("env_steps", "episodes_finished", "finite")):
    assert set(got) == set(want)
    for name in want:
        if name in exact_keys:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
        else:
            np.testing.assert_allclose(got[name], want[name], rtol=RTOL, atol=ATOL, err_msg=name)


def assert_trees_close(got, want):
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL), got, want)


def row(tree, i):
    return jax.tree.map(lambda x: x[i], tree)


def test_vmapped_run_matches_single_runs(single, batched):
    runner, metrics = batched
    for i in (0, 1):
        single_runner, single_metrics = single[i]
        assert_metrics_close(row(metrics, i), single_metrics)
        assert_trees_close(row(runner.params, i), single_runner.params)
        # Episode bookkeeping is integer/step counting: identical, not merely close.
        for name in ("episode_return", "episode_length"):
            np.testing.assert_array_equal(row(metrics, i)[name], single_metrics[name], err_msg=name)


def test_same_key_same_result(single):
    (runner_a, metrics_a), _, (runner_b, metrics_b) = single
    for name in metrics_a:
        np.testing.assert_array_equal(metrics_a[name], metrics_b[name], err_msg=name)
    jax.tree.map(np.testing.assert_array_equal, runner_a.params, runner_b.params)


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


def test_sweep_point_equals_run_with_that_config(pqn, config, keys, single):
    """vmap over HParams(lr=[OTHER_LR, config.lr]) of a program built for lr=OTHER_LR: the
    second point must be the run whose Config says lr=config.lr."""
    other = dataclasses.replace(config, lr=OTHER_LR)
    train_other = pqn.make_train(other)
    hparams = pqn.hparams_from(other)
    hparams = jax.tree.map(lambda x: jnp.stack([x, x]), hparams)._replace(
        lr=jnp.array([OTHER_LR, config.lr], jnp.float32))
    runner, metrics = jax.device_get(jax.jit(jax.vmap(train_other, in_axes=(None, 0)))(keys[0], hparams))

    single_runner, single_metrics = single[0]  # make_train(config)(keys[0])
    assert_metrics_close(row(metrics, 1), single_metrics)
    assert_trees_close(row(runner.params, 1), single_runner.params)
    np.testing.assert_allclose(runner.hparams.lr, [OTHER_LR, config.lr], rtol=1e-7)
    # The learning rate really is a run-time input: the two points train differently.
    assert not np.allclose(metrics["loss"][0], metrics["loss"][1], rtol=1e-3)


def test_chunked_run_matches_train(train, config, keys, single):
    """train.init + train.run in chunks (what the command line does) == train; updates past
    the config's end are skipped and leave the runner alone."""
    chunk = 4
    init = jax.jit(train.init)
    run = jax.jit(train.run, static_argnums=2)
    runner = init(keys[0])
    parts = []
    for first in range(0, 2 * chunk, chunk):  # updates 0..7 of 6
        runner, metrics = run(runner, jnp.int32(first), chunk)
        parts.append(jax.device_get(metrics))
    metrics = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    single_runner, single_metrics = single[0]
    assert_metrics_close({k: v[:config.num_updates] for k, v in metrics.items()}, single_metrics)
    assert_trees_close(jax.device_get(runner.params), single_runner.params)
    assert not metrics["finite"][config.num_updates:].any()  # skipped updates report nothing


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
