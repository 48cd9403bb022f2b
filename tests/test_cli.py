"""The command line of every algorithm file, run as a user would: `python algorithms/X.py ...` in the
repository (handed over to the run harness), and the same file copied alone into an empty folder.

Every algorithm file has the same command line and writes the same run directory, so one set of
tests serves them all: ALGORITHMS says, per file, what a small run is and which inputs are bad
for it. Every run shares the session's compile cache (conftest.share_compile_cache), so only the
first run of each program shape pays for compilation; runs that differ only in float
hyperparameters (run-time inputs) reuse it, as do the in-process runs of other test files.
"""

import dataclasses
import hashlib
import json
import pathlib
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import serialization

from conftest import ROOT, USER_SET_CPU_DEVICES, command_line, load_algorithm, run_dir_of
from onefile_harness import rundir, stats, xla


@dataclasses.dataclass(frozen=True)
class Algorithm:
    small: tuple  # flags of a small run: 2 seeds, a few updates
    steps_per_update: int  # env steps per update of one run in that small run
    diverge: tuple  # flags that make training produce NaN or inf
    bad_inputs: dict  # algorithm-specific bad inputs: id -> (flags, option named in the error)
    wrong_action_env: str = "Pendulum-v1"  # an environment whose action space the file refuses
    env: str = "CartPole-v1"  # the env of the small run (its default Config's)
    obs_dim: int = 4  # that env's flat observation size
    return_range: tuple = (0, 500)  # every episode return that env can give
    first_kernel: str = "Dense_0/kernel"  # params path suffix of the layer that reads the observation
    # (rtol, atol) between runs that must agree up to float reassociation (a sweep point and a plain
    # run; sharded and single-device runs): training grows 1e-7 rounding differences over updates.
    tolerance: tuple = (1e-4, 1e-5)

    @property
    def small_updates(self) -> int:
        flags = dict(zip(self.small[::2], self.small[1::2], strict=False))
        return int(flags["--total-timesteps"]) // self.steps_per_update


