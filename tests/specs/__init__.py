"""One spec per algorithm file: tests/specs/<name>.py holds `SPEC = Spec(...)`, everything the shared
tests look up per algorithm (tests/test_train.py, tests/test_cli.py, tests/test_learning.py, conftest's
slow marks and groups, and the command-line tests that reuse test_cli's small runs: test_resume,
test_pbt, test_sharding, test_suites). SPECS maps each file's name to its spec; tests/test_train.py
checks that every algorithms/*.py has one and every spec a file."""

import dataclasses
import importlib
import pathlib
from collections.abc import Callable

SMALL_SEEDS = 2  # the seeds of every small command-line run (`Spec.small`)
SOLVED = 475.0  # CartPole-v1's own "solved" threshold (episodes are capped at 500)
# The seeds of each learning test: the default command with `--num-seeds 4` (CI's budget; the default trains 8).
LEARNING_SEEDS = 4
# What every algorithm's update reports, each one value per update; a spec's `metrics` are the rest.
COMMON_METRICS = frozenset(
    {"env_steps", "episode_return", "episode_length", "episodes_finished", "loss", "grad_norm", "finite"}
)


@dataclasses.dataclass(frozen=True)
class Spec:
    # tests/test_train.py (and the file's own tests, through conftest's `config` fixture): an in-process
    # run, compiled once per session and shared by every test module that asks for it.
    train_config: dict  # Config fields of a small run (on CartPole-v1 unless they name another env)
    train_updates: int  # the updates that config gives
    other_lr: float  # a learning rate that is not the config's, for the sweep tests
    metrics: set  # what each update reports beyond COMMON_METRICS
    # tests/test_cli.py: the command line, run as a user runs it.
    small: tuple  # flags of a small run: SMALL_SEEDS seeds, a few updates (`cli_flags`)
    steps_per_update: int  # env steps per update of one run in that small run
    bad_inputs: dict  # algorithm-specific bad inputs: id -> (flags, option named in the error)
    # tests/test_learning.py: the default Config learns `env`, with margins for another host's rounding (each seed
    # follows another trajectory there): benchmarks/results/seeds_cpu.md counts the seeds of --seed 0, 1 and 2 (24)
    # that reach `target` here, and `reach` leaves room below that share.
    target: float  # the final return a seed should reach (the README's target, or that of `learning_flags`' run)
    reach: int = LEARNING_SEEDS  # how many of the learning test's LEARNING_SEEDS seeds must reach it
    greedy_target: float | None = None  # the greedy evaluation's return that `reach` seeds must reach as well
    learning_checks: Callable | None = None  # (module, config, metrics, greedy, tmp_path): more checks
    # Flags the learning test adds to the default command: a shorter run of the default Config, for the files whose
    # default would take most of CI's budget, with `target` what that run reaches (the default's own seed counts
    # over 24 seeds stay benchmarks/bench_seeds.py's: benchmarks/results/seeds_cpu.md).
    learning_flags: tuple = ()
    # The file this one was made from, whose observations, actions and buffer are its own: a suite's
    # env reaches this one as it reaches that one (tests/test_suites.py), and the fast loop leaves its
    # runs of the shared tests (conftest.SHARED_TEST_MODULES) to CI: their own tests, against NumPy, stay.
    built_from: str | None = None
    # HParams fields' flags whose values make training produce NaN or inf (tests/test_train.py's diverging point).
    diverge: tuple = ("--lr", "1e30", "--max-grad-norm", "1e30")
    wrong_action_env: str = "Pendulum-v1"  # an environment whose action space the file refuses
    # Its env is JaxMARL's: agents an axis of the observations and actions, the shared block "every multi-agent file"'s.
    multi_agent: bool = False
    env: str = "CartPole-v1"  # the default Config's env (that of the small command-line run)
    obs_dim: int = 4  # that env's flat observation size
    return_range: tuple = (0, 500)  # every episode return that env can give
    first_kernel: str = "Dense_0/kernel"  # params path suffix of the layer that reads the observation
    # (rtol, atol) between command-line runs that must agree up to float reassociation (a sweep point and a
    # plain run; sharded and single-device runs): training grows 1e-7 rounding differences over updates.
    tolerance: tuple = (1e-4, 1e-5)
    # (rtol, atol) for tests/test_train.py's in-process runs; None: its own RTOL, ATOL.
    train_tolerance: tuple | None = None
    # (Config changes, rtol) under which test_train's all-fields sweep check runs, where the config's own
    # program is not smooth enough for it; None: the config as it is.
    sweep_check: tuple | None = None

    @property
    def small_updates(self) -> int:
        """The updates of the small command-line run."""
        flags = dict(zip(self.small[::2], self.small[1::2], strict=False))
        return int(flags["--total-timesteps"]) // self.steps_per_update


def cli_flags(**fields) -> tuple:
    """Config fields as command-line flags: cli_flags(num_envs=4) == ("--num-envs", "4")."""
    return tuple(item for field, value in fields.items() for item in ("--" + field.replace("_", "-"), str(value)))


def _load() -> dict:
    specs = {}
    for path in sorted(pathlib.Path(__file__).parent.glob("*.py")):
        if path.stem != "__init__":
            spec = getattr(importlib.import_module(f"{__name__}.{path.stem}"), "SPEC", None)
            assert isinstance(spec, Spec), f"tests/specs/{path.name} defines no SPEC = Spec(...)"
            specs[path.stem] = spec
    return specs


SPECS = _load()  # name -> Spec, one per file of tests/specs/
