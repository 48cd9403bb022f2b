"""The interface between the run harness and an algorithm file: the one place it is written down.

An algorithm file (`algorithms/<name>.py`) runs on its own; the harness reaches it only through
the names below, and refuses a file whose HARNESS_PROTOCOL is not this module's PROTOCOL.

    HARNESS_PROTOCOL     an int: the version of this interface the file was written against
    Config               a frozen dataclass; every field is a command-line flag, annotated
                         Annotated[type, "its help", *rules], each rule a Python expression in the
                         field's name that its value must satisfy. Fields env_name, total_timesteps, num_envs,
                         num_seeds, seed and eval_episodes; properties steps_per_update (env steps of
                         one update, all envs together) and num_updates
    HParams              a NamedTuple of the float hyperparameters a run reads at run time, so runs
                         with different values share one compiled program: the sweepable fields
    ConfigError          what validate, validate_hparams and make_train raise for input that cannot
                         work, with a message that names the option
    validate(config)     checks a Config's values without building anything
    validate_hparams(v)  checks a {field: value} dict against the fields' rules (one sweep point)
    VecEnv(env_name, n)  the file's vectorised env: reset(key) -> (obs, state) and
                         step(key, state, action) -> EnvStep(obs, state, reward, terminated,
                         truncated, final_obs), observations in the env's own shape and dtype, with
                         num_envs, max_episode_steps, obs_shape, obs_dtype, env and params (the gymnax
                         env; a multi-agent file's: the JaxMARL env, params None, observations and
                         actions with an agents axis, docs/multi-agent.md). The harness may hand
                         make_train and make_evaluate another object of this interface: suites.vec_env
    make_train(config, env=None)
                         -> train(rng, hparams=None) -> (runner, metrics), the whole run in `env`
                         (default: VecEnv(config.env_name, config.num_envs)), with
                         train.init(rng, hparams) -> runner and
                         train.update(runner, update_index) -> (runner, metrics of that update).
                         The runner is a NamedTuple; a field named `buffer` is the replay buffer;
                         --pbt needs `rng` (the run's key, which a member keeps when it copies
                         another) and `hparams` (the HParams every update reads, which explore changes).
                         Metrics include env_steps, episode_return, episodes_finished and finite
    saved_params(runner) what params.msgpack holds and make_evaluate's evaluate takes
    make_evaluate(config, env=None)
                         -> evaluate(params, rng) -> the mean return of eval_episodes greedy episodes
                         (env default: VecEnv(config.env_name, config.eval_episodes))
    make_act(config, greedy=True, env=None)
                         -> act(params, obs, key) -> action for one observation (vmapped for a
                         batch): the policy greedy evaluation, --render and users act with
                         (greedy=False: sampling as in training). A recurrent policy's act is
                         act(params, obs, key, memory) -> (action, memory), with act.memory the
                         memory an episode begins with. A planning policy's (act.reads_state, alphazero.py's)
                         is act(params, (obs, env_state), key): it searches from the env's state
    load_run(run_dir, seed=0, point=0)
                         -> (config, params) of one run of a run directory (not used by the harness:
                         what a user calls after training)

Everything else (sweeps, devices, chunks and progress, checkpoints, tracking, statistics, plots,
rendering, environment suites) is the harness's; the file knows none of it.
"""

import os
import types
from typing import Any, NamedTuple

PROTOCOL = 4  # 4: observations keep their shape (VecEnv.obs_shape, obs_dtype; no obs_dim, flat)
NAMES = (
    "Config",
    "HParams",
    "ConfigError",
    "validate",
    "validate_hparams",
    "make_train",
    "saved_params",
    "make_evaluate",
    "VecEnv",
    "make_act",
)


class UsageError(Exception):
    """Input the harness cannot use: reported in one line with exit status 2, before anything compiles."""


class Algorithm(NamedTuple):
    """An algorithm file, as the harness sees it."""

    name: str  # the file's name: ppo for algorithms/ppo.py
    Config: type
    HParams: type
    ConfigError: type
    validate: Any
    validate_hparams: Any
    make_train: Any
    saved_params: Any
    make_evaluate: Any
    VecEnv: type
    make_act: Any

    @property
    def sweepable(self) -> tuple:
        return self.HParams._fields


def load(module: types.ModuleType) -> Algorithm:
    """The algorithm `module` defines, or a UsageError naming what does not match this interface."""
    name = os.path.splitext(os.path.basename(module.__file__))[0]
    version = getattr(module, "HARNESS_PROTOCOL", None)
    if version != PROTOCOL:
        raise UsageError(
            f"{name}.py follows harness protocol {version}, this run harness protocol {PROTOCOL} "
            "(onefile_harness/protocol.py); update one of them, or run the file alone"
        )
    missing = [attr for attr in NAMES if not hasattr(module, attr)]
    if missing:
        raise UsageError(f"{name}.py lacks {', '.join(missing)} (onefile_harness/protocol.py)")
    return Algorithm(name, *(getattr(module, attr) for attr in NAMES))


def flag(name: str) -> str:
    """A Config field's command-line flag: num_envs -> num-envs (used as --num-envs)."""
    return name.replace("_", "-")