SMALL_SEEDS = 2
# Every file shares the run harness (tests/test_harness.py), so these command-line tests run on
# ppo.py in the fast loop and on the other files only with the slow tests (conftest reads this);
# the fast loop still runs every file's --help and bad-input cases from the command line.
SLOW_EXCEPT_PPO = {
    "test_small_run_writes_a_complete_run_directory",
    "test_second_run_gets_a_new_directory",
    "test_diverging_run_exits_3_and_still_writes_results",
    "test_copied_script_runs_on_its_own",
    "test_load_run_and_make_act_act_as_the_evaluation",
    "test_copied_script_refuses_the_harness_options",
}
# What only the harness does (a second run's directory, a sweep's files), identical in every file.
# The hand-over to the harness (`__main__`) and a file's own command line (`main`, which refuses
# the harness's options) are the same text in every file (tests/test_files.py).
PPO_ONLY = {
    "test_second_run_gets_a_new_directory",
    "test_sweep_has_a_leading_sweep_axis",
    "test_bad_input_from_the_command_line",
    "test_copied_script_refuses_the_harness_options",
}
# dqn.py's small run: 2 seeds of 12 updates, gradient steps from update 3.
DQN_SMALL = (
    *("--total-timesteps", "2400", "--num-envs", "4", "--num-steps", "50", "--num-seeds", str(SMALL_SEEDS)),
    *("--buffer-size", "1000", "--batch-size", "32", "--learning-starts", "400", "--train-frequency", "4"),
    *("--target-update-frequency", "100", "--eval-episodes", "4"),
)
ALGORITHMS = {
    "ppo": Algorithm(
        small=("--total-timesteps", "2048", "--num-envs", "4", "--num-steps", "32", "--num-seeds", str(SMALL_SEEDS)),
        steps_per_update=128,
        diverge=("--lr", "1e30", "--max-grad-norm", "1e30"),
        bad_inputs={
            "minibatches-do-not-divide": (
                ["--num-envs", "4", "--num-steps", "32", "--num-minibatches", "3"],
                "--num-minibatches",
            )
        },
    ),
    "ppo_continuous": Algorithm(
        small=("--total-timesteps", "800", "--num-envs", "4", "--num-steps", "50", "--num-seeds", str(SMALL_SEEDS)),
        steps_per_update=200,
        diverge=("--lr", "1e30", "--max-grad-norm", "1e30"),
        bad_inputs={
            "minibatches-do-not-divide": (
                ["--num-envs", "4", "--num-steps", "32", "--num-minibatches", "3"],
                "--num-minibatches",
            ),
            "log-std-init-not-finite": (["--log-std-init", "inf"], "--log-std-init"),
        },
        wrong_action_env="CartPole-v1",
        env="Pendulum-v1",
        obs_dim=3,
        return_range=(-3300, 0),  # Pendulum pays at most pi^2 + 0.1 * 8^2 + 0.001 * 2^2 = 16.27 a step, 200 steps
        # Pendulum's dynamics amplify rounding differences ~10x per 40 steps: 1e-4 after 800 steps.
        tolerance=(2e-3, 1e-3),
    ),
    "ppo_rnn": Algorithm(
        small=("--total-timesteps", "2048", "--num-envs", "4", "--num-steps", "32", "--num-seeds", str(SMALL_SEEDS)),
        steps_per_update=128,
        diverge=("--lr", "1e30", "--max-grad-norm", "1e30"),
        bad_inputs={
            "minibatches-do-not-divide-envs": (["--num-envs", "4", "--num-minibatches", "3"], "--num-minibatches"),
            "negative-num-layers": (["--num-layers", "-1"], "--num-layers"),
        },
        env="CartPole-v1-no-velocity",
        obs_dim=2,
        first_kernel="input_gates/kernel",
    ),
    "ppo_trxl": Algorithm(
        small=("--total-timesteps", "2048", "--num-envs", "4", "--num-steps", "32", "--num-seeds", str(SMALL_SEEDS)),
        steps_per_update=128,
        diverge=("--lr", "1e30", "--max-grad-norm", "1e30"),
        bad_inputs={
            "minibatches-do-not-divide-envs": (["--num-envs", "4", "--num-minibatches", "3"], "--num-minibatches"),
            "heads-do-not-divide-width": (["--num-heads", "3"], "--num-heads"),
            "unknown-positional-encoding": (["--positional-encoding", "rope"], "--positional-encoding"),
        },
        env="CartPole-v1-no-velocity",
        obs_dim=2,
        first_kernel="embed/kernel",
    ),
    "ppo_rnd": Algorithm(
        small=("--total-timesteps", "2048", "--num-envs", "4", "--num-steps", "32", "--num-seeds", str(SMALL_SEEDS)),
        steps_per_update=128,
        diverge=("--lr", "1e30", "--max-grad-norm", "1e30"),
        bad_inputs={
            "minibatches-do-not-divide": (
                ["--num-envs", "4", "--num-steps", "32", "--num-minibatches", "3"],
                "--num-minibatches",
            ),
            "gamma-int-one": (["--gamma-int", "1"], "--gamma-int"),
            "update-proportion-zero": (["--update-proportion", "0"], "--update-proportion"),
            "negative-int-coef": (["--int-coef", "-1"], "--int-coef"),
            "rnd-size-zero": (["--rnd-size", "0"], "--rnd-size"),
            "sweep-rnd-lr-zero": (["--sweep", "rnd_lr=1e-3,0"], "--rnd-lr"),
        },
        env="DeepSea-bsuite",
        obs_dim=64,
        return_range=(-0.01, 1.0),  # 0.99 at the treasure; each move right costs 0.01 / 8
    ),
    "dqn": Algorithm(
        small=DQN_SMALL,
        steps_per_update=200,
        diverge=("--lr", "1e30", "--max-grad-norm", "1e30"),
        bad_inputs={
            "buffer-smaller-than-num-envs": (["--num-envs", "16", "--buffer-size", "8"], "--buffer-size"),
            # 2e9 slots of 41 B for 8 seeds: 656 GB; refused before allocating, naming the size.
            "buffer-beyond-memory": (["--buffer-size", "2000000000"], "656 GB"),
            "unknown-loss": (["--loss", "l1"], "--loss"),
            "sweep-tau-zero": (["--sweep", "tau=0.5,0"], "tau"),
        },
    ),
    # dqn.py's small run and buffer checks; the distributional heads' own options.
    "c51": Algorithm(
        small=DQN_SMALL,
        steps_per_update=200,
        diverge=("--lr", "1e30", "--max-grad-norm", "1e30"),
        bad_inputs={
            "buffer-smaller-than-num-envs": (["--num-envs", "16", "--buffer-size", "8"], "--buffer-size"),
            "one-atom": (["--num-atoms", "1"], "--num-atoms"),
            "v-min-not-below-v-max": (["--v-min", "5", "--v-max", "5"], "--v-min"),
        },
    ),
    # c51.py's, and the options rainbow.py adds.
    "rainbow": Algorithm(
        small=DQN_SMALL,
        steps_per_update=200,
        diverge=("--lr", "1e30", "--max-grad-norm", "1e30"),
        bad_inputs={
            "buffer-smaller-than-num-envs": (["--num-envs", "16", "--buffer-size", "8"], "--buffer-size"),
            "one-atom": (["--num-atoms", "1"], "--num-atoms"),
            "no-n-step": (["--n-step", "0"], "--n-step"),
            "alpha-above-one": (["--alpha", "1.5"], "--alpha"),
            "sweep-beta-negative": (["--sweep", "beta_start=0.4,-1"], "beta_start"),
            "priority-eps-zero": (["--priority-eps", "0"], "--priority-eps"),
        },
        first_kernel="NoisyDense_0/kernel",
    ),
    "qr_dqn": Algorithm(
        small=DQN_SMALL,
        steps_per_update=200,
        diverge=("--lr", "1e30", "--max-grad-norm", "1e30"),
        bad_inputs={
            "buffer-smaller-than-num-envs": (["--num-envs", "16", "--buffer-size", "8"], "--buffer-size"),
            "no-quantiles": (["--num-quantiles", "0"], "--num-quantiles"),
            "kappa-zero": (["--kappa", "0"], "--kappa"),
            "sweep-kappa-zero": (["--sweep", "kappa=1,0"], "kappa"),
        },
    ),
    "iqn": Algorithm(
        small=DQN_SMALL,
        steps_per_update=200,
        diverge=("--lr", "1e30", "--max-grad-norm", "1e30"),
        bad_inputs={
            "buffer-smaller-than-num-envs": (["--num-envs", "16", "--buffer-size", "8"], "--buffer-size"),
            "no-target-taus": (["--num-target-taus", "0"], "--num-target-taus"),
            "embedding-dim-zero": (["--embedding-dim", "0"], "--embedding-dim"),
            "sweep-kappa-nan": (["--sweep", "kappa=1,nan"], "kappa"),
        },
    ),
    "pqn": Algorithm(
        small=(
            "--total-timesteps",
            "1024",
            "--num-envs",
            "8",
            "--num-steps",
            "16",
            "--num-minibatches",
            "2",
            "--num-seeds",
            str(SMALL_SEEDS),
        ),
        steps_per_update=128,
        diverge=("--lr", "1e30", "--max-grad-norm", "1e30"),
        bad_inputs={
            "minibatches-do-not-divide": (
                ["--num-envs", "4", "--num-steps", "32", "--num-minibatches", "3"],
                "--num-minibatches",
            ),
            "epsilon-above-1": (["--eps-start", "1.5"], "--eps-start"),
            "lambda-below-0": (["--q-lambda", "-0.1"], "--q-lambda"),
            "zero-reward-scale": (["--reward-scale", "0"], "--reward-scale"),
            "sweep-epsilon-out-of-range": (["--sweep", "eps-end=0.1,2"], "--eps-end"),
            "sweep-ppo-only-field": (["--sweep", "gae-lambda=0.9"], "--sweep"),
        },
    ),
    "sac": Algorithm(
        small=(
            "--total-timesteps",
            "800",
            "--num-envs",
            "4",
            "--num-steps",
            "50",
            "--num-seeds",
            str(SMALL_SEEDS),
            "--buffer-size",
            "800",
            "--batch-size",
            "32",
            "--learning-starts",
            "200",
            "--hidden-size",
            "32",
            "--eval-episodes",
            "4",
        ),
        steps_per_update=200,
        diverge=("--lr", "1e30"),
        bad_inputs={
            "buffer-smaller-than-num-envs": (["--num-envs", "16", "--buffer-size", "8"], "--buffer-size"),
            # 2e9 slots of 33 B (Pendulum) for 8 seeds: 528 GB; refused before allocating, naming the size.
            "buffer-beyond-memory": (["--buffer-size", "2000000000"], "528 GB"),
            "negative-alpha": (["--alpha", "-0.1"], "--alpha"),
            "log-std-bounds-reversed": (["--log-std-min", "3"], "--log-std-min"),
            "zero-gradient-steps": (["--gradient-steps", "0"], "--gradient-steps"),
            "unknown-activation": (["--activation", "gelu"], "--activation"),
            "sweep-tau-zero": (["--sweep", "tau=0.5,0"], "tau"),
        },
        wrong_action_env="CartPole-v1",
        env="Pendulum-v1",
        obs_dim=3,
        return_range=(-3300, 0),  # Pendulum pays at most pi^2 + 0.1 * 8^2 + 0.001 * 2^2 = 16.27 a step, 200 steps
        first_kernel="actor/params/Dense_0/kernel",  # the critics' first layer reads obs and action
        tolerance=(2e-3, 1e-3),  # as ppo_continuous: Pendulum amplifies rounding differences
    ),
    "td3": Algorithm(
        small=(
            "--total-timesteps",
            "800",
            "--num-envs",
            "4",
            "--num-steps",
            "50",
            "--num-seeds",
            str(SMALL_SEEDS),
            "--buffer-size",
            "800",
            "--batch-size",
            "32",
            "--learning-starts",
            "200",
            "--hidden-size",
            "32",
            "--eval-episodes",
            "4",
        ),
        steps_per_update=200,
        diverge=("--lr", "1e30"),
        bad_inputs={
            "buffer-smaller-than-num-envs": (["--num-envs", "16", "--buffer-size", "8"], "--buffer-size"),
            "zero-policy-delay": (["--policy-delay", "0"], "--policy-delay"),
            "zero-critics": (["--num-critics", "0"], "--num-critics"),
            "negative-policy-noise": (["--policy-noise", "-0.1"], "--policy-noise"),
            "sweep-negative-noise-clip": (["--sweep", "noise-clip=0.5,-1"], "--noise-clip"),
        },
        wrong_action_env="CartPole-v1",
        env="Pendulum-v1",
        obs_dim=3,
        return_range=(-3300, 0),
        first_kernel="actor/params/Dense_0/kernel",
        tolerance=(2e-2, 2e-3),  # as ppo_continuous, and the twin minimum's kinks (tests/test_train.py)
    ),
}
RUN_FILES = {"config.json", "summary.json", "metrics.npz", "params.msgpack", "learning_curve.png"}
ALONE_FILES = {"config.json", "metrics.npz", "params.msgpack"}  # a file run alone writes these
SUMMARY_KEYS = {
    "algorithm",
    "env_name",
    "num_seeds",
    "total_timesteps",
    "final_return_mean",
    "final_return_std",
    "final_return_per_seed",
    "eval_return_mean",
    "compile_seconds",
    "train_seconds",
    "steps_per_second",
    "versions",
    "backend",
}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SWEEP_LRS = (1e-3, 3e-3)


