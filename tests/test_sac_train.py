"""sac.make_train on the small config of tests/specs/sac.py (4 Pendulum envs, a gradient step
every 3 env steps, learning from env step 100): the gradient-step schedule for a num_envs that
does not divide the interval, the learned temperature, and what the replay buffer holds at a
time-limit truncation. The program is compiled once per session (conftest's `single`), shared
with tests/test_train.py."""

import jax
import numpy as np
import pytest

from conftest import load_algorithm


@pytest.fixture(scope="module")
def name():
    """The algorithm whose small config conftest's config/train/single/batched fixtures build."""
    return "sac"


@pytest.fixture(scope="module")
def sac():
    return load_algorithm("sac")


def reference_counts(config, interval, per_round=1):
    """Per update: env-step counts s (1-based, all envs together) with s % interval == 0 and
    s > learning_starts, counted one env step at a time, times the steps each one owes."""
    per_update = config.num_envs * config.num_steps
    counts = np.zeros(config.num_updates, int)
    for s in range(1, config.num_updates * per_update + 1):
        if s % interval == 0 and s > config.learning_starts:
            counts[(s - 1) // per_update] += per_round
    return counts


def adam_count(opt_state):
    counts = [
        leaf for path, leaf in jax.tree_util.tree_leaves_with_path(opt_state) if "count" in jax.tree_util.keystr(path)
    ]
    assert counts, opt_state
    return np.asarray(counts[0])


def test_gradient_step_schedule_for_any_num_envs(sac, config, single):
    runner, metrics = single[0]
    assert config.num_envs % config.train_frequency and config.train_frequency % config.num_envs
    want = reference_counts(config, config.train_frequency, config.gradient_steps)
    trained = config.num_updates * config.num_envs * config.num_steps
    assert want.sum() == trained // config.train_frequency - config.learning_starts // config.train_frequency
    assert want.sum() == sac.total_gradient_steps(config)
    np.testing.assert_array_equal(metrics["gradient_steps"], want)
    np.testing.assert_array_equal(adam_count(runner.opt_state), want.sum())  # one Adam over everything
    for metric in ("loss", "actor_loss", "q_mean", "entropy", "grad_norm"):
        np.testing.assert_array_equal(np.isnan(metrics[metric]), want == 0, err_msg=metric)


def test_learned_temperature_moves_and_targets_lag(config, single):
    runner, metrics = single[0]
    assert config.alpha == 0  # learned, from alpha = 1
    assert (metrics["alpha"] > 0).all() and (metrics["alpha"] != 1.0).all()
    assert float(np.exp(runner.params["log_alpha"])) == pytest.approx(metrics["alpha"][-1], rel=1e-6)
    # Polyak-averaged (tau < 1) target critics trail the critics.
    pairs = zip(jax.tree.leaves(runner.target_params["critic"]), jax.tree.leaves(runner.params["critic"]), strict=True)
    assert any(not np.allclose(a, b) for a, b in pairs)


def test_buffer_holds_time_limit_truncations_as_not_terminated(config, single):
    """Pendulum never terminates; its 200-step limit truncates every episode at the run's last step.
    The buffer (not wrapped: it holds exactly the run) stores no termination, each transition's
    final_obs is the next transition's obs within an episode, and the truncated step's final_obs
    is the state the limit cut off, not the reset observation the env continued from."""
    runner, _ = single[0]
    N, steps = config.num_envs, config.num_updates * config.num_steps
    assert config.buffer_size == N * steps and int(runner.buffer.size) == config.buffer_size
    data = runner.buffer.data  # slot t * N + e: vectorized step t, env e
    assert not data.terminated.any()
    obs, final_obs = data.obs.reshape(steps, N, -1), data.final_obs.reshape(steps, N, -1)
    np.testing.assert_array_equal(obs[1:], final_obs[:-1])
    assert (np.abs(final_obs[-1] - runner.episodes.obs).max(-1) > 0).all()
    actions = data.action
    assert actions.shape == (N * steps, 1) and (np.abs(actions) <= 1).all()
    # Before learning_starts the actions are uniform in [-1, 1]; the early policy's are not.
    early = actions[: config.learning_starts, 0]
    assert early.min() < -0.5 and early.max() > 0.5
