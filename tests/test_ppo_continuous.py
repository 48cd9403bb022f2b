"""ppo_continuous.py's own parts: the Gaussian policy's log-probabilities and entropy against
closed forms and numerical densities (clipped and tanh-squashed actions), the first PPO ratio of
every update being 1, the running normalisers against NumPy over a whole stream, the reward
scaler's discounted returns against a NumPy loop with terminations and truncations, and the
statistics saved in params.msgpack. What every algorithm file shares (CLI, vmapped = single runs,
sweeps, sharding) is tested in the shared test files."""
import dataclasses
import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import serialization
from test_cli import ALGORITHMS

from conftest import TERMINATED, TRUNCATED, load_algorithm

pc = load_algorithm("ppo_continuous")

# A few updates on Pendulum; 4 x 50 steps per update, so every env's 200-step episode ends at
# updates 4 and 8. One epoch of one minibatch and a tiny clip_eps: see test_first_ratio_....
SMALL = dict(num_envs=4, num_steps=50, total_timesteps=4 * 50 * 8, num_minibatches=1, update_epochs=1,
             clip_eps=1e-4, num_seeds=2, eval_episodes=2)
SMALL_FLAGS = ["--total-timesteps", "1600", "--num-envs", "4", "--num-steps", "50", "--num-minibatches", "1",
               "--update-epochs", "1", "--clip-eps", "1e-4", "--num-seeds", "2", "--eval-episodes", "2"]


# --------------------------------------------------------------------------------------
# Gaussian policy
# --------------------------------------------------------------------------------------
def reference_log_prob(x, mean, log_std):
    """Sum over dimensions of log N(x; m, s^2) = -(x-m)^2 / (2 s^2) - log s - log(2 pi) / 2."""
    total = 0.0
    for xi, mi, li in zip(x, mean, log_std, strict=False):
        s = math.exp(li)
        total += -(xi - mi) ** 2 / (2 * s * s) - li - 0.5 * math.log(2 * math.pi)
    return total


def test_gaussian_log_prob_matches_closed_form():
    x = np.array([[0.3, -1.2], [2.5, 0.0], [-4.0, 7.0]], np.float32)
    mean = np.array([[0.0, 0.5], [2.0, -1.0], [1.0, 1.0]], np.float32)
    log_std = np.array([-0.7, 0.4], np.float32)  # state-independent: broadcast over the batch
    got = np.asarray(pc.gaussian_log_prob(x, mean, log_std))
    want = [reference_log_prob(x[i], mean[i], log_std) for i in range(3)]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_gaussian_entropy_matches_closed_form_and_numerical_integral():
    log_std = np.array([-1.5, 0.0, 0.8], np.float32)
    want = sum(0.5 * math.log(2 * math.pi * math.e * math.exp(2 * l)) for l in log_std)
    assert float(pc.gaussian_entropy(log_std)) == pytest.approx(want, rel=1e-6)
    # -integral of p log p, dimension by dimension (independent dimensions: entropies add).
    numeric = 0.0
    for l in log_std:
        grid = np.linspace(-12, 12, 200_001) * math.exp(l)
        log_p = np.asarray(pc.gaussian_log_prob(grid[:, None], 0.0, jnp.array([l]))).astype(np.float64)
        p = np.exp(log_p)
        assert np.trapezoid(p, grid) == pytest.approx(1.0, abs=1e-6)
        numeric += -np.trapezoid(p * log_p, grid)
    assert numeric == pytest.approx(want, rel=1e-5)


def normal_cdf(z):
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


