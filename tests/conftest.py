"""Shared fixtures for the algorithm tests.

algorithms/*.py are single-file scripts, not a package, so they are imported from their paths,
each once per session (`load_algorithm`), so the whole session shares one copy of each module
and its jit caches. Importing one does nothing but define things; the tests then ask for the
command line's XLA set-up explicitly (the run harness's), before any test starts JAX's backend.
The run harness, algorithms/onefile_harness, is imported as a package from algorithms/.
"""

import collections
import importlib.util
import os
import pathlib
import sys

import jax
import numpy as np
import pytest
from specs import SPECS  # tests/specs/: one per algorithm file

ROOT = pathlib.Path(__file__).resolve().parents[1]
PPO_PATH = ROOT / "algorithms" / "ppo.py"
sys.path.insert(0, str(ROOT / "algorithms"))  # the run harness package beside the files
import onefile_harness  # noqa: E402
from onefile_harness import xla  # noqa: E402

ALGORITHM_NAMES = sorted(path.stem for path in (ROOT / "algorithms").glob("*.py"))
# The algorithms the shared tests run: those with a spec and a file (tests/test_train.py checks that
# every file has a spec and every spec a file).
SPECIFIED = [name for name in SPECS if name in ALGORITHM_NAMES]


def _load(name: str, path: pathlib.Path):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses/typing look classes' modules up here
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


# What the user asked for before configure_xla added its flags.
USER_SET_CPU_DEVICES = (
    "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "") or "JAX_NUM_CPU_DEVICES" in os.environ
)
_PPO = _load("ppo", PPO_PATH)


# The tests' own XLA flag, beyond the command line's: XLA:CPU's fusion emitters off. Most tests
# compile small programs and run them briefly, and without the emitters XLA compiles them with about
# 40% less CPU time on this machine (the bulk of CI's time), while training runs 20-100% slower.
# What trains for real (tests/test_learning.py, the suites' learning tests, the documented
# commands) runs the command line in a process of its own with the command line's flags alone:
# `command_line_env()`, so that what is asserted to learn is what users run.
TEST_XLA_FLAGS = ("--xla_cpu_use_fusion_emitters=false",)


def pytest_configure(config):
    """The tests train with the command line's XLA flags (XLA's concurrent CPU scheduler has
    deadlocked vmapped PPO) and TEST_XLA_FLAGS, set before anything starts JAX's backend."""
    xla.configure()
    for flag in TEST_XLA_FLAGS:
        if flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    share_compile_cache()


def command_line_env(**changes) -> dict:
    """This process's environment for a command line that must run as a user's does: XLA_FLAGS
    without TEST_XLA_FLAGS (the command line adds its own), plus `changes`."""
    flags = [flag for flag in os.environ.get("XLA_FLAGS", "").split() if flag not in TEST_XLA_FLAGS]
    return {**os.environ, "XLA_FLAGS": " ".join(flags), **changes}


def share_compile_cache() -> None:
    """One persistent compilation cache for the whole session: the runs made in this process, the
    command lines the tests start, and pytest-xdist's workers (started after this, they inherit
    the variable), so a program one test compiled is loaded by the next. It is the directory
    JAX_COMPILATION_CACHE_DIR names (CI's, cold), else the command line's own (warm from earlier
    sessions, which keeps the fast loop fast)."""
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", xla.DEFAULT_COMPILE_CACHE)
    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])


def command_line(module, argv) -> int:
    """`python algorithms/<name>.py ARGV` in this process: the file's command line in the repository."""
    if hasattr(module, "HARNESS_PROTOCOL"):
        return onefile_harness.command_line(module, [str(a) for a in argv])
    return module.main([str(a) for a in argv])


# [T=6, N=5] episode-boundary patterns for the return tests (GAE, Q(lambda), ...), one env per column:
#   0: no boundary at all (bootstraps from the next value at the end of the rollout)
#   1: terminated mid-rollout (t=2), then terminated at the last step
#   2: truncated mid-rollout (t=1) and truncated at the last step
#   3: terminated AND truncated at the same step (t=3), and both at the last step
#   4: two boundaries in a row (truncated t=2, terminated t=3), nothing at the last step
TERMINATED = np.array(
    [
        [0, 0, 0, 0, 0],
        [0, 0, 0, 0, 0],
        [0, 1, 0, 0, 0],
        [0, 0, 0, 1, 1],
        [0, 0, 0, 0, 0],
        [0, 1, 0, 1, 0],
    ],
    bool,
)
TRUNCATED = np.array(
    [
        [0, 0, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 0, 0, 1],
        [0, 0, 0, 1, 0],
        [0, 0, 0, 0, 0],
        [0, 0, 1, 1, 0],
    ],
    bool,
)


