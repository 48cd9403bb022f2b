"""ppo_rnd.py (PPO with random network distillation) against plain NumPy references on hand-made
trajectories with terminations and truncations: the two advantage streams (episodic extrinsic,
non-episodic intrinsic), the intrinsic reward (the predictor's error on normalised, clipped next
observations), its scaling by the running std of the forward-filtered intrinsic return, the running
moments, the predictor's masked loss and the two value heads' clipped losses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_gae import reference_gae  # the episodic (extrinsic) stream is ppo.py's GAE

from conftest import TERMINATED, TRUNCATED, load_algorithm, numpy_mlp

rnd = load_algorithm("ppo_rnd")
T, N = TERMINATED.shape  # [T=6, N=5] episode-boundary patterns shared with every return test


# --------------------------------------------------------------------------------------
# NumPy references: loops as the paper states them
# --------------------------------------------------------------------------------------
def reference_intrinsic_gae(int_reward, value_int, last_value_int, gamma_int, lam):
    """Non-episodic GAE: the env's stream of observations obs_0, obs_1, ... (auto-reset included) is one
    long episode: delta_t = r_t + gamma_int V(obs_{t+1}) - V(obs_t), A_t = delta_t + gamma_int lam A_{t+1},
    with V(obs_T) = last_value_int, whatever ended in between."""
    advantage = np.zeros((T, N))
    for n in range(N):
        following = 0.0
        for t in reversed(range(T)):
            next_value = value_int[t + 1, n] if t + 1 < T else last_value_int[n]
            delta = int_reward[t, n] + gamma_int * next_value - value_int[t, n]
            following = delta + gamma_int * lam * following
            advantage[t, n] = following
    return advantage, advantage + value_int


def reference_scaled_intrinsic_rewards(rollouts, gamma_int):
    """The paper's reward forward filter over several rollouts: per env R <- gamma_int R + r at every
    step, never reset; after each rollout r / sqrt(var + 1e-8), var the population variance of every R
    seen so far (all envs, all steps, all rollouts)."""
    R = np.zeros(N)
    seen, scaled = [], []
    for raw in rollouts:
        for t in range(T):
            R = gamma_int * R + raw[t]
            seen.extend(R.tolist())
        scaled.append(raw / np.sqrt(np.var(seen) + 1e-8))
    return scaled, R, np.mean(seen), np.var(seen)


def reference_intrinsic_reward(params, mean, var, next_obs):
    """Per sample: x = clip((o - mean) / sqrt(var + 1e-8), -5, 5), r = mean_k (predictor(x)_k - target(x)_k)^2."""
    rewards = np.zeros(len(next_obs))
    for i, obs in enumerate(np.asarray(next_obs, np.float64)):
        x = np.clip((obs - mean) / np.sqrt(var + 1e-8), -5.0, 5.0)
        error = numpy_mlp(params["predictor"], x[None])[0] - numpy_mlp(params["target"], x[None])[0]
        rewards[i] = np.mean(error**2)
    return rewards


def random_stream(seed):
    rng = np.random.default_rng(seed)
    reward = rng.normal(size=(T, N)).astype(np.float32)
    int_reward = rng.uniform(0, 2, size=(T, N)).astype(np.float32)
    value = rng.normal(size=(T, N, 2)).astype(np.float32)  # heads: extrinsic, intrinsic
    next_value = rng.normal(size=(T, N)).astype(np.float32)  # V_ext(final_obs)
    last_value_int = rng.normal(size=N).astype(np.float32)
    return reward, int_reward, value, next_value, last_value_int


@jax.jit
def two_stream(reward, int_reward, value, next_value, last_value_int, gamma, gamma_int, lam):
    return rnd.compute_two_stream_gae(
        reward,
        int_reward,
        value,
        next_value,
        last_value_int,
        jnp.asarray(TERMINATED, jnp.float32),
        jnp.asarray(TERMINATED | TRUNCATED),
        gamma,
        gamma_int,
        lam,
    )


def streams(inputs, gamma, gamma_int, lam):
    (a_ext, t_ext), (a_int, t_int) = two_stream(*inputs, gamma, gamma_int, lam)
    return [np.asarray(x, np.float64) for x in (a_ext, t_ext, a_int, t_int)]


# --------------------------------------------------------------------------------------
# Two-stream GAE
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("gamma, gamma_int, lam", [(0.999, 0.99, 0.95), (0.9, 0.5, 1.0), (0.99, 0.9, 0.0)])
@pytest.mark.parametrize("seed", [0, 1])
def test_two_stream_gae_matches_reference(gamma, gamma_int, lam, seed):
    inputs = random_stream(seed)
    reward, int_reward, value, next_value, last_value_int = (np.asarray(x, np.float64) for x in inputs)
    a_ext, t_ext, a_int, t_int = streams(inputs, gamma, gamma_int, lam)
    want_ext = reference_gae(reward, value[..., 0], next_value, TERMINATED, TRUNCATED, gamma, lam)
    want_int = reference_intrinsic_gae(int_reward, value[..., 1], last_value_int, gamma_int, lam)
    for got, want in zip((a_ext, t_ext, a_int, t_int), (*want_ext, *want_int), strict=True):
        assert got.shape == (T, N)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_streams_differ_exactly_at_episode_ends():
    """Env 1 terminates at t=2 and env 2 is truncated at t=1. A bonus in the step after the episode end
    reaches the step before it in the intrinsic stream only (discounted by gamma_int lam), and only the
    intrinsic stream bootstraps that step from the next episode's first observation's value; the
    extrinsic stream bootstraps a truncation from V_ext of the final observation instead."""
    gamma, gamma_int, lam = 0.9, 0.8, 0.5
    inputs = random_stream(2)
    base = streams(inputs, gamma, gamma_int, lam)
    for t, n in [(2, 1), (1, 2)]:  # the last step of an episode
        assert (TERMINATED | TRUNCATED)[t, n]
        # The next step's rewards (both kinds) raised by 1.
        reward, int_reward = inputs[0].copy(), inputs[1].copy()
        reward[t + 1, n] += 1.0
        int_reward[t + 1, n] += 1.0
        a_ext, _, a_int, _ = streams((reward, int_reward, *inputs[2:]), gamma, gamma_int, lam)
        np.testing.assert_array_equal(a_ext[: t + 1, n], base[0][: t + 1, n])  # stopped at the episode end
        np.testing.assert_allclose(a_int[t, n] - base[2][t, n], gamma_int * lam, rtol=1e-5)  # ran on
        # The next episode's first observation's values raised by 1.
        value = inputs[2].copy()
        value[t + 1, n] += 1.0
        a_ext, _, a_int, _ = streams((*inputs[:2], value, *inputs[3:]), gamma, gamma_int, lam)
        np.testing.assert_allclose(a_ext[t, n], base[0][t, n], rtol=1e-6)  # V_ext(obs after reset): unused
        np.testing.assert_allclose(a_int[t, n] - base[2][t, n], gamma_int * (1 - lam), rtol=1e-4)
    # The final observation's extrinsic value counts at the truncation (env 2, t=1), not at the termination.
    next_value = inputs[3].copy()
    next_value[1, 2] += 1.0
    next_value[2, 1] += 1.0
    a_ext, _, a_int, _ = streams((*inputs[:3], next_value, inputs[4]), gamma, gamma_int, lam)
    np.testing.assert_allclose(a_ext[1, 2] - base[0][1, 2], gamma, rtol=1e-5)
    np.testing.assert_allclose(a_ext[2, 1], base[0][2, 1], rtol=1e-6)
    np.testing.assert_array_equal(a_int, base[2])  # the intrinsic stream never reads V(final_obs)


def test_hand_computed_single_env():
    """One env, 3 steps, terminated at t=1: small enough to check by hand."""
    gamma, gamma_int, lam = 0.5, 0.5, 0.5
    reward = np.array([[1.0], [2.0], [4.0]], np.float32)
    int_reward = np.array([[8.0], [0.0], [16.0]], np.float32)
    value = np.array([[[0.0, 1.0]], [[1.0, 2.0]], [[0.0, 4.0]]], np.float32)
    next_value = np.array([[10.0], [20.0], [40.0]], np.float32)  # V_ext(final_obs)
    terminated = np.array([[0.0], [1.0], [0.0]], np.float32)
    last_value_int = np.array([8.0], np.float32)
    (a_ext, _), (a_int, t_int) = jax.jit(rnd.compute_two_stream_gae)(
        reward, int_reward, value, next_value, last_value_int, terminated, terminated > 0, gamma, gamma_int, lam
    )
    # extrinsic: t=2: 4 + 0.5*40 - 0 = 24; t=1 terminal: 2 - 1 = 1; t=0: 1 + 0.5*10 - 0 + 0.25*1 = 6.25
    np.testing.assert_allclose(np.asarray(a_ext)[:, 0], [6.25, 1.0, 24.0], rtol=1e-6)
    # intrinsic: t=2: 16 + 0.5*8 - 4 = 16; t=1 (through the end): 0 + 0.5*4 - 2 + 0.25*16 = 4;
    # t=0: 8 + 0.5*2 - 1 + 0.25*4 = 9
    np.testing.assert_allclose(np.asarray(a_int)[:, 0], [9.0, 4.0, 16.0], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(t_int)[:, 0], [10.0, 6.0, 20.0], rtol=1e-6)


# --------------------------------------------------------------------------------------
# Intrinsic reward and its scaling
# --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def rnd_setup():
    config = rnd.Config(rnd_size=16, hidden_size=8, activation="relu")
    networks = rnd.make_networks(config, num_actions=2, obs_shape=(3,))

    @jax.jit
    def init(key):
        key_target, key_predictor, key_critic = jax.random.split(key, 3)
        obs = jnp.zeros((1, 3))
        params = {
            "target": networks.target.init(key_target, obs),
            "predictor": networks.predictor.init(key_predictor, obs),
        }
        return params, networks.critic.init(key_critic, obs)

    return config, networks, *init(jax.random.PRNGKey(3))


def test_intrinsic_reward_matches_reference(rnd_setup):
    _, networks, params, _ = rnd_setup
    rng = np.random.default_rng(4)
    mean, var = np.array([1.0, -2.0, 0.0]), np.array([4.0, 0.25, 0.0])  # a constant third feature
    stats = rnd.RunningStats(jnp.asarray(mean, jnp.float32), jnp.asarray(var, jnp.float32), jnp.float32(100))
    next_obs = rng.normal(size=(T, N, 3)).astype(np.float32) * 3.0 + mean.astype(np.float32)
    next_obs[0, 0] = [100.0, -100.0, 1e-3]  # clipped to +5, -5, +5 (1e-3 / sqrt(1e-8) = 10)
    reward_of = jax.jit(lambda p, s, o: rnd.intrinsic_reward(networks, p, s, o))
    got, x, embedding = reward_of(params, stats, next_obs)
    assert got.shape == (T, N) and x.shape == (T, N, 3) and embedding.shape == (T, N, 16)
    np.testing.assert_allclose(embedding[1, 2], numpy_mlp(params["target"], np.asarray(x[1, 2])[None])[0], rtol=1e-4)
    np.testing.assert_allclose(np.asarray(x)[0, 0], [5.0, -5.0, 5.0], rtol=1e-6)
    assert np.abs(np.asarray(x)).max() <= 5.0
    want = reference_intrinsic_reward(params, mean, var, next_obs.reshape(-1, 3)).reshape(T, N)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-6)
    assert (want > 0).all()  # a random predictor does not match the target
    # A predictor equal to the target sees nothing new.
    same = {"target": params["target"], "predictor": params["target"]}
    np.testing.assert_array_equal(np.asarray(reward_of(same, stats, next_obs)[0]), 0.0)


def test_running_stats_merge_equals_numpy_over_the_whole_stream():
    rng = np.random.default_rng(5)
    scale, offset = np.array([0.01, 1.0, 30.0]), np.array([5.0, -2.0, 100.0])
    stats, seen = rnd.RunningStats.empty((3,)), []
    update = jax.jit(rnd.update_stats)
    for shape in [(T, N), (1,), (7,), (2, 3, 4)]:
        batch = (rng.normal(size=shape + (3,)) * scale + offset).astype(np.float32)
        stats = update(stats, batch)
        seen.append(batch.reshape(-1, 3).astype(np.float64))
        stream = np.concatenate(seen)
        assert float(stats.count) == len(stream)
        np.testing.assert_allclose((np.asarray(stats.mean) - stream.mean(0)) / scale, 0.0, atol=1e-4)
        np.testing.assert_allclose(np.asarray(stats.var), stream.var(0), rtol=1e-3)
    # The first batch alone sets the statistics (count starts at 0: no NaN, no trace of the initial var 1).
    first = rnd.update_stats(rnd.RunningStats.empty(), jnp.full((T, N), 2.0))
    assert float(first.mean) == 2.0 and float(first.var) == 0.0 and float(first.count) == T * N


@pytest.mark.parametrize("gamma_int", [0.99, 0.5])
def test_scaled_intrinsic_reward_matches_forward_filter_reference(gamma_int):
    """Three rollouts with episode ends (TERMINATED / TRUNCATED) in them: the filter ignores them."""
    rng = np.random.default_rng(6)
    rollouts = [rng.uniform(0, 3, size=(T, N)).astype(np.float32) for _ in range(3)]
    want, want_carry, want_mean, want_var = reference_scaled_intrinsic_rewards(rollouts, gamma_int)
    scale = jax.jit(rnd.scale_intrinsic_reward)
    carry, stats = jnp.zeros(N), rnd.RunningStats.empty()
    for raw, want_scaled in zip(rollouts, want, strict=True):
        scaled, carry, stats = scale(raw, carry, stats, gamma_int)
        assert np.isfinite(np.asarray(scaled)).all()
        np.testing.assert_allclose(np.asarray(scaled), want_scaled, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(carry), want_carry, rtol=1e-5)
    np.testing.assert_allclose([float(stats.mean), float(stats.var)], [want_mean, want_var], rtol=1e-4)
    assert float(stats.count) == 3 * T * N

    # Resetting R at episode ends (the extrinsic way) would give other values.
    returns, _ = rnd.forward_filter(jnp.asarray(rollouts[0]), jnp.zeros(N), gamma_int)
    episodic, R = np.zeros((T, N)), np.zeros(N)
    for t in range(T):
        R = gamma_int * R + rollouts[0][t]
        episodic[t] = R
        R = np.where((TERMINATED | TRUNCATED)[t], 0.0, R)
    np.testing.assert_allclose(np.asarray(returns)[0], episodic[0], rtol=1e-6)  # no episode ended yet
    for t, n in np.argwhere((TERMINATED | TRUNCATED)[:-1]):  # the step after an episode end
        assert np.asarray(returns)[t + 1, n] > episodic[t + 1, n] + 1e-3, (t, n)


# --------------------------------------------------------------------------------------
# Losses
# --------------------------------------------------------------------------------------
def rnd_batch(next_obs, next_embedding):
    """A minibatch as the RND loss reads it: the normalised next observations and their target embeddings."""
    B = len(next_obs)
    zeros = np.zeros(B, np.float32)
    value = np.zeros((B, 2), np.float32)
    return rnd.Batch(next_obs, np.zeros(B, np.int32), zeros, value, zeros, value, next_obs, next_embedding)


def test_rnd_loss_is_the_masked_mean_error(rnd_setup):
    """The predictor trains on a random update_proportion of each minibatch: the mask its loss's key draws."""
    config, networks, params, _ = rnd_setup
    rng = np.random.default_rng(7)
    x = rng.uniform(-5, 5, size=(12, 3)).astype(np.float32)
    error = reference_intrinsic_reward(params, np.zeros(3), np.full(3, 1.0 - 1e-8), x)  # x already normalised
    embedding = numpy_mlp(params["target"], x).astype(np.float32)
    key, hp = jax.random.PRNGKey(7), rnd.hparams_from(config)

    @jax.jit
    def loss(predictor, x, proportion, key=key):
        return rnd.rnd_loss(
            config, networks, predictor, rnd_batch(x, embedding), hp._replace(update_proportion=proportion), key
        )

    mask = np.asarray(jax.random.bernoulli(key, 0.25, (12,)))
    assert 0 < mask.sum() < 12
    assert float(loss(params["predictor"], x, 0.25)) == pytest.approx(error[mask].mean(), rel=1e-4)
    assert float(loss(params["predictor"], x, 1.0)) == pytest.approx(error.mean(), rel=1e-4)
    assert float(loss(params["predictor"], x, 0.0)) == 0.0  # an empty mask
    # Only the masked samples move the predictor: changing the others leaves its gradient alone.
    grad = lambda observations: jax.jit(jax.grad(loss))(params["predictor"], observations, 0.25)  # noqa: E731

    moved = x.copy()
    moved[~mask] += 1.0
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), grad(x), grad(moved))