@pytest.fixture(scope="module", params=[name for name in ALGORITHMS if (ROOT / "algorithms" / f"{name}.py").exists()])
def name(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def algo(name) -> Algorithm:
    return ALGORITHMS[name]


@pytest.fixture(scope="module")
def module(name):
    return load_algorithm(name)


@pytest.fixture(scope="module")
def script(name) -> pathlib.Path:
    return ROOT / "algorithms" / f"{name}.py"


@pytest.fixture(scope="module")
def cli(name, script):
    def run(*args, cwd=None, script=script, timeout=300):
        return subprocess.run(
            [sys.executable, str(script), *map(str, args)],
            cwd=cwd or ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    return run


def results_dir(proc, cwd) -> pathlib.Path:
    """The directory named by the `results: DIR` last line of stdout."""
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("results: "), proc.stdout
    return pathlib.Path(cwd, last[len("results: ") :])


def assert_ok(proc, code=0):
    assert proc.returncode == code, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr


def load_run(run_dir: pathlib.Path, alone: bool = False):
    """(config, summary, metrics, params) of a run directory: the run harness's, or (`alone`) one a
    file copied alone wrote, which has no learning curve."""
    assert {p.name for p in run_dir.iterdir()} >= (ALONE_FILES if alone else RUN_FILES)
    config = strict_json(run_dir / "config.json")
    summary = None if alone else strict_json(run_dir / "summary.json")  # a file alone prints its summary
    with np.load(run_dir / "metrics.npz") as npz:
        metrics = {k: npz[k] for k in npz.files}
    params = serialization.msgpack_restore((run_dir / "params.msgpack").read_bytes())
    if not alone:
        assert (run_dir / "learning_curve.png").read_bytes()[:8] == PNG_MAGIC
    return config, summary, metrics, params


def strict_json(path: pathlib.Path):
    """JSON as other tools read it: NaN and Infinity are not JSON (Python's json allows them)."""

    def refuse(constant):
        raise ValueError(f"{path.name}: {constant} is not valid JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


def floats(values) -> np.ndarray:
    """Summary numbers to an array; null (no value, e.g. no finished episode) becomes NaN."""
    return np.array([np.nan if v is None else v for v in values], float)


def snapshot(directory: pathlib.Path) -> dict:
    return {
        p.relative_to(directory): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def _leaves(tree, prefix=""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _leaves(value, f"{prefix}{key}/")
    else:
        yield prefix.rstrip("/"), np.asarray(tree)


@pytest.fixture(scope="module")
def small_run(algo, cli, tmp_path_factory):
    runs_dir = tmp_path_factory.mktemp("runs")
    proc = cli(*algo.small, "--runs-dir", runs_dir)
    assert_ok(proc)
    return proc, runs_dir, results_dir(proc, ROOT)


@pytest.fixture(scope="module")
def copied_script_run(name, algo, cli, script, tmp_path_factory):
    """The file copied alone into an empty directory and run there (the small run at lr=3e-3)."""
    workdir = tmp_path_factory.mktemp("alone")
    shutil.copy(script, workdir / f"{name}.py")
    proc = cli(*algo.small, "--lr", SWEEP_LRS[1], cwd=workdir, script=workdir / f"{name}.py")
    return proc, workdir


def test_small_run_writes_a_complete_run_directory(name, algo, module, small_run):
    proc, runs_dir, run_dir = small_run
    assert run_dir.parent.resolve() == runs_dir.resolve()
    assert [p.name for p in runs_dir.iterdir()] == [run_dir.name]
    check_run_directory(name, algo, module, run_dir, algo.small)
    config = strict_json(run_dir / "config.json")
    assert config["lr"] == module.Config().lr


def check_run_directory(name, algo, module, run_dir, flags):
    """Everything a small run (2 seeds, no sweep) with these flags must have written."""
    config, summary, metrics, params = load_run(run_dir)
    updates = algo.small_updates

    # config.json: the full Config as given on the command line.
    assert set(config) >= {f.name for f in dataclasses.fields(module.Config)}
    for flag, value in zip(flags[::2], flags[1::2], strict=True):
        assert str(config[flag[2:].replace("-", "_")]) == str(value), flag
    assert config["env_name"] == algo.env

    assert SUMMARY_KEYS <= set(summary), SUMMARY_KEYS - set(summary)
    assert summary["algorithm"] == name and summary["env_name"] == algo.env
    assert summary["num_seeds"] == SMALL_SEEDS and summary["total_timesteps"] == config["total_timesteps"]
    assert summary["backend"] == jax.default_backend()  # the child sees the same devices
    # Runs spread over at most one device each; a CPU-only install has one device per core.
    assert len(summary["devices"]) == min(jax.device_count(), SMALL_SEEDS)
    if xla.cpu_only() and not USER_SET_CPU_DEVICES:
        assert jax.device_count() == xla.cpu_cores()
    assert {"jax", "flax", "optax", "gymnax", "numpy"} <= set(summary["versions"])
    assert len(summary["final_return_per_seed"]) == SMALL_SEEDS
    for key in ("compile_seconds", "train_seconds", "steps_per_second"):
        assert summary[key] > 0, key
    assert "sweep" not in summary and "nonfinite" not in summary

    # metrics.npz: [updates] curves for every seed; consistent with the summary.
    episode_return = metrics["episode_return"]
    assert episode_return.shape[-2:] == (SMALL_SEEDS, updates)
    assert episode_return.size == SMALL_SEEDS * updates
    for metric in ("env_steps", "episodes_finished", "loss", "finite"):
        assert metrics[metric].shape == episode_return.shape, metric
    assert metrics["finite"].all()
    env_steps = metrics["env_steps"].reshape(-1, updates)
    np.testing.assert_array_equal(
        env_steps, np.broadcast_to(np.arange(1, updates + 1) * algo.steps_per_update, env_steps.shape)
    )
    finals = stats.final_returns(metrics).reshape(-1)
    np.testing.assert_allclose(floats(summary["final_return_per_seed"]), finals, rtol=1e-6)
    if not np.isnan(finals).all():
        assert summary["final_return_mean"] == pytest.approx(float(np.nanmean(finals)), rel=1e-6)
    assert metrics["eval_return"].size == SMALL_SEEDS
    assert summary["eval_return_mean"] == pytest.approx(float(np.mean(metrics["eval_return"])), rel=1e-6)
    assert algo.return_range[0] <= summary["eval_return_mean"] <= algo.return_range[1]

    # params.msgpack: every leaf of every seed's networks, finite.
    leaves = dict(_leaves(params))
    assert leaves
    for path, leaf in leaves.items():
        assert leaf.shape[:2] == (1, SMALL_SEEDS), (path, leaf.shape)  # [sweep points, seeds, ...]
        assert np.isfinite(leaf).all(), path
    first_kernels = [leaf for path, leaf in leaves.items() if path.endswith(algo.first_kernel)]
    assert first_kernels and all(k.shape[-2] == algo.obs_dim for k in first_kernels)


def test_second_run_gets_a_new_directory(algo, cli, small_run):
    _, runs_dir, first_dir = small_run
    before = snapshot(first_dir)
    proc = cli(*algo.small, "--runs-dir", runs_dir, "--quiet")
    assert_ok(proc)
    assert proc.stdout.strip().splitlines() == [proc.stdout.strip()], "--quiet prints only the results line"
    second_dir = results_dir(proc, ROOT)
    assert second_dir.resolve() != first_dir.resolve()
    assert sorted(p.name for p in runs_dir.iterdir()) == sorted([first_dir.name, second_dir.name])
    assert snapshot(first_dir) == before, "the first run's files were touched"
    # Same config and seed in a new process (compiled program from the cache): same training.
    _, _, first, _ = load_run(first_dir)
    _, _, second, _ = load_run(second_dir)
    for metric in set(first) - {"wall_seconds"}:  # wall-clock differs between any two runs
        np.testing.assert_array_equal(first[metric], second[metric], err_msg=metric)


def test_new_run_dir_never_reuses_a_directory(name, module, tmp_path):
    """Runs started within the same second (the name's timestamp) still get distinct directories."""
    new_run_dir = lambda: rundir.new_run_dir(name, str(tmp_path), module.Config().env_name)  # noqa: E731
    made = [pathlib.Path(new_run_dir()) for _ in range(3)]
    assert len({p.resolve() for p in made}) == 3
    assert all(p.is_dir() and p.parent == tmp_path for p in made)
    (made[0] / "marker").write_text("first")
    made.append(pathlib.Path(new_run_dir()))
    assert made[-1] not in made[:-1] and (made[0] / "marker").read_text() == "first"


@pytest.mark.slow  # the sweep's results as in-process runs: tests/test_train.py, in the fast loop
def test_sweep_has_a_leading_sweep_axis(algo, module, cli, tmp_path, copied_script_run):
    runs_dir = tmp_path / "runs"
    updates = algo.small_updates
    proc = cli(*algo.small, "--sweep", "lr=" + ",".join(map(str, SWEEP_LRS)), "--runs-dir", runs_dir)
    assert_ok(proc)
    config, summary, metrics, params = load_run(results_dir(proc, ROOT))
    assert metrics["episode_return"].shape == (len(SWEEP_LRS), SMALL_SEEDS, updates)
    assert metrics["loss"].shape == (len(SWEEP_LRS), SMALL_SEEDS, updates)
    np.testing.assert_allclose(metrics["sweep_lr"], SWEEP_LRS)
    assert config["sweep"] == {"lr": list(SWEEP_LRS)}
    point_config, point_params = module.load_run(results_dir(proc, ROOT), seed=1, point=1)  # the lr=3e-3 point
    assert point_config.lr == SWEEP_LRS[1] and point_config.num_seeds == SMALL_SEEDS
    for (path, got), (_, want) in zip(_leaves(point_params), _leaves(params), strict=True):
        np.testing.assert_array_equal(got, want[1, 1], err_msg=path)

    sweep = summary["sweep"]
    assert [point["sweep_point"] for point in sweep] == [{"lr": lr} for lr in SWEEP_LRS]
    finals = stats.final_returns(metrics)
    for point, final in zip(sweep, finals, strict=False):
        np.testing.assert_allclose(floats(point["final_return_per_seed"]), final, rtol=1e-6)
    means = floats([point["final_return_mean"] for point in sweep])
    np.testing.assert_allclose(means, [np.nanmean(f) if not np.isnan(f).all() else np.nan for f in finals], rtol=1e-6)
    best = sweep[int(np.argmax(np.nan_to_num(means, nan=-np.inf)))]
    assert summary["best_sweep_point"] == best["sweep_point"]
    assert summary["final_return_mean"] == best["final_return_mean"]
    # Parameters of every run: [sweep point, seed, ...].
    for path, leaf in _leaves(params):
        assert leaf.shape[:2] == (len(SWEEP_LRS), SMALL_SEEDS), path

    # The lr=3e-3 point trains exactly like a plain --lr 3e-3 run (here: the copied script's).
    alone_proc, workdir = copied_script_run
    assert_ok(alone_proc)
    _, _, plain, _ = load_run(results_dir(alone_proc, workdir), alone=True)
    point = {k: v[1] for k, v in metrics.items() if v.ndim == 3}
    for metric, value in point.items():
        want = plain[metric].reshape(value.shape)
        if value.dtype.kind == "f":
            rtol, atol = algo.tolerance  # a sweep program and a plain one may associate sums differently
            np.testing.assert_allclose(value, want, rtol=rtol, atol=atol, err_msg=metric)
        else:
            np.testing.assert_array_equal(value, want, err_msg=metric)
    assert not np.allclose(metrics["loss"][0], metrics["loss"][1], rtol=1e-3)


def act_loop(module, config, params, rng: jax.Array) -> np.ndarray:
    """The returns of eval_episodes fresh gymnax envs stepped in a Python loop, as a user acts: make_act's act,
    vmapped over the envs, on their observations in the env's own shape, then gymnax's step, until each env's
    first episode ends; with the keys the evaluation draws (its reset key, then act and step keys each step).
    Act and step are jitted together, as in the evaluation: compiled apart, XLA's CPU code rounds CartPole's
    physics differently, which moves an episode of these barely trained policies by a step now and then."""
    act, n = module.make_act(config), config.eval_episodes
    vec_env, memory = module.VecEnv(config.env_name, 1), getattr(act, "memory", None)
    env, env_params = vec_env.env, vec_env.params
    if memory is not None:
        memory = jax.tree.map(lambda m: np.broadcast_to(m, (n, *np.shape(m))), memory)  # an array or a pytree

    @jax.jit
    def act_and_step(params, obs, state, memory, rng):
        rng, act_key, env_key = jax.random.split(rng, 3)
        if memory is None:
            action = jax.vmap(act, in_axes=(None, 0, 0))(params, obs, jax.random.split(act_key, n))
        else:
            action, memory = jax.vmap(act, in_axes=(None, 0, 0, 0))(params, obs, jax.random.split(act_key, n), memory)
        step = jax.vmap(env.step, in_axes=(0, 0, 0, None))(jax.random.split(env_key, n), state, action, env_params)
        return step, memory, rng

    reset_key, rng = jax.random.split(rng)
    obs, state = jax.vmap(env.reset, in_axes=(0, None))(jax.random.split(reset_key, n), env_params)
    returns, alive = np.zeros(n, np.float32), np.ones(n, bool)
    for _ in range(vec_env.max_episode_steps):
        (obs, state, reward, terminated, truncated, _), memory, rng = act_and_step(params, obs, state, memory, rng)
        returns += np.where(alive, reward, 0).astype(np.float32)
        alive &= ~np.asarray(terminated | truncated)
        if not alive.any():
            break
    return returns


def test_load_run_and_make_act_act_as_the_evaluation(name, algo, module, small_run, copied_script_run):
    """After training, through the harness and copied alone: load_run gives each seed's Config and parameters,
    and make_act's act, looped over fresh envs one observation at a time, scores the greedy return the run
    holds; with greedy=False it acts within the action space."""
    for run_dir, lr in ((small_run[2], module.Config().lr), (results_dir(*copied_script_run), SWEEP_LRS[1])):
        eval_return = np.load(run_dir / "metrics.npz")["eval_return"]
        saved = serialization.msgpack_restore((run_dir / "params.msgpack").read_bytes())
        for seed in range(SMALL_SEEDS):
            config, params = module.load_run(run_dir, seed=seed)
            assert config.env_name == algo.env and config.lr == lr and config.num_seeds == SMALL_SEEDS
            for (path, got), (_, want) in zip(_leaves(params), _leaves(saved), strict=True):
                np.testing.assert_array_equal(got, want[0, seed], err_msg=path)
            rng = jax.random.split(jax.random.PRNGKey(config.seed + 1), config.num_seeds)[seed]
            returns = act_loop(module, config, params, rng)
            np.testing.assert_allclose(returns.mean(), eval_return[0, seed], rtol=1e-6)
    sample = module.make_act(config, greedy=False)
    vec_env = module.VecEnv(config.env_name, 1)
    obs, _ = vec_env.env.reset(jax.random.PRNGKey(0), vec_env.params)
    space, memory = vec_env.env.action_space(vec_env.params), getattr(sample, "memory", None)
    for key in jax.random.split(jax.random.PRNGKey(1), 8):
        action = sample(params, obs, key) if memory is None else sample(params, obs, key, memory)[0]
        assert bool(space.contains(action)), action


def test_copied_script_runs_on_its_own(name, algo, module, copied_script_run):
    """Copied alone into an empty folder, the file trains with its own short command line and writes
    the run harness's format: the same files but the plot, the same array shapes and summary figures."""
    proc, workdir = copied_script_run
    assert_ok(proc)
    assert proc.stdout.startswith(f"{name}.py alone ")
    run_dir = results_dir(proc, workdir)
    assert run_dir.resolve().parent == (workdir / "runs").resolve()  # default --runs-dir, relative to cwd
    assert {p.name for p in workdir.iterdir()} == {f"{name}.py", "runs"}
    config, _, metrics, params = load_run(run_dir, alone=True)
    assert config["lr"] == SWEEP_LRS[1] and config["num_seeds"] == SMALL_SEEDS and config["sweep"] == {}
    assert config["env_name"] == algo.env
    updates = algo.small_updates
    assert metrics["episode_return"].shape == metrics["loss"].shape == (1, SMALL_SEEDS, updates)
    assert metrics["eval_return"].shape == (1, SMALL_SEEDS)
    # Progress at every tenth of the run (rounded up: every ceil(updates / 10) updates) and at its end, then
    # the greedy return of every seed.
    progress = [line for line in proc.stdout.splitlines() if line.startswith("update ")]
    every = -(-updates // 10)
    tenths = [u for u in range(1, updates + 1) if u % every == 0 or u == updates]
    assert [line.split(":")[0] for line in progress] == [f"update {u}/{updates}" for u in tenths], proc.stdout
    assert all("env steps/s" in line for line in progress), proc.stdout
    (greedy,) = [line for line in proc.stdout.splitlines() if line.startswith("greedy return per seed ")]
    np.testing.assert_allclose(json.loads(greedy.split("seed ")[1]), metrics["eval_return"][0], atol=0.051)
    leaves = dict(_leaves(params))
    assert leaves and all(leaf.shape[:2] == (1, SMALL_SEEDS) for leaf in leaves.values())


def test_copied_script_refuses_the_harness_options(name, cli, script, tmp_path):
    """A flag only the run harness has stops the file run alone: exit 2, one line naming it, nothing
    written."""
    shutil.copy(script, tmp_path / f"{name}.py")
    proc = cli("--sweep", "lr=1e-3,3e-3", cwd=tmp_path, script=tmp_path / f"{name}.py", timeout=120)
    assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--sweep" in lines[0] and "run harness" in lines[0], proc.stderr
    assert {p.name for p in tmp_path.iterdir()} == {f"{name}.py"}


def test_diverging_run_exits_3_and_still_writes_results(algo, module, tmp_path, capsys):
    code, out, err = call_main(module, [*algo.small, *algo.diverge, "--runs-dir", tmp_path / "runs"], capsys)
    assert code == 3 and "Traceback" not in err, err
    _, summary, metrics, _ = load_run(run_dir_of(out))
    finite = metrics["finite"].reshape(-1, algo.small_updates)
    assert not finite.all()
    first_bad = int(np.argmin(finite.all(axis=0))) + 1  # 1-based, as users count updates
    assert summary["nonfinite"]["first_update"] == first_bad
    assert summary["nonfinite"]["env_steps"] == first_bad * algo.steps_per_update
    message = err.strip().splitlines()
    assert len(message) == 1 and re.search(rf"\bupdate {first_bad}\b", message[0]), err


def test_help_lists_every_option(module, capsys):
    code, out, _ = call_main(module, ["--help"], capsys)
    assert code == 0
    for field in dataclasses.fields(module.Config):
        assert "--" + field.name.replace("_", "-") in out, field.name
    for flag in ("--sweep", "--runs-dir", "--no-compile-cache", "--quiet"):
        assert flag in out, flag


COMMON_BAD_INPUTS = {
    "unknown-env": (["--env-name", "Nope-v0"], "--env-name"),
    "zero-envs": (["--num-envs", "0"], "--num-envs"),
    "negative-lr": (["--lr", "-1"], "--lr"),
    "not-an-int": (["--num-envs", "four"], "--num-envs"),
    "sweep-unknown-field": (["--sweep", "foo=1,2"], "--sweep"),
    "sweep-not-numbers": (["--sweep", "lr=abc"], "--sweep"),
    "sweep-value-out-of-range": (["--sweep", "gamma=0.9,1.5"], "gamma"),
    "unknown-flag": (["--no-such-flag", "1"], "--no-such-flag"),
}


def call_main(module, argv, capsys) -> tuple[int, str, str]:
    """The file's command line in this process: (exit status, stdout, stderr), argparse's exits
    (--help, its own errors) included. The small run and the copied file are tested in processes of
    their own (and ppo.py's bad input): what runs here is the harness, the same for every file."""
    try:
        code = command_line(module, argv)
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def test_bad_inputs_exit_2_with_one_line(algo, module, tmp_path, capsys):
    cases = {
        **COMMON_BAD_INPUTS,
        **algo.bad_inputs,
        "wrong-action-space": (["--env-name", algo.wrong_action_env], "--env-name"),
    }
    for case, (args, option) in cases.items():
        runs_dir = tmp_path / case
        code, out, err = call_main(module, [*args, "--runs-dir", runs_dir], capsys)
        assert code == 2, (case, code, err)
        assert "Traceback" not in err, (case, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1, (case, err)
        assert option in lines[0], (case, lines[0])
        assert out == "", case
        assert not runs_dir.exists() or not any(runs_dir.iterdir()), case


def test_bad_input_from_the_command_line(algo, cli, tmp_path):
    """One bad input as a user types it, in a process of its own: exit 2, one line, nothing written."""
    proc = cli("--env-name", algo.wrong_action_env, "--runs-dir", tmp_path / "runs", timeout=120)
    assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--env-name" in lines[0], proc.stderr
    assert not (tmp_path / "runs").exists()
