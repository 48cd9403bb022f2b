"""The command line of every algorithm file, run as a user would: `python algorithms/X.py ...` in the
repository (handed over to the run harness), and the same file copied alone into an empty folder.

Every algorithm file has the same command line and writes the same run directory, so one set of
tests serves them all: each file's spec (tests/specs/<name>.py) says what a small run is and which
inputs are bad for it. Every run shares the session's compile cache (conftest.share_compile_cache), so only the
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
from specs import SMALL_SEEDS, SPECS, Spec

from conftest import ROOT, SPECIFIED, USER_SET_CPU_DEVICES, command_line, load_algorithm, run_dir_of
from onefile_harness import rundir, stats, xla

# Every file shares the run harness (tests/test_harness.py), so these command-line tests run on
# ppo.py in the fast loop and on the other files only with the slow tests (conftest reads this);
# the fast loop still runs every file's --help and bad-input cases from the command line.
SLOW_EXCEPT_PPO = {
    "test_small_run_writes_a_complete_run_directory",
    "test_second_run_gets_a_new_directory",
    "test_copied_script_runs_on_its_own",
    "test_load_run_and_make_act_act_as_the_evaluation",
    "test_load_run_and_make_act_act_as_the_harness_run_evaluation",
    "test_copied_script_refuses_the_harness_options",
}
# What only the harness does (a second run's directory, a sweep's files, exit 3 when a run's `finite` metric turns
# False: each file's own `finite` under divergence is tests/test_train.py's diverging sweep point), identical in every
# file.
# The hand-over to the harness (`__main__`) and a file's own command line (`main`, which refuses
# the harness's options) are the same text in every file (tests/test_files.py): on ppo.py only (conftest reads this).
ONLY_FOR = dict.fromkeys(
    (
        "test_second_run_gets_a_new_directory",
        "test_sweep_has_a_leading_sweep_axis",
        "test_diverging_run_exits_3_and_still_writes_results",
        "test_bad_input_from_the_command_line",
        "test_copied_script_refuses_the_harness_options",
    ),
    ("ppo",),
)
# The harness runs any file's train, Runner and HParams alike: a file made from another (conftest.BUILT_FROM) leaves
# its harness runs to that file's (a subprocess of about 13 s in CI) and keeps its copied-alone run.
SKIP_BUILT_FROM = {
    "test_small_run_writes_a_complete_run_directory",
    "test_load_run_and_make_act_act_as_the_harness_run_evaluation",
}
RUN_FILES = {"config.json", "summary.json", "metrics.npz", "params.msgpack", "learning_curve.png"}
ALONE_FILES = {"config.json", "metrics.npz", "params.msgpack", "summary.json"}  # a file run alone writes these
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


@pytest.fixture(scope="module", params=SPECIFIED)
def name(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def algo(name) -> Spec:
    return SPECS[name]


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
    summary = strict_json(run_dir / "summary.json")
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


def env_api(vec_env):
    """(reset(key), step(key, state, action) -> (obs, state, reward, done), contains(action)) of one env through its
    library's own API: gymnax's, or a multi-agent file's JaxMARL env, its agents stacked as the file stacks them (its
    step splits its key as the file's VecEnv does) and its reward the agents' mean."""
    env, env_params, agents = vec_env.env, vec_env.params, getattr(vec_env.env, "agents", None)
    if agents is None:
        space = env.action_space(env_params)

        def step(key, state, action):
            obs, state, reward, terminated, truncated, _ = env.step(key, state, action, env_params)
            return obs, state, reward, terminated | truncated

        return lambda key: env.reset(key, env_params), step, lambda action: bool(space.contains(action))
    stack = lambda values: jax.numpy.stack([values[agent] for agent in agents])  # noqa: E731

    def reset(key):
        obs, state = env.reset(key)
        return stack(obs), state

    def step(key, state, action):
        obs, state, reward, done, _ = env.step(key, state, dict(zip(agents, action, strict=True)))
        return stack(obs), state, stack(reward).mean(), done["__all__"]

    spaces = [env.action_space(agent) for agent in agents]
    return reset, step, lambda action: all(bool(s.contains(a)) for s, a in zip(spaces, action, strict=True))


def act_loop(module, config, params, rng: jax.Array) -> np.ndarray:
    """The returns of eval_episodes fresh envs stepped in a Python loop, as a user acts: make_act's act, vmapped over
    the envs, on their observations in the env's own shape, then the env library's own step (env_api), until each
    env's first episode ends; with the keys the evaluation draws (its reset key, then act and step keys each step).
    Act and step are jitted together, as in the evaluation: compiled apart, XLA's CPU code rounds CartPole's
    physics differently, which moves an episode of these barely trained policies by a step now and then."""
    act, n = module.make_act(config), config.eval_episodes
    vec_env, memory = module.VecEnv(config.env_name, 1), getattr(act, "memory", None)
    reset, step, _ = env_api(vec_env)
    if memory is not None:
        memory = jax.tree.map(lambda m: np.broadcast_to(m, (n, *np.shape(m))), memory)  # an array or a pytree

    @jax.jit
    def act_and_step(params, obs, state, memory, rng):
        rng, act_key, env_key = jax.random.split(rng, 3)
        seen = (obs, state) if getattr(act, "reads_state", False) else obs  # a planner reads the env's state too
        if memory is None:
            action = jax.vmap(act, in_axes=(None, 0, 0))(params, seen, jax.random.split(act_key, n))
        else:
            action, memory = jax.vmap(act, in_axes=(None, 0, 0, 0))(params, obs, jax.random.split(act_key, n), memory)
        return jax.vmap(step)(jax.random.split(env_key, n), state, action), memory, rng

    reset_key, rng = jax.random.split(rng)
    obs, state = jax.vmap(reset)(jax.random.split(reset_key, n))
    returns, alive = np.zeros(n, np.float32), np.ones(n, bool)
    for _ in range(vec_env.max_episode_steps):
        (obs, state, reward, done), memory, rng = act_and_step(params, obs, state, memory, rng)
        returns += np.where(alive, reward, 0).astype(np.float32)
        alive &= ~np.asarray(done)
        if not alive.any():
            break
    return returns


def check_load_run_and_make_act(module, algo, run_dir, lr):
    """load_run gives each seed's Config and parameters of `run_dir`, and make_act's act, looped over fresh envs one
    observation at a time, scores the greedy return the run holds: (config, params) of its last seed."""
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
    return config, params


def test_load_run_and_make_act_act_as_the_evaluation(algo, module, copied_script_run):
    """After training copied alone: load_run and make_act's greedy act score the run's greedy return; with
    greedy=False it acts within the action space."""
    config, params = check_load_run_and_make_act(module, algo, results_dir(*copied_script_run), SWEEP_LRS[1])
    sample = module.make_act(config, greedy=False)
    reset, _, contains = env_api(module.VecEnv(config.env_name, 1))
    (obs, state), memory = reset(jax.random.PRNGKey(0)), getattr(sample, "memory", None)
    obs = (obs, state) if getattr(sample, "reads_state", False) else obs  # a planner reads the env's state too
    for key in jax.random.split(jax.random.PRNGKey(1), 8):
        action = sample(params, obs, key) if memory is None else sample(params, obs, key, memory)[0]
        assert contains(action), action


def test_load_run_and_make_act_act_as_the_harness_run_evaluation(algo, module, small_run):
    """The same of a run through the harness, whose run directory is the harness's own."""
    check_load_run_and_make_act(module, algo, small_run[2], module.Config().lr)