def test_value_loss_sums_both_clipped_heads(rnd_setup):
    config, networks, _, critic = rnd_setup
    rng = np.random.default_rng(8)
    B, clip_eps = 10, 0.2
    obs = rng.normal(size=(B, 3)).astype(np.float32)
    value = numpy_mlp(critic, obs)  # [B, 2] the critic's current values
    old_value = (value + rng.normal(size=(B, 2)) * 0.5).astype(np.float32)  # some beyond the clip range
    target = rng.normal(size=(B, 2)).astype(np.float32)
    actor = jax.jit(networks.actor.init)(jax.random.PRNGKey(0), jnp.zeros((1, 3)))
    batch = rnd.Batch(
        obs=obs,
        action=np.zeros(B, np.int32),
        log_prob=np.full(B, np.log(0.5), np.float32),
        value=old_value,
        advantage=rng.normal(size=B).astype(np.float32),
        target=target,
        next_obs=obs,
        next_embedding=np.zeros((B, 16), np.float32),
    )
    hp = rnd.hparams_from(config)._replace(clip_eps=jnp.float32(clip_eps), vf_coef=jnp.float32(0.5))
    _, stats = jax.jit(
        lambda params, batch, hp: rnd.ppo_loss(config, networks, params, batch, hp, jax.random.PRNGKey(0))
    )({"actor": actor, "critic": critic}, batch, hp)
    want = np.zeros(2)
    for head in range(2):
        for i in range(B):
            clipped = old_value[i, head] + np.clip(value[i, head] - old_value[i, head], -clip_eps, clip_eps)
            want[head] += 0.5 * max((value[i, head] - target[i, head]) ** 2, (clipped - target[i, head]) ** 2) / B
    np.testing.assert_allclose([float(stats["value_loss"]), float(stats["value_loss_int"])], want, rtol=1e-4)
    entropy, policy_loss = float(stats["entropy"]), float(stats["policy_loss"])
    want_loss = policy_loss + 0.5 * want.sum() - float(hp.ent_coef) * entropy
    assert float(stats["loss"]) == pytest.approx(want_loss, rel=1e-4)


