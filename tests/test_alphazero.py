"""alphazero.py: the search over the env's own step (its Q-values and improved policy against NumPy on a hand-made
chain whose rewards and terminations are known), the value transform, the value targets (lambda-returns of the
critic's values with terminations and truncations, against NumPy), the loss, and the greedy act's plan."""

import dataclasses
import types

import chex
import gymnax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_gae import reference_gae

from conftest import TERMINATED, TRUNCATED, load_algorithm

GAMMA = 0.9
FIRST_REWARDS = np.array([1.0, 0.0, 0.5])  # at the chain's start: actions 0 and 2 end the episode, 1 goes on
SECOND_REWARDS = np.array([0.0, 2.0, 0.0])  # one step on: every action ends it


@pytest.fixture(scope="module")
def az():
    return load_algorithm("alphazero")


@chex.dataclass(frozen=True)
class ChainState:
    position: jax.Array  # 0: the start, 1: one step on, 2: ended
    time: jax.Array


class Chain(gymnax.environments.environment.Environment):
    """Three actions. At the start, action a earns FIRST_REWARDS[a]; 0 and 2 terminate, 1 moves on; there, action a
    earns SECOND_REWARDS[a] and terminates. The observation is the position, one-hot. With GAMMA, moving on is worth
    0 + 0.9 * 2 = 1.8, more than action 0's 1: only a search that looks two steps ahead finds it."""

    @property
    def default_params(self):
        return gymnax.environments.environment.EnvParams(max_steps_in_episode=10)

    def step_env(self, key, state, action, params):
        first = state.position == 0
        reward = jnp.where(first, jnp.asarray(FIRST_REWARDS)[action], jnp.asarray(SECOND_REWARDS)[action])
        terminated = ~first | (action != 1)
        state = ChainState(position=jnp.where(terminated, 2, 1), time=state.time + 1)
        return self.get_obs(state), state, reward, terminated, {}

    def reset_env(self, key, params):
        state = ChainState(position=jnp.int32(0), time=jnp.int32(0))
        return self.get_obs(state), state

    def get_obs(self, state, params=None, key=None):
        return jax.nn.one_hot(state.position, 3)

    def action_space(self, params=None):
        return gymnax.environments.spaces.Discrete(3)


CHAIN = types.SimpleNamespace(env=Chain(), params=Chain().default_params, num_actions=3, obs_shape=(3,))


def chain_params(az, config, value: float, seed: int = 0, obs_shape=(3,), num_actions=3):
    """The networks' parameters with the critic's output a constant: h(value), so every state's value is `value`."""
    networks = az.make_networks(config, num_actions, obs_shape)
    keys, obs = jax.random.split(jax.random.PRNGKey(seed)), jnp.zeros((1, *obs_shape))
    params = {"actor": networks.actor.init(keys[0], obs), "critic": networks.critic.init(keys[1], obs)}
    last = max(params["critic"]["params"], key=lambda name: int(name.split("_")[1]))
    layer = params["critic"]["params"][last]
    layer["kernel"] = jnp.zeros_like(layer["kernel"])
    layer["bias"] = jnp.full_like(layer["bias"], az.value_transform(jnp.float32(value)))
    return networks, params


def chain_start(batch: int):
    obs, state = Chain().reset_env(jax.random.PRNGKey(0), None)
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (batch, *jnp.shape(x))), (obs, state))


def test_the_search_scores_each_first_action_by_the_envs_step(az):
    """With as many simulations as actions, each first action is tried once: its Q is the env's reward plus
    GAMMA times the critic's value of the state it reaches, which a termination zeroes (Q = the reward alone, though
    the critic values every state at 5); the improved policy is softmax(prior logits + sigma(Q)) with mctx's sigma
    (50 + the most visits) * 0.1 * Q rescaled to [0, 1]."""
    config = az.Config(num_simulations=3)
    networks, params = chain_params(az, config, value=5.0)
    obs, state = chain_start(2)
    plan = az.search(config, networks, CHAIN, params, obs, state, jax.random.PRNGKey(1), jnp.float32(GAMMA))
    tree = plan.search_tree
    np.testing.assert_array_equal(tree.children_visits[:, 0], 1)
    want_q = FIRST_REWARDS + GAMMA * np.array([0.0, 5.0, 0.0])
    q = np.asarray(tree.qvalues(jnp.zeros(2, jnp.int32)))
    np.testing.assert_allclose(q, np.broadcast_to(want_q, q.shape), rtol=1e-4)  # h^-1(h(5)) in float32
    logits = np.asarray(networks.actor.apply(params["actor"], obs), np.float64)
    sigma = (50 + 1) * 0.1 * (want_q - want_q.min()) / (want_q.max() - want_q.min())
    want = np.exp(logits + sigma) / np.exp(logits + sigma).sum(-1, keepdims=True)
    np.testing.assert_allclose(plan.action_weights, want, rtol=1e-4)


