"""pqn_vdn.py: the team's Q and its Q(lambda) targets against NumPy on hand-made trajectories with terminations and
truncations, per agent; and, trained end to end, a never-ending env cut by a time limit, whose team value is
num_agents / (1 - gamma), not what a termination there would teach."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_ippo import never_ending
from test_q_lambda import reference_backward

from conftest import TERMINATED, TRUNCATED, load_algorithm

AGENTS, ACTIONS = 3, 4


@pytest.fixture(scope="module")
def vdn():
    return load_algorithm("pqn_vdn")


def test_team_q_is_the_sum_of_each_agents_q_of_its_action(vdn):
    rng = np.random.default_rng(0)
    q = rng.normal(size=(5, 2, AGENTS, ACTIONS)).astype(np.float32)
    action = rng.integers(0, ACTIONS, size=(5, 2, AGENTS))
    got = np.asarray(vdn.team_q(jnp.asarray(q), jnp.asarray(action)))
    for t, n in np.ndindex(5, 2):
        np.testing.assert_allclose(got[t, n], sum(q[t, n, i, action[t, n, i]] for i in range(AGENTS)), rtol=1e-6)


@pytest.mark.parametrize("gamma, lam", [(0.9, 0.3), (0.99, 0.65), (0.5, 1.0), (0.9, 0.0)])
def test_team_targets_match_numpy(vdn, gamma, lam):
    """What make_batch computes from a rollout: the agents' rewards summed, bootstrapped from the sum of each agent's
    highest Q-value of its true next observation, through Q(lambda) with conftest's terminations and truncations
    (one env per column; an episode ends for all its agents at once)."""
    rng = np.random.default_rng(1)
    agent_reward = rng.normal(size=(*TERMINATED.shape, AGENTS)).astype(np.float32)
    final_q = rng.normal(size=(*TERMINATED.shape, AGENTS, ACTIONS)).astype(np.float32)
    done = jnp.asarray(TERMINATED | TRUNCATED)
    q = jnp.asarray(final_q)
    next_q = vdn.team_q(q, q.argmax(-1))
    team = vdn.team_reward(jnp.asarray(agent_reward))
    got = jax.jit(vdn.compute_q_lambda)(team, next_q, jnp.asarray(TERMINATED, jnp.float32), done, gamma, lam)
    T, N = TERMINATED.shape
    want_reward = np.array([[sum(agent_reward[t, n, i] for i in range(AGENTS)) for n in range(N)] for t in range(T)])
    want_next_q = np.array([[sum(max(final_q[t, n, i]) for i in range(AGENTS)) for n in range(N)] for t in range(T)])
    want = reference_backward(want_reward, want_next_q, TERMINATED, TRUNCATED, gamma, lam)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_a_time_limit_is_bootstrapped_for_the_team(vdn):
    """Trained on never_ending's env (2 agents, 1 each per step) with gamma 0.9, the team's greedy Q_tot of its
    observations is 2 / (1 - 0.9) = 20 within 5%; a truncation taken for a termination teaches 13.6 (checked by
    breaking it)."""
    config = vdn.Config(gamma=0.9, lr=3e-3, num_envs=8, num_steps=16, num_minibatches=4, total_timesteps=8 * 16 * 150)
    config = vdn.dataclasses.replace(config, num_seeds=1, eps_fraction=0.0, hidden_size=64)
    env = vdn.VecEnv("NeverEnding", config.num_envs, env=never_ending(vdn))
    runner, metrics = jax.jit(vdn.make_train(config, env))(jax.random.PRNGKey(0))
    assert bool(metrics["finite"].all()) and np.asarray(metrics["episode_length"])[-1] == 21
    q = vdn.make_networks(config, 2, (3,), 2).q.apply(runner.params["q"], jnp.ones((2, 3)))
    np.testing.assert_allclose(vdn.team_q(q, q.argmax(-1)), 20.0, rtol=0.05)
