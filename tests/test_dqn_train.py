"""dqn.make_train on tiny configs: interval bookkeeping, vmap consistency, determinism, sweeps,
metrics, time-limit truncations in the buffer, the replay buffers' memory estimate.

Every compiled program here is built once per module (fixtures) and shared between tests.
"""

import jax
import numpy as np
import pytest

from conftest import load_algorithm
from onefile_harness import plan, protocol


@pytest.fixture(scope="module")
def name():
    """The algorithm whose small config conftest's config/train/single/batched fixtures build."""
    return "dqn"


@pytest.fixture(scope="module")
def dqn():
    return load_algorithm("dqn")


@pytest.fixture(scope="module")
def wide(dqn):
    """More envs than either interval: 2-3 gradient steps and 1-2 target updates per vectorized step."""
    return dqn.Config(
        env_name="CartPole-v1",
        num_envs=10,
        num_steps=4,
        total_timesteps=10 * 4 * 3,
        buffer_size=64,
        batch_size=8,
        learning_starts=45,
        train_frequency=4,
        target_update_frequency=7,
        tau=0.5,
        anneal_lr=False,
        num_seeds=1,
    )


@pytest.fixture(scope="module")
def wide_run(dqn, wide, keys):
    return jax.device_get(jax.jit(jax.vmap(dqn.make_train(wide)))(keys[:2]))


def row(tree, i):
    return jax.tree.map(lambda x: x[i], tree)


