"""PQN with its default Config solves CartPole-v1 on every seed (the expensive test)."""
import jax
import numpy as np
import pytest
from conftest import load_algorithm

SOLVED = 475.0  # CartPole-v1's own "solved" threshold (episodes are capped at 500)


@pytest.fixture(scope="module")
def pqn():
    return load_algorithm("pqn")


@pytest.mark.timeout(900)
def test_default_config_solves_cartpole_on_every_seed(pqn):
    config = pqn.Config()
    assert config.env_name == "CartPole-v1"
    assert config.num_seeds >= 8, "the default must train several seeds side by side"
    # The same seeds the command line uses for this config.
    keys = jax.random.split(jax.random.PRNGKey(config.seed), config.num_seeds)
    runner, metrics = jax.jit(jax.vmap(pqn.make_train(config)))(keys)
    metrics = jax.device_get(metrics)

    assert metrics["finite"].all()
    assert metrics["episode_return"].shape == (config.num_seeds, config.num_updates)
    # Training episodes are epsilon-greedy: they are scored at the configured final epsilon.
    np.testing.assert_allclose(metrics["epsilon"][:, -1], config.eps_end, rtol=1e-6)
    finals = pqn.final_returns(metrics)
    assert finals.shape == (config.num_seeds,)
    assert not np.isnan(finals).any(), f"a seed finished no episode near the end: {finals}"
    assert (finals >= SOLVED).all(), f"final returns per seed: {np.round(finals, 1)}"