@pytest.mark.parametrize("gamma, best", [(0.9, 1), (0.4, 0)])
def test_the_greedy_act_plans_two_steps_ahead(az, gamma, best):
    """With a critic that knows nothing (every value 0), the greedy act's search finds that moving on (0 + gamma * 2)
    beats action 0's 1 at gamma 0.9 and not at 0.4, whatever the key: the rewards come from the env's own step."""
    config = az.Config(num_simulations=32, gamma=gamma)
    _, params = chain_params(az, config, value=0.0)
    act = jax.jit(jax.vmap(az.make_act(config, env=CHAIN), in_axes=(None, 0, 0)))
    assert az.make_act(config, env=CHAIN).reads_state
    actions = act(params, chain_start(8), jax.random.split(jax.random.PRNGKey(2), 8))
    np.testing.assert_array_equal(actions, best)


def test_the_value_transform_and_its_inverse(az):
    """h(x) = sign(x) (sqrt(|x| + 1) - 1) + 0.001 x, in float64; h^-1(h(x)) = x over returns of any scale."""
    x = np.concatenate([-np.logspace(-3, 4, 50), [0.0], np.logspace(-3, 4, 50)])
    want = np.sign(x) * (np.sqrt(np.abs(x) + 1) - 1) + 1e-3 * x
    np.testing.assert_allclose(az.value_transform(jnp.asarray(x, jnp.float32)), want, rtol=1e-5, atol=1e-6)
    back = az.inverse_value_transform(az.value_transform(jnp.asarray(x, jnp.float32)))
    np.testing.assert_allclose(back, x, rtol=2e-3, atol=1e-3)


def test_value_targets_are_lambda_returns_of_the_critics_values(az):
    """value_targets on the shared [T=6, N=5] patterns against NumPy's GAE returns, with the critic's values (h^-1 of
    its outputs) of each observation and of the true next one: a truncation bootstraps from the state it cut off,
    a termination from nothing."""
    config = az.Config()
    networks = az.make_networks(config, 2, (4,))
    params = {"critic": networks.critic.init(jax.random.PRNGKey(0), jnp.zeros((1, 4)))}
    rng = np.random.default_rng(0)
    obs, final_obs = (rng.normal(size=(*TERMINATED.shape, 4)).astype(np.float32) for _ in range(2))
    reward = rng.normal(size=TERMINATED.shape).astype(np.float32)
    tr = az.Transition(obs, None, reward, TERMINATED.astype(np.float32), TERMINATED | TRUNCATED, final_obs)
    hp = az.hparams_from(az.Config(gamma=0.9, gae_lambda=0.8))
    critic = lambda o: np.asarray(az.inverse_value_transform(networks.critic.apply(params["critic"], o)[..., 0]))  # noqa: E731
    _, want = reference_gae(reward, critic(obs), critic(final_obs), TERMINATED, TRUNCATED, 0.9, 0.8)
    np.testing.assert_allclose(
        az.value_targets(networks, params, tr, hp.gamma, hp.gae_lambda), want, rtol=1e-4, atol=1e-4
    )


def test_the_loss_is_cross_entropy_to_the_search_policy_and_the_transformed_value_error(az):
    """alphazero_loss against NumPy: -sum(pi_search log softmax(logits)) + vf_coef * 0.5 (critic - h(target))^2."""
    config = az.Config()
    networks = az.make_networks(config, 3, (4,))
    keys, obs = jax.random.split(jax.random.PRNGKey(3)), jax.random.normal(jax.random.PRNGKey(4), (7, 4))
    params = {"actor": networks.actor.init(keys[0], obs), "critic": networks.critic.init(keys[1], obs)}
    policy = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(5), (7, 3)))
    target = 100 * jax.random.normal(jax.random.PRNGKey(6), (7,))
    hp = az.hparams_from(az.Config(vf_coef=0.7))
    loss, stats = az.alphazero_loss(config, networks, params, az.Batch(obs, policy, target), hp, jax.random.PRNGKey(7))
    logits = np.asarray(networks.actor.apply(params["actor"], obs), np.float64)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    policy_loss = -(np.asarray(policy) * log_probs).sum(-1).mean()
    t = np.asarray(target, np.float64)
    value = np.asarray(networks.critic.apply(params["critic"], obs)[:, 0], np.float64)
    value_loss = 0.5 * np.mean((value - (np.sign(t) * (np.sqrt(np.abs(t) + 1) - 1) + 1e-3 * t)) ** 2)
    np.testing.assert_allclose(stats["policy_loss"], policy_loss, rtol=1e-5)
    np.testing.assert_allclose(stats["value_loss"], value_loss, rtol=1e-5)
    np.testing.assert_allclose(loss, policy_loss + 0.7 * value_loss, rtol=1e-5)


@pytest.fixture(scope="module")
def connect_four(az):
    """pgx's connect_four through the harness's suite (pgx/connect_four), as alphazero.py's VecEnv takes it."""
    pytest.importorskip("pgx")
    from onefile_harness import suites

    suites.register("pgx/connect_four")
    return az.VecEnv("pgx/connect_four", 1)