# --------------------------------------------------------------------------------------
# One update of a tiny run
# --------------------------------------------------------------------------------------
def test_one_update_keeps_its_statistics():
    """A first update, actor and critic fed normalised observations: the statistics take in the rollout's
    T * N next observations and filter values, the target network stays fixed, the predictor moves, every
    metric is finite."""
    config = rnd.Config(
        num_envs=4, num_steps=8, total_timesteps=4 * 8 * 2, num_minibatches=2, update_epochs=1, normalize_obs=True
    )
    train = rnd.make_train(config)
    runner = jax.jit(train.init)(jax.random.PRNGKey(0))
    after, metrics = jax.jit(train.update)(runner, jnp.int32(0))
    assert bool(metrics["finite"])
    for name in ("intrinsic_reward", "rnd_loss", "value_loss_int", "value_loss", "loss"):
        assert np.isfinite(float(metrics[name])), name
    assert float(after.obs_norm.count) == float(after.int_return_norm.count) == 4 * 8
    assert after.int_return.shape == (4,) and (np.asarray(after.int_return) > 0).all()
    jax.tree.map(np.testing.assert_array_equal, after.rnd_params["target"], runner.rnd_params["target"])
    moved = jax.tree.map(
        lambda a, b: bool((a != b).any()), after.rnd_params["predictor"], runner.rnd_params["predictor"]
    )
    assert any(jax.tree.leaves(moved))


