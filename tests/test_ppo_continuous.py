"""ppo_continuous.py in training: the first PPO ratio of every update being 1, the observation
statistics that training keeps, saves in params.msgpack and evaluates with, and its own bad
inputs. Its policy and normalisers have test files of their own (test_gaussian_policy.py,
test_running_stats.py). What every algorithm file shares (CLI, vmapped = single runs,
sweeps, sharding) is tested in the shared test files."""

import dataclasses
import inspect

import jax
import numpy as np
import pytest
from flax import serialization
from test_cli import ALGORITHMS

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


# --------------------------------------------------------------------------------------
# Bad inputs (the shared CLI tests cover the rest)
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv, option, words",
    [
        (["--env-name", "CartPole-v1"], "--env-name", "discrete actions"),
        (["--log-std-init", "nan"], "--log-std-init", "finite"),
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