def play_columns(env, columns):
    """The suite env's states and steps along a game of these moves (columns), from one reset."""
    obs, state = env.env.reset_env(jax.random.PRNGKey(3), env.params)
    steps = []
    for column in columns:
        step = env.env.step_env(jax.random.PRNGKey(0), state, jnp.int32(column), env.params)
        steps.append((obs, *step[:4]))
        obs, state = step[0], step[1]
    return steps, state


def test_self_play_targets_are_plus_one_for_the_winners_plies_and_minus_one_for_the_losers(az, connect_four):
    """A game the first player wins at its 4th move (columns 0, 1, 0, 1, 0, 1, 0): the mover's reward is +1 at the
    winning ply only; value_targets with the ply's sign flip (gamma 1, lambda 1: Monte Carlo) and a critic valuing
    every state 0 give +1 to every ply of the winner and -1 to every ply of the loser."""
    assert az.ply_sign(connect_four) == -1.0 and az.ply_sign(az.VecEnv("CartPole-v1", 1)) == 1.0
    steps, _ = play_columns(connect_four, [0, 1, 0, 1, 0, 1, 0])
    obs, next_obs, _, reward, terminated = (np.stack(x)[:, None] for x in zip(*steps, strict=True))
    np.testing.assert_array_equal(reward[:, 0], [0, 0, 0, 0, 0, 0, 1])
    assert terminated[-1] and not terminated[:-1].any()
    config = az.Config(env_name="pgx/connect_four")
    networks, params = chain_params(az, config, value=0.0, obs_shape=connect_four.obs_shape, num_actions=7)
    tr = az.Transition(obs, None, reward, terminated.astype(np.float32), terminated, next_obs)
    targets = az.value_targets(networks, params, tr, az.ply_sign(connect_four) * 1.0, 1.0)[:, 0]
    np.testing.assert_allclose(targets, [1, -1, 1, -1, 1, -1, 1], atol=1e-5)


@pytest.mark.parametrize("greedy", [True, False])
def test_the_search_never_picks_an_illegal_move(az, connect_four, greedy):
    """With column 3 full (six moves in it), the search, greedy or sampling as in training, never plays it and gives it
    no weight in the improved policy, though the untrained prior is near uniform, for 64 keys."""
    steps, state = play_columns(connect_four, [3] * 6)
    obs = steps[-1][1]
    assert not bool(connect_four.env.legal_action_mask(state)[3])
    config = az.Config(env_name="pgx/connect_four", num_simulations=32)
    networks, params = chain_params(az, config, value=0.0, obs_shape=connect_four.obs_shape, num_actions=7)
    batch = jax.tree.map(lambda x: jnp.broadcast_to(x, (64, *jnp.shape(x))), (obs, state))
    plan = az.search(
        config, networks, connect_four, params, *batch, jax.random.PRNGKey(4), jnp.float32(1.0),
        gumbel_scale=0.0 if greedy else 1.0,
    )  # fmt: skip
    assert not (plan.action == 3).any() and (plan.action_weights[:, 3] == 0).all()


def test_the_self_play_search_blocks_the_opponents_win(az, connect_four):
    """After columns 0, 6, 0, 6, 0 the first player threatens to win in column 0: the second player's search (a critic
    valuing every state 0, so only the rewards speak) blocks it there, since every other move lets the opponent win:
    Q -1 for them, through the sign flipped at each ply (unflipped, the opponent's win would count as its own)."""
    steps, state = play_columns(connect_four, [0, 6, 0, 6, 0])
    config = az.Config(env_name="pgx/connect_four", num_simulations=256)
    networks, params = chain_params(az, config, value=0.0, obs_shape=connect_four.obs_shape, num_actions=7)
    batch = jax.tree.map(lambda x: jnp.broadcast_to(x, (8, *jnp.shape(x))), (steps[-1][1], state))
    plan = az.search(config, networks, connect_four, params, *batch, jax.random.PRNGKey(5), jnp.float32(1.0))
    q = np.asarray(plan.search_tree.qvalues(jnp.zeros(8, jnp.int32)))
    np.testing.assert_array_equal(plan.action, 0)
    assert (q[:, 0] > -0.1).all() and (q[:, 1:] < -0.4).all(), np.round(q, 2)


@pytest.mark.slow  # a compile of its own, about 20 s
def test_the_command_line_plays_connect_four_by_self_play(az, connect_four, tmp_path):
    """`python algorithms/alphazero.py --env-name pgx/connect_four` (test_cli's small run) writes a complete run
    directory through the harness's pgx suite; the mover's returns are 0 (a draw) to 1 (a game won)."""
    from specs import SPECS
    from test_suites import check_run_directory, command_line

    spec = dataclasses.replace(SPECS["alphazero"], env="pgx/connect_four", obs_dim=84, return_range=(0, 1))
    flags = (*spec.small, "--env-name", "pgx/connect_four", "--gamma", "1.0")
    check_run_directory("alphazero", spec, az, command_line("alphazero", flags, tmp_path), flags)