@pytest.mark.parametrize("normalize_obs", [False, True])
def test_greedy_policy_normalises_with_the_saved_statistics(normalize_obs):
    config = rnd.Config(env_name="CartPole-v1", activation="relu", hidden_size=8, normalize_obs=normalize_obs)
    env = rnd.VecEnv(config.env_name, 5)
    networks = rnd.make_networks(config, env.num_actions, env.obs_shape)
    actor = jax.jit(networks.actor.init)(jax.random.PRNGKey(1), jnp.zeros((1, 4)))
    mean, var = np.array([0.5, -1.0, 2.0, 0.0]), np.array([0.25, 4.0, 1.0, 1e-2])
    obs_norm = {"mean": jnp.asarray(mean, jnp.float32), "var": jnp.asarray(var, jnp.float32), "count": jnp.float32(9)}
    obs = np.random.default_rng(9).normal(size=(5, 4)).astype(np.float32) * 3
    act = jax.vmap(rnd.make_act(config, env=env), in_axes=(None, 0, None))
    params, key = {"actor": actor, "obs_norm": obs_norm}, jax.random.PRNGKey(2)
    action = jax.jit(act)(params, obs, key)
    x = np.clip((obs - mean) / np.sqrt(var + 1e-8), -5, 5) if normalize_obs else obs
    np.testing.assert_array_equal(np.asarray(action), np.argmax(numpy_mlp(actor, x), -1))