@pytest.mark.parametrize("low, high", [(-2.0, 2.0), (-1.0, 3.0)])
def test_squashed_log_prob_is_the_density_of_the_executed_action(low, high):
    """a = centre + half * tanh(u), u ~ N(m, s^2): P(a <= A) = Phi((atanh((A - centre) / half) - m) / s);
    its finite-difference derivative is the density that exp(log_prob) must equal."""
    mean, log_std = 0.4, -0.3
    squash = pc.ActionMap(jnp.array([low]), jnp.array([high]), True)
    centre, half, s = (high + low) / 2, (high - low) / 2, math.exp(log_std)

    def cdf(a):
        return normal_cdf((math.atanh((a - centre) / half) - mean) / s)

    u = np.array([-2.0, -0.5, 0.0, 0.3, 1.1, 2.5], np.float32)
    action = np.asarray(squash(u[:, None]))[:, 0]
    np.testing.assert_allclose(action, centre + half * np.tanh(u), rtol=1e-6)
    assert (action > low).all() and (action < high).all()
    log_prob = np.asarray(squash.log_prob(u[:, None], jnp.float32(mean), jnp.array([log_std])))
    for a, lp in zip(action.astype(np.float64), log_prob, strict=False):
        h = 1e-5 * half
        density = (cdf(a + h) - cdf(a - h)) / (2 * h)
        assert math.exp(lp) == pytest.approx(density, rel=1e-3), a
    # The correction is exactly log |da/du|, and stays finite where tanh(u) rounds to +-1.
    plain = np.asarray(pc.gaussian_log_prob(u[:, None], mean, jnp.array([log_std])))
    np.testing.assert_allclose(plain - log_prob, np.log(half * (1 - np.tanh(u.astype(np.float64)) ** 2)),
                               rtol=1e-5, atol=1e-5)
    extreme = squash.log_prob(jnp.array([[30.0], [-30.0]]), jnp.float32(0.0), jnp.array([0.0]))
    assert np.isfinite(np.asarray(extreme)).all()


def test_clipped_actions_keep_the_unclipped_samples_log_prob():
    clip = pc.ActionMap(jnp.array([-2.0, -1.0]), jnp.array([2.0, 1.0]), False)
    u = np.array([[3.0, -0.5], [-2.5, 1.5], [0.1, 0.2]], np.float32)
    np.testing.assert_array_equal(np.asarray(clip(u)), np.array([[2, -0.5], [-2, 1], [0.1, 0.2]], np.float32))
    mean, log_std = np.zeros((3, 2), np.float32), np.array([0.2, -0.1], np.float32)
    np.testing.assert_array_equal(np.asarray(clip.log_prob(u, mean, log_std)),
                                  np.asarray(pc.gaussian_log_prob(u, mean, log_std)))


@pytest.mark.parametrize("squash", [False, True])
def test_first_ratio_of_every_update_is_one(squash, cli_run):
    """With one epoch of one minibatch, the only gradient step sees the rollout's own policy: the
    loss must recompute exactly the stored log-probabilities, from the observations normalised as
    they were when acting (the statistics move between updates, so a mismatch would show after
    the first). clip_eps = 1e-4 makes clip_fraction count every ratio off 1 by more than that."""
    config, _, metrics, _, _ = cli_run
    assert (config.update_epochs, config.num_minibatches, config.clip_eps) == (1, 1, 1e-4)
    if squash:
        config = dataclasses.replace(config, squash=True, num_seeds=1)
        _, metrics = jax.device_get(jax.jit(pc.make_train(config))(jax.random.PRNGKey(3)))
    assert metrics["finite"].all()
    np.testing.assert_array_equal(metrics["clip_fraction"], 0.0)
    np.testing.assert_allclose(metrics["approx_kl"], 0.0, atol=1e-9)