def check_bootstrap_at_truncation_only(returns_of, next_value, gamma: float, lam: float) -> None:
    """`returns_of(next_value)` -> [T, N] lambda-returns (or advantages) on the TERMINATED/TRUNCATED
    patterns, where next_value[t] is the value of step t's true next observation (before auto-reset).
    Raising next_value where env 2 is truncated (t=1) moves that step by gamma * 10 and the step before
    by gamma * lam * gamma * 10 (same episode), nothing else; at a termination it changes nothing."""
    base = returns_of(next_value)
    bumped = next_value.copy()
    bumped[1, 2] += 10.0
    diff = returns_of(bumped) - base
    np.testing.assert_allclose(diff[1, 2], gamma * 10.0, rtol=1e-5)
    np.testing.assert_allclose(diff[0, 2], gamma * lam * gamma * 10.0, rtol=1e-5)
    np.testing.assert_array_equal(diff[2:, 2], 0.0)  # the next episode is untouched
    others = np.ones_like(diff, bool)
    others[:, 2] = False
    np.testing.assert_array_equal(diff[others], 0.0)
    for t, n in np.argwhere(TERMINATED):
        bumped = next_value.copy()
        bumped[t, n] += 10.0
        np.testing.assert_array_equal(returns_of(bumped), base, err_msg=f"terminated at t={t}, env {n}")


SHORT_LIMIT = 12  # a CartPole time limit that random play reaches often, next to its terminations


def short_episodes(module, num_envs: int, env_name: str = "CartPole-v1-no-velocity"):
    """The memory files' VecEnv of velocity-hidden CartPole with its time limit cut to SHORT_LIMIT steps, so that
    a short rollout holds truncations as well as terminations (ppo_rnn.py's and ppo_trxl.py's tests)."""
    env = module.VecEnv(env_name, num_envs)
    env.params = env.params.replace(max_steps_in_episode=SHORT_LIMIT)
    env.max_episode_steps = SHORT_LIMIT
    return env


def algorithm_of(item) -> str | None:
    """The algorithm file a test exercises: its `name` parameter, else its module's name
    (test_sac_loss.py -> sac), else None."""
    callspec = getattr(item, "callspec", None)
    if callspec and "name" in callspec.params:
        return callspec.params["name"]
    module = item.module.__name__.removeprefix("test_")
    matches = [n for n in ALGORITHM_NAMES if module == n or module.startswith(n + "_")]
    return max(matches, key=len, default=None)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups given here
def pytest_collection_modifyitems(config, items):
    """A test module's SLOW_EXCEPT_PPO names tests that are `slow` for every file but ppo.py, its
    ONLY_FOR tests (of the harness's behaviour, the same for any file) that run for the files named
    only, its SKIP_BUILT_FROM tests that skip the files of BUILT_FROM (CI's time budget). A test
    skipped here asks for no fixture: a module fixture (a run) is not made for it.
    Under pytest-xdist (`--dist loadgroup`, pytest.ini) the tests of one algorithm run in one
    worker, so each small program is compiled once (the _SHARED cache is per process)."""
    mark_slow_and_group(items)
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: the order in which groups are handed out
        costliest_groups_first(items)


# Files made from another file (their specs' built_from): the fast loop leaves their runs of the shared
# tests in SHARED_TEST_MODULES to CI; tests/test_suites.py leaves their suite runs to that file's.
BUILT_FROM = {name: spec.built_from for name, spec in SPECS.items() if spec.built_from}
SHARED_TEST_MODULES = ("test_train", "test_cli")