def reference_counts(config, interval):
    """Per update: env-step counts s (1-based, all envs together) with s % interval == 0 and
    s > learning_starts, counted one env step at a time."""
    per_update = config.num_envs * config.num_steps
    counts = np.zeros(config.num_updates, int)
    for s in range(1, config.num_updates * per_update + 1):
        if s % interval == 0 and s > config.learning_starts:
            counts[(s - 1) // per_update] += 1
    return counts


def adam_count(opt_state):
    counts = [
        leaf for path, leaf in jax.tree_util.tree_leaves_with_path(opt_state) if "count" in jax.tree_util.keystr(path)
    ]
    assert counts, opt_state
    return np.asarray(counts[0])


@pytest.mark.parametrize("which", ["config", "wide"])
def test_interval_bookkeeping_for_any_num_envs(dqn, request, which, single, wide_run):
    config = request.getfixturevalue(which)
    runner, metrics = single[0] if which == "config" else wide_run
    want_grad = reference_counts(config, config.train_frequency)
    want_target = reference_counts(config, config.target_update_frequency)
    assert config.num_envs % config.train_frequency and config.target_update_frequency % config.num_envs
    trained = config.num_updates * config.num_envs * config.num_steps
    L = config.learning_starts
    # The closed form the schedule promises: every multiple of the interval after learning_starts.
    assert want_grad.sum() == trained // config.train_frequency - L // config.train_frequency
    assert want_target.sum() == trained // config.target_update_frequency - L // config.target_update_frequency
    assert want_grad.sum() == dqn.total_gradient_steps(config)
    assert (want_grad == 0).any() and (want_grad > 0).any()

    grad_steps = np.asarray(metrics["gradient_steps"]).reshape(-1, config.num_updates)
    target_updates = np.asarray(metrics["target_updates"]).reshape(-1, config.num_updates)
    for g, t in zip(grad_steps, target_updates, strict=False):
        np.testing.assert_array_equal(g, want_grad)
        np.testing.assert_array_equal(t, want_target)
    # The optimizer really took that many steps (Adam's own step counter).
    np.testing.assert_array_equal(adam_count(runner.opt_state), want_grad.sum())
    # Gradient statistics exist exactly in updates that had gradient steps.
    loss = np.asarray(metrics["loss"]).reshape(grad_steps.shape)
    np.testing.assert_array_equal(np.isnan(loss), grad_steps == 0)


def test_hard_target_update_copies_the_online_network(config, single):
    """Env step 120 (the last) is a multiple of both intervals: the gradient step comes first,
    then the copy, so the run ends with target == online."""
    runner, _ = single[0]
    total = config.num_updates * config.num_envs * config.num_steps
    assert config.tau == 1.0 and total % config.train_frequency == 0 and total % config.target_update_frequency == 0
    jax.tree.map(np.testing.assert_array_equal, runner.target_params, runner.params)


def test_soft_target_update_lags_the_online_network(wide_run):
    runner, _ = wide_run
    differ = [
        not np.allclose(a, b)
        for a, b in zip(jax.tree.leaves(runner.target_params), jax.tree.leaves(runner.params), strict=False)
    ]
    assert any(differ)


def test_vmapped_seeds_fill_their_own_buffers(batched):
    runner, _ = batched
    assert not np.array_equal(runner.buffer.data.obs[0], runner.buffer.data.obs[1])


def test_epsilon_schedule_and_buffer_position(config, single):
    runner, metrics = single[0]
    U = config.num_updates
    assert (np.nan_to_num(metrics["grad_norm"], nan=1.0) > 0).all()
    # Epsilon of the last vectorized step of each update: linear from eps_start to eps_end.
    last_step = (np.arange(U) * config.num_steps + config.num_steps - 1) * config.num_envs
    progress = np.minimum(last_step / (config.eps_fraction * config.total_timesteps), 1.0)
    want = config.eps_start + (config.eps_end - config.eps_start) * progress
    np.testing.assert_allclose(metrics["epsilon"], want, rtol=1e-6)
    assert want[-1] == pytest.approx(config.eps_end) and want[0] > config.eps_end + 0.1

    # 120 transitions went through a 50-slot buffer: full, next write at slot 120 % 50.
    assert runner.buffer.size == config.buffer_size and runner.buffer.position == 120 % config.buffer_size


def test_time_limit_truncation_is_stored_as_not_terminated(dqn, monkeypatch):
    """With a 5-step time limit every episode is cut off (a pole cannot fall in 5 steps): the
    stored transitions must say not terminated, with final_obs the state the limit cut off."""
    limit = 5

    class ShortEpisodes(dqn.VecEnv):
        def __init__(self, env_name, num_envs):
            super().__init__(env_name, num_envs)
            self.params = self.params.replace(max_steps_in_episode=limit)
            self.max_episode_steps = limit

    monkeypatch.setattr(dqn, "VecEnv", ShortEpisodes)
    N, T = 2, 10
    config = dqn.Config(
        num_envs=N,
        num_steps=T,
        total_timesteps=N * T * 2,
        buffer_size=N * T * 2,
        learning_starts=N * T,
        batch_size=8,
        train_frequency=5,
        target_update_frequency=10,
        num_seeds=1,
    )
    runner, metrics = jax.device_get(jax.jit(dqn.make_train(config))(jax.random.PRNGKey(0)))
    np.testing.assert_array_equal(metrics["episodes_finished"], N * T // limit)
    np.testing.assert_array_equal(metrics["episode_length"], limit)
    data = runner.buffer.data  # slot k * N + e: vectorized step k, env e
    steps = 2 * T
    obs = data.obs.reshape(steps, N, -1)
    final_obs = data.final_obs.reshape(steps, N, -1)
    assert not data.terminated.any()
    cut = (np.arange(steps) + 1) % limit == 0
    # Within an episode the next stored obs is this transition's final_obs; at the limit it is a
    # fresh start instead, while final_obs keeps the cut-off state.
    same = (obs[1:] == final_obs[:-1]).all(-1)
    np.testing.assert_array_equal(same, np.broadcast_to(~cut[:-1, None], same.shape))
    assert metrics["finite"].all() and (metrics["gradient_steps"][1:] > 0).all()


def test_memory_estimate_refuses_impossible_buffers(dqn):
    """The run harness sizes the replay buffers from train.init's shapes, computed without making
    them; validate checks values only."""
    algo = protocol.load(dqn)
    runner = jax.eval_shape(dqn.make_train(dqn.Config(num_envs=1, buffer_size=1)).init, jax.random.PRNGKey(0))
    per_transition = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(runner.buffer.data))
    assert per_transition == 2 * 4 * 4 + 4 + 4 + 1  # CartPole: 4 floats of obs
    available, _ = plan.available_memory()
    # Two runs need 90% of the memory available now, three 135%: margins for other processes.
    buffer_size = int(0.45 * available / per_transition)
    config = dqn.Config(buffer_size=buffer_size, num_seeds=3)
    dqn.validate(config)
    train = dqn.make_train(config)
    per_run = buffer_size * per_transition + 4 + 4  # and the buffer's position and size (int32)
    with pytest.raises(protocol.UsageError, match="--buffer-size") as error:
        plan.check_memory(algo, config, train, 3)
    assert plan.readable_bytes(3 * per_run) in str(error.value) and "memory" in str(error.value)
    plan.check_memory(algo, config, train, 2)  # two runs fit
