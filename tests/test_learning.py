"""Every algorithm's default Config learns its default environment, with margins that hold on a host that
rounds differently (each seed follows another trajectory there: tests/specs/__init__.py), in the expensive
tests: each file's default is the run a newcomer starts with `python algorithms/<name>.py`, and
each test is that command, in a process of its own with the command line's XLA flags, not the
tests' (conftest.TEST_XLA_FLAGS): its seeds spread over the host's XLA devices as the command line
spreads them (on this 2-core CPU, dqn.py's test took 29% less CPU time than on one device).
tests/test_train.py and tests/test_sharding.py show the command line trains as `train` does.
Each file's target and extra checks are in its spec (tests/specs/<name>.py). Each test runs the default command with
`--num-seeds 4` (LEARNING_SEEDS, half the default's 8: CI's budget), and where the default's steps would take much of
CI's budget (the DQN family's, ppo_trxl.py's, the multi-agent files'), the spec's learning_flags shorten it (dqn.py,
ppo_trxl.py, ippo.py, mappo.py) or give the files made from dqn.py bsuite's Catch (specs/dqn.py), and its target is
what that run reaches; the default's own seed
counts over 24 seeds are benchmarks/bench_seeds.py's (benchmarks/results/seeds_cpu.md)."""

import subprocess
import sys

import numpy as np
import pytest
from specs import LEARNING_SEEDS, SPECS

from conftest import ROOT, SPECIFIED, command_line, command_line_env, load_algorithm
from onefile_harness import stats


def command_line_run(module, flags, runs_dir, own_process=True) -> tuple[dict, np.ndarray]:
    """`python algorithms/<name>.py FLAGS`: the run's metrics ([seeds, updates] per name) and its
    greedy evaluation returns per seed (keys from seed + 1). In a process of its own with the command
    line's XLA flags (conftest.command_line_env), or else in this one (where the test registered an env)."""
    flags = [*map(str, flags), "--runs-dir", str(runs_dir), "--quiet"]
    if own_process:
        argv, env = [sys.executable, module.__file__, *flags], command_line_env()
        proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=840)
        assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-3000:]}"
    else:
        assert command_line(module, flags) == 0
    (run_dir,) = runs_dir.iterdir()
    with np.load(run_dir / "metrics.npz") as npz:
        metrics = {key: npz[key][0] for key in npz.files if key != "wall_seconds"}  # the one sweep point
    return metrics, metrics.pop("eval_return")


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", SPECIFIED)
def test_default_config_learns_across_seeds(name, tmp_path):
    """The default Config's seeds (LEARNING_SEEDS of them; run for fewer steps where the spec's learning_flags say)
    end at its spec's target (tests/specs/<name>.py), on the spec's env: at least `reach` of them (the greedy
    policies too, where the spec says), with the spec's learning_checks."""
    module, spec = load_algorithm(name), SPECS[name]
    target, extra_checks = spec.target, spec.learning_checks
    assert module.Config().env_name == spec.env
    assert module.Config().num_seeds >= 8, "the default must train several seeds side by side"
    flags = [*spec.learning_flags, "--num-seeds", LEARNING_SEEDS]
    metrics, greedy = command_line_run(module, flags, tmp_path / "runs")
    (run_dir,) = (tmp_path / "runs").iterdir()
    config, _ = module.load_run(run_dir)  # the Config the command line trained, from its config.json

    assert metrics["finite"].all()
    assert metrics["episode_return"].shape == (config.num_seeds, config.num_updates)
    assert greedy.shape == (config.num_seeds,)
    finals = stats.final_returns(metrics)
    assert finals.shape == (config.num_seeds,)
    assert not np.isnan(finals).any(), f"a seed finished no episode near the end: {finals}"
    reached = int((finals >= target).sum())
    assert reached >= spec.reach, f"{reached} seeds reached {target} (at least {spec.reach}): {np.round(finals, 1)}"
    if spec.greedy_target is not None:
        reached = int((greedy >= spec.greedy_target).sum())
        message = f"greedy returns per seed: {np.round(greedy, 2)} ({reached} reached {spec.greedy_target})"
        assert reached >= spec.reach, message
    if extra_checks:
        extra_checks(module, config, metrics, greedy, tmp_path)