def mark_slow_and_group(items) -> None:
    for item in items:
        slow_except_ppo = getattr(item.module, "SLOW_EXCEPT_PPO", ())
        algorithm = algorithm_of(item)
        if item.originalname in slow_except_ppo and algorithm != "ppo":
            item.add_marker(pytest.mark.slow)
        if algorithm in BUILT_FROM and item.module.__name__ in SHARED_TEST_MODULES:
            item.add_marker(pytest.mark.slow)
        only_for = getattr(item.module, "ONLY_FOR", {}).get(item.originalname)
        if only_for and algorithm not in only_for:
            files = ", ".join(f"{name}.py" for name in only_for)
            item.add_marker(
                pytest.mark.skip(reason=f"the harness's behaviour, the same for any file: tested on {files}")
            )
        if item.originalname in getattr(item.module, "SKIP_BUILT_FROM", ()) and algorithm in BUILT_FROM:
            reason = f"the harness's handling of any Runner and HParams: tested on {BUILT_FROM[algorithm]}.py"
            item.add_marker(pytest.mark.skip(reason=reason))
        if algorithm is not None:
            # The command-line and sharding tests share subprocess runs, not in-process programs: groups of their own.
            prefix = {"test_cli": "cli-", "test_sharding": "sharding-"}.get(item.module.__name__, "")
            item.add_marker(pytest.mark.xdist_group(prefix + algorithm))


def costliest_groups_first(items) -> None:
    """pytest-xdist hands each worker one group at a time, in the order of `items` (pytest.ini turns
    off its own reordering by group size): the costliest groups go first, so that the last ones
    to finish are short and no worker waits long for the other. A slow test costs ten others."""
    group = lambda item: mark.args[0] if (mark := item.get_closest_marker("xdist_group")) else item.nodeid  # noqa: E731
    cost = collections.Counter()
    for item in items:
        cost[group(item)] += 10 if item.get_closest_marker("slow") else 1
    items.sort(key=lambda item: -cost[group(item)])  # stable: each group's tests keep their order


def numpy_mlp(params, x):
    """A flax MLP of Dense_0..Dense_k in float64 NumPy: relu hidden layers, linear output."""
    layers = params["params"]
    x = np.asarray(x, np.float64)
    names = sorted(layers, key=lambda name: int(name.split("_")[1]))
    for i, name in enumerate(names):
        x = x @ np.asarray(layers[name]["kernel"], np.float64) + np.asarray(layers[name]["bias"], np.float64)
        if i < len(names) - 1:
            x = np.maximum(x, 0.0)
    return x


def run_main(module, argv, capsys):
    """An algorithm file's command line in this process: (exit code, stdout, stderr)."""
    code = command_line(module, argv)
    out, err = capsys.readouterr()
    return code, out, err


def run_dir_of(out: str) -> pathlib.Path:
    """The run directory named by the `results: DIR` last line of the command line's stdout."""
    last = out.strip().splitlines()[-1]
    assert last.startswith("results: "), out
    return pathlib.Path(last[len("results: ") :])


def load_algorithm(name: str):
    """algorithms/<name>.py as a module, loaded once per session."""
    return _load(name, ROOT / "algorithms" / f"{name}.py")


_SHARED = {}


def _shared(key, make):
    if key not in _SHARED:
        _SHARED[key] = make()
    return _SHARED[key]


@pytest.fixture(scope="module")
def config(name):
    """The small training config of algorithm `name`'s spec (CartPole-v1 unless it names another env),
    compiled once per session and shared by tests/test_train.py and the algorithm's own test file; a
    module says which algorithm it tests with a `name` fixture."""
    spec = SPECS[name]
    config = load_algorithm(name).Config(**{"env_name": "CartPole-v1", **spec.train_config})
    assert config.num_updates == spec.train_updates and config.lr != spec.other_lr
    return config


@pytest.fixture(scope="module")
def train(name, config):
    return _shared(("train", name), lambda: load_algorithm(name).make_train(config))


@pytest.fixture(scope="module")
def keys():
    return jax.random.split(jax.random.PRNGKey(42), 3)


@pytest.fixture(scope="module")
def single(name, train, keys):
    """jax.jit(train) on keys 0 and 1, and on key 0 a second time."""

    def make():
        run = jax.jit(train)
        return [jax.device_get(run(key)) for key in (keys[0], keys[1], keys[0])]

    return _shared(("single", name), make)


@pytest.fixture(scope="module")
def batched(name, train, keys):
    """jax.jit(jax.vmap(train)) on all three keys at once."""
    return _shared(("batched", name), lambda: jax.device_get(jax.jit(jax.vmap(train))(keys)))


@pytest.fixture(scope="session")
def ppo():
    return _PPO


@pytest.fixture(scope="session")
def root() -> pathlib.Path:
    return ROOT


@pytest.fixture(scope="session")
def ppo_path() -> pathlib.Path:
    return PPO_PATH
