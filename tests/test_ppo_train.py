"""ppo.make_train on a tiny config: metric bookkeeping, episode accounting, final returns (the checks
every algorithm shares are in tests/test_train.py).

Every compiled program here is built once per module (fixtures) and shared between tests.
"""

import math

import jax
import numpy as np
import pytest

from onefile_harness import stats


@pytest.fixture(scope="module")
def name():
    """The algorithm whose small config conftest's config/train/single/batched fixtures build."""
    return "ppo"


def test_metric_ranges(batched):
    _, metrics = batched
    assert (metrics["entropy"] > 0).all() and (metrics["entropy"] <= math.log(2) + 1e-6).all()  # 2 actions
    assert ((metrics["clip_fraction"] >= 0) & (metrics["clip_fraction"] <= 1)).all()
    assert (metrics["approx_kl"] >= -1e-6).all()
    assert (metrics["grad_norm"] > 0).all()


def test_episode_return_is_nan_exactly_when_no_episode_ended(ppo):
    """4-step rollouts: no CartPole episode can end in the first update (it takes ~8 steps to
    fall), and over 30 updates some do, so both cases occur."""
    config = ppo.Config(num_envs=2, num_steps=4, num_minibatches=1, update_epochs=1, total_timesteps=2 * 4 * 30)
    _, metrics = jax.jit(ppo.make_train(config))(jax.random.PRNGKey(0))
    finished = np.asarray(metrics["episodes_finished"])
    assert finished[0] == 0 and (finished > 0).any()
    for name in ("episode_return", "episode_length"):
        np.testing.assert_array_equal(np.isnan(metrics[name]), finished == 0, err_msg=name)
        assert np.all(np.asarray(metrics[name])[finished > 0] > 0), name


def test_final_returns_weights_by_episode_count(ppo):
    U = 20
    returns = np.full((2, U), 1e6, np.float32)  # outside the window: must be ignored
    counts = np.full((2, U), 7, np.int32)
    # fraction 0.25 -> the last 5 updates.
    returns[0, -5:] = [10.0, np.nan, 30.0, 20.0, np.nan]
    counts[0, -5:] = [1, 0, 3, 1, 0]
    returns[1, -5:] = np.nan
    counts[1, -5:] = 0
    metrics = {"episode_return": returns, "episodes_finished": counts}
    got = stats.final_returns(metrics, fraction=0.25)
    assert got.shape == (2,)
    assert got[0] == pytest.approx((10 * 1 + 30 * 3 + 20 * 1) / 5)
    assert np.isnan(got[1])  # no episode ended in the window

    # Default: the last 5% of 40 updates = the last 2.
    returns = np.full(40, 1e6, np.float32)
    counts = np.full(40, 2, np.int32)
    returns[-2:] = [100.0, 400.0]
    counts[-2:] = [3, 1]
    got = stats.final_returns({"episode_return": returns, "episodes_finished": counts})
    assert float(got) == pytest.approx((100 * 3 + 400) / 4)

    # Fewer updates than 1/fraction: still at least the last update.
    got = stats.final_returns({"episode_return": np.array([5.0, 9.0]), "episodes_finished": np.array([1, 2])})
    assert float(got) == pytest.approx(9.0)
