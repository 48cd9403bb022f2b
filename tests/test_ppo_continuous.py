"""ppo_continuous.py in training: its loss against NumPy, the first PPO ratio of every update being
1, the observation statistics that training keeps, saves in params.msgpack and evaluates with, and
its own bad inputs. Its policy and normalisers have test files of their own
(test_gaussian_policy.py, test_running_stats.py). What every algorithm file shares (CLI, vmapped =
single runs, sweeps, sharding) is tested in the shared test files."""

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import serialization
from specs import SPECS

import onefile_harness
from conftest import load_algorithm

pc = load_algorithm("ppo_continuous")

# A few updates on Pendulum; 4 x 50 steps per update, so every env's 200-step episode ends at
# updates 4 and 8. One epoch of one minibatch and a tiny clip_eps: see test_first_ratio_....
SMALL = dict(
    num_envs=4,
    num_steps=50,
    total_timesteps=4 * 50 * 8,
    num_minibatches=1,
    update_epochs=1,
    clip_eps=1e-4,
    num_seeds=2,
    eval_episodes=2,
)
SMALL_FLAGS = [
    "--total-timesteps",
    "1600",
    "--num-envs",
    "4",
    "--num-steps",
    "50",
    "--num-minibatches",
    "1",
    "--update-epochs",
    "1",
    "--clip-eps",
    "1e-4",
    "--num-seeds",
    "2",
    "--eval-episodes",
    "2",
]


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


def reference_ppo_loss(mean, log_std, value, batch, clip_eps, vf_coef, ent_coef):
    """The clipped surrogate, clipped value loss and entropy bonus in NumPy (float64), from the networks'
    outputs on the minibatch."""
    mean, log_std, value = (np.asarray(x, np.float64) for x in (mean, log_std, value))
    b = {k: np.asarray(v, np.float64) for k, v in batch._asdict().items()}
    std = np.exp(log_std)
    log_prob = (-((b["action"] - mean) ** 2) / (2 * std**2) - log_std - 0.5 * np.log(2 * np.pi)).sum(-1)
    log_ratio = log_prob - b["log_prob"]
    ratio = np.exp(log_ratio)
    adv = (b["advantage"] - b["advantage"].mean()) / (b["advantage"].std() + 1e-8)
    policy_loss = -np.minimum(ratio * adv, np.clip(ratio, 1 - clip_eps, 1 + clip_eps) * adv).mean()
    clipped = b["value"] + np.clip(value - b["value"], -clip_eps, clip_eps)
    value_loss = 0.5 * np.maximum((value - b["target"]) ** 2, (clipped - b["target"]) ** 2).mean()
    entropy = (0.5 * np.log(2 * np.pi * np.e) + log_std).sum()
    return policy_loss + vf_coef * value_loss - ent_coef * entropy, (ratio - 1 - log_ratio).mean()


def test_ppo_loss_equals_numpy_and_its_gradient_is_jax_grad_of_it():
    """The loss of a minibatch against NumPy; the update differentiates it with jax.grad alone (no
    hand-written gradient, no flattened parameters): its gradient is the same whatever the key."""
    config = pc.Config(hidden_size=16)
    networks, to_env = pc.make_networks(config, 1, (3,)), pc.ActionMap(jnp.array([-2.0]), jnp.array([2.0]), False)
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    obs = jnp.zeros((1, 3))
    params = {"actor": networks.actor.init(keys[0], obs), "critic": networks.critic.init(keys[1], obs)}
    params["actor"]["params"]["log_std"] = jnp.array([-0.3])
    rng = np.random.default_rng(0)
    batch = pc.Batch(
        obs=jnp.asarray(rng.normal(size=(32, 3)), jnp.float32),
        action=jnp.asarray(rng.normal(size=(32, 1)), jnp.float32),
        log_prob=jnp.asarray(rng.normal(size=32) - 1.0, jnp.float32),
        value=jnp.asarray(rng.normal(size=32) * 0.3, jnp.float32),
        advantage=jnp.asarray(rng.normal(size=32), jnp.float32),
        target=jnp.asarray(rng.normal(size=32), jnp.float32),
    )
    hp = pc.hparams_from(config)
    loss, stats = pc.ppo_loss(config, networks, params, batch, to_env, hp, keys[2])
    mean, log_std = networks.actor.apply(params["actor"], batch.obs)
    value = networks.critic.apply(params["critic"], batch.obs)[:, 0]
    coefs = (config.clip_eps, config.vf_coef, config.ent_coef)
    want, approx_kl = reference_ppo_loss(mean, log_std, value, batch, *coefs)
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    np.testing.assert_allclose(stats["approx_kl"], approx_kl, rtol=1e-4)
    grad = jax.grad(pc.ppo_loss, argnums=2, has_aux=True)
    grads = [grad(config, networks, params, batch, to_env, hp, key)[0] for key in jax.random.split(keys[2], 2)]
    jax.tree.map(np.testing.assert_array_equal, *grads)
    # d loss / d log_std by central differences of the NumPy reference.
    h, log_std_grad = 1e-3, grads[0]["actor"]["params"]["log_std"]
    plus, minus = (reference_ppo_loss(mean, log_std + d, value, batch, *coefs)[0] for d in (h, -h))
    np.testing.assert_allclose(log_std_grad, [(plus - minus) / (2 * h)], rtol=1e-3)


def test_gae_is_ppos():
    """Same function as ppo.py's, whose GAE tests (tests/test_gae.py) cover terminations and
    truncations."""
    assert inspect.getsource(pc.compute_gae) == inspect.getsource(load_algorithm("ppo").compute_gae)


# --------------------------------------------------------------------------------------
# Statistics in training, in params.msgpack and in evaluation
# --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """A small command-line run (in this process), and the same config trained by one jitted call."""
    runs_dir = tmp_path_factory.mktemp("runs")
    argv = [*SMALL_FLAGS, "--runs-dir", str(runs_dir), "--no-compile-cache", "--quiet"]
    assert onefile_harness.command_line(pc, argv) == 0
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
    obs_shape, steps = (3,), config.num_updates * config.steps_per_update  # Pendulum: cos, sin, angular velocity
    assert runner.obs_norm.mean.shape == runner.obs_norm.var.shape == (config.num_seeds, *obs_shape)
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
    rtol, atol = SPECS["ppo_continuous"].tolerance
    for path, leaf in flat_want.items():
        # [1 sweep point, seeds, ...] on disk.
        np.testing.assert_allclose(flat_saved[path][0], leaf, rtol=rtol, atol=atol, err_msg=jax.tree_util.keystr(path))


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
    # The greedy action is the mean: the key the policy is given changes nothing.
    act, obs = pc.make_act(config), jax.random.normal(jax.random.PRNGKey(1), (3,))
    np.testing.assert_array_equal(*[act(params, obs, jax.random.PRNGKey(k)) for k in (0, 1)])


# --------------------------------------------------------------------------------------
# Bad inputs (the shared CLI tests cover the rest)
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv, option, words",
    [
        (["--env-name", "CartPole-v1"], "--env-name", "discrete actions"),
        (["--log-std-init", "nan"], "--log-std-init", "-inf < log_std_init < inf"),  # NaN fails the rule
    ],
)
def test_bad_input_exits_2_with_one_line(capsys, argv, option, words):
    assert onefile_harness.command_line(pc, argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert option in err and words in err, err


def test_make_train_refuses_a_discrete_env():
    with pytest.raises(pc.ConfigError, match="--env-name Acrobot-v1 has discrete actions"):
        pc.make_train(dataclasses.replace(pc.Config(), env_name="Acrobot-v1"))