# --------------------------------------------------------------------------------------
# Normalisers
# --------------------------------------------------------------------------------------
def test_running_stats_equal_numpy_over_the_whole_stream():
    rng = np.random.default_rng(0)
    # Features on very different scales and offsets; batches of different sizes and layouts.
    scale, offset = np.array([0.01, 1.0, 30.0]), np.array([5.0, -2.0, 100.0])
    batches = [rng.normal(size=shape + (3,)) * scale + offset
               for shape in [(7,), (4, 5), (1,), (3, 2, 6), (50,)]]
    update = jax.jit(pc.update_stats)
    stats = pc.RunningStats.empty((3,))
    seen = []
    for batch in batches:
        stats = update(stats, jnp.asarray(batch, jnp.float32))
        seen.append(batch.reshape(-1, 3).astype(np.float32).astype(np.float64))
        stream = np.concatenate(seen)
        assert stats.mean.shape == stats.var.shape == (3,)
        assert float(stats.count) == len(stream)
        # float32 arithmetic: the mean to a small fraction of each feature's spread.
        np.testing.assert_allclose((stats.mean - stream.mean(0)) / scale, 0.0, atol=1e-4)
        np.testing.assert_allclose(stats.var, stream.var(0), rtol=1e-3)

    # Scalar statistics (the discounted return's) work the same way.
    returns = rng.normal(size=(6, 5)) * 40 - 300
    scalar = pc.update_stats(pc.update_stats(pc.RunningStats.empty(), returns[:2]), returns[2:])
    assert scalar.mean.shape == ()
    np.testing.assert_allclose([scalar.mean, scalar.var], [returns.mean(), returns.var()], rtol=1e-5)


def test_normalize_uses_mean_and_std_and_clips():
    stats = pc.RunningStats(jnp.array([1.0, -3.0]), jnp.array([4.0, 1e-12]), jnp.float32(10))
    got = np.asarray(pc.normalize(stats, jnp.array([[5.0, -3.0], [-1.0, -2.0]])))
    np.testing.assert_allclose(got, [[2.0, 0.0], [-1.0, 10.0]], rtol=1e-6)  # 1 / sqrt(1e-12 + 1e-8) clips


def reference_discounted_returns(reward, done, gamma, initial):
    T, N = reward.shape
    returns, g = np.zeros((T, N)), np.array(initial, np.float64)
    for t in range(T):
        g = gamma * g + reward[t]
        returns[t] = g
        g = np.where(done[t], 0.0, g)
    return returns, g


