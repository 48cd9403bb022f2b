"""DQN with its default Config solves CartPole-v1 on every seed (the expensive test)."""
import jax
import numpy as np
import pytest
from conftest import load_algorithm

SOLVED = 475.0  # CartPole-v1's own "solved" threshold (episodes are capped at 500)


@pytest.mark.timeout(900)
def test_default_config_solves_cartpole_on_every_seed():
    dqn = load_algorithm("dqn")
    config = dqn.Config()
    assert config.env_name == "CartPole-v1"
    assert config.num_seeds >= 4, "the default must train several seeds side by side"
    # The same seeds the command line uses for this config.
    keys = jax.random.split(jax.random.PRNGKey(config.seed), config.num_seeds)
    runner, metrics = jax.jit(jax.vmap(dqn.make_train(config)))(keys)
    metrics = jax.device_get(metrics)

    assert metrics["finite"].all()
    assert metrics["episode_return"].shape == (config.num_seeds, config.num_updates)
    np.testing.assert_array_equal(metrics["gradient_steps"].sum(-1), dqn.total_gradient_steps(config))
    finals = dqn.final_returns(metrics)
    assert finals.shape == (config.num_seeds,)
    assert not np.isnan(finals).any(), f"a seed finished no episode near the end: {finals}"
    assert (finals >= SOLVED).all(), f"final returns per seed: {np.round(finals, 1)}"

    # The greedy policy (no exploration) does at least as well on fresh episodes.
    eval_keys = jax.random.split(jax.random.PRNGKey(config.seed + 1), config.num_seeds)
    greedy = np.asarray(jax.jit(jax.vmap(dqn.make_evaluate(config)))(runner.params, eval_keys))
    assert (greedy >= SOLVED).all(), f"greedy evaluation returns per seed: {np.round(greedy, 1)}"