def test_copied_script_runs_on_its_own(name, algo, module, copied_script_run):
    """Copied alone into an empty folder, the file trains with its own short command line and writes
    the run harness's format: the same files but the plot, the same array shapes and summary figures."""
    proc, workdir = copied_script_run
    assert_ok(proc)
    assert proc.stdout.startswith(f"{name}.py alone ")
    run_dir = results_dir(proc, workdir)
    assert run_dir.resolve().parent == (workdir / "runs").resolve()  # default --runs-dir, relative to cwd
    assert {p.name for p in workdir.iterdir()} == {f"{name}.py", "runs"}
    config, summary, metrics, params = load_run(run_dir, alone=True)
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
    assert "nan" not in proc.stdout.lower(), proc.stdout  # an update in which no episode ended says so
    assert re.search(r"^compiled in \d+\.\d s$", proc.stdout, re.M), proc.stdout  # before the first report
    # The harness's summary.json names for what the copy computes, and its figures: the same final returns
    # (onefile_harness/stats.py) and greedy mean; wall_seconds for benchmarks/compare.py.
    assert set(summary) <= SUMMARY_KEYS | {"trained_timesteps", "eval_seconds"}, set(summary) - SUMMARY_KEYS
    assert SUMMARY_KEYS - {"versions"} <= set(summary), SUMMARY_KEYS - set(summary)
    finals = stats.final_returns({k: metrics[k][0] for k in ("episode_return", "episodes_finished")})
    np.testing.assert_allclose(floats(summary["final_return_per_seed"]), finals, rtol=1e-6)
    assert summary["eval_return_mean"] == pytest.approx(float(metrics["eval_return"].mean()), rel=1e-6)
    assert (
        metrics["wall_seconds"].shape == (updates,) and summary["trained_timesteps"] == updates * algo.steps_per_update
    )
    show = lambda x: "n/a" if x is None else f"{x:.1f}"  # noqa: E731
    final = (
        f"final: return {show(summary['final_return_mean'])} ± {show(summary['final_return_std'])} over {SMALL_SEEDS}"
    )
    assert final in proc.stdout and f"greedy eval {show(summary['eval_return_mean'])}" in proc.stdout, proc.stdout
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
    if "network" in {field.name for field in dataclasses.fields(module.Config)}:  # the discrete files' torso
        cases["convolutions-of-a-vector"] = (["--network", "cnn"], "--network")
        cases["unknown-network"] = (["--network", "resnet"], "--network")
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