@pytest.mark.parametrize("gamma", [0.99, 0.5])
def test_discounted_returns_restart_at_every_episode_end(gamma):
    rng = np.random.default_rng(1)
    reward = rng.normal(size=TERMINATED.shape).astype(np.float32)
    initial = rng.normal(size=TERMINATED.shape[1]).astype(np.float32)
    done = TERMINATED | TRUNCATED
    returns, last = pc.discounted_returns(jnp.asarray(reward), jnp.asarray(done), jnp.float32(gamma),
                                          jnp.asarray(initial))
    want, want_last = reference_discounted_returns(reward, done, gamma, initial)
    np.testing.assert_allclose(returns, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(last, want_last, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(last)[done[-1]], 0.0)


def test_gae_is_ppos():
    """Same function as ppo.py's, whose GAE tests (tests/test_ppo_gae.py) cover terminations and
    truncations."""
    assert inspect.getsource(pc.compute_gae) == inspect.getsource(load_algorithm("ppo").compute_gae)


# --------------------------------------------------------------------------------------
# Statistics in training, in params.msgpack and in evaluation
# --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """A small command-line run (in this process), and the same config trained by one jitted call."""
    runs_dir = tmp_path_factory.mktemp("runs")
    assert pc.main([*SMALL_FLAGS, "--runs-dir", str(runs_dir), "--no-compile-cache", "--quiet"]) == 0
    (run_dir,) = runs_dir.iterdir()
    config = pc.Config(**SMALL)
    keys = jax.random.split(jax.random.PRNGKey(config.seed), config.num_seeds)
    runner, metrics = jax.device_get(jax.jit(jax.vmap(pc.make_train(config)))(keys))
    with np.load(run_dir / "metrics.npz") as npz:
        saved_metrics = {k: npz[k] for k in npz.files}
    saved = serialization.msgpack_restore((run_dir / "params.msgpack").read_bytes())
    return config, runner, metrics, saved_metrics, saved


def test_statistics_are_per_feature_and_count_every_step(cli_run):
    config, runner, metrics, _, _ = cli_run
    obs_dim, steps = 3, config.num_updates * config.steps_per_update  # Pendulum: cos, sin, angular velocity
    assert runner.obs_norm.mean.shape == runner.obs_norm.var.shape == (config.num_seeds, obs_dim)
    np.testing.assert_array_equal(runner.obs_norm.count, steps)
    np.testing.assert_array_equal(runner.return_norm.count, steps)
    assert (np.abs(runner.obs_norm.mean[:, :2]) <= 1).all() and (runner.obs_norm.var > 0).all()
    np.testing.assert_allclose(metrics["return_std"][:, -1], np.sqrt(runner.return_norm.var), rtol=1e-6)
    assert (metrics["episodes_finished"][:, [3, 7]] == config.num_envs).all()


def test_params_msgpack_holds_the_runners_statistics(cli_run):
    _, runner, _, _, saved = cli_run
    assert set(saved) == {"actor", "critic", "obs_norm", "return_norm"}
    want = {**runner.params, "obs_norm": runner.obs_norm._asdict(), "return_norm": runner.return_norm._asdict()}
    flat_saved = dict(jax.tree_util.tree_flatten_with_path(saved)[0])
    flat_want = dict(jax.tree_util.tree_flatten_with_path(want)[0])
    assert flat_saved.keys() == flat_want.keys()
    # The command line trains in chunks and, on a CPU-only install, spreads its seeds over one device
    # per core: it equals one single-device call up to float reassociation, which Pendulum amplifies.
    rtol, atol = ALGORITHMS["ppo_continuous"].tolerance
    for path, leaf in flat_want.items():
        # [1 sweep point, seeds, ...] on disk.
        np.testing.assert_allclose(flat_saved[path][0], leaf, rtol=rtol, atol=atol,
                                   err_msg=jax.tree_util.keystr(path))


def test_restored_params_evaluate_to_the_saved_eval_return(cli_run):
    config, _, _, saved_metrics, saved = cli_run
    evaluate = jax.jit(pc.make_evaluate(config))
    eval_keys = jax.random.split(jax.random.PRNGKey(config.seed + 1), config.num_seeds)
    per_seed = lambda tree, s: jax.tree.map(lambda x: x[0, s], tree)  # noqa: E731
    got = [float(evaluate(per_seed(saved, s), eval_keys[s])) for s in range(config.num_seeds)]
    np.testing.assert_allclose(got, saved_metrics["eval_return"][0], rtol=1e-5)

    # Greedy: the policy's std does not matter; the frozen observation statistics do.
    params = per_seed(saved, 0)
    wider = jax.tree.map(lambda x: x, params)
    wider["actor"]["params"]["log_std"] = params["actor"]["params"]["log_std"] + 3.0
    assert float(evaluate(wider, eval_keys[0])) == got[0]
    shifted = jax.tree.map(lambda x: x, params)
    shifted["obs_norm"]["mean"] = params["obs_norm"]["mean"] + 0.5
    assert float(evaluate(shifted, eval_keys[0])) != got[0]


# --------------------------------------------------------------------------------------
# Bad inputs (the shared CLI tests cover the rest)
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, option, words", [
    (["--env-name", "CartPole-v1"], "--env-name", "discrete action space"),
    (["--log-std-init", "nan"], "--log-std-init", "finite"),
])
def test_bad_input_exits_2_with_one_line(capsys, argv, option, words):
    assert pc.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert option in err and words in err, err


def test_make_train_refuses_a_discrete_env():
    with pytest.raises(pc.ConfigError, match="--env-name Acrobot-v1 has a discrete action space"):
        pc.make_train(dataclasses.replace(pc.Config(), env_name="Acrobot-v1"))
