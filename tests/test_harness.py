"""The run harness (algorithms/onefile_harness) as the command line uses it: XLA's flags set by the
command line alone, and a run directory that exists before anything compiles and keeps what a run
had when it stops early. Tested on ppo.py: every file reaches the harness through the same interface.
"""

import dataclasses
import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import ROOT, load_algorithm, run_main
from conftest import run_dir_of as results_dir
from onefile_harness import chunks, main, protocol, rundir
from onefile_harness.plan import plan_runs


def test_configure_sets_the_command_lines_flags():
    """Before JAX starts: one CPU device per core on a CPU-only install, the older XLA scheduler;
    flags the user set are kept. After JAX started, it warns and changes nothing."""
    code = f"""
import os, sys, warnings
sys.path.insert(0, {str(ROOT / "algorithms")!r})
from onefile_harness import xla
import jax
xla.configure()
flags = os.environ["XLA_FLAGS"]
print(len(jax.devices()), xla.cpu_cores(), xla.cpu_only())
print(flags)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    xla.configure()
print(os.environ["XLA_FLAGS"] == flags, len(caught), caught[0].message if caught else "")
"""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env["XLA_FLAGS"] = "--xla_backend_optimization_level=2"  # the user's choice wins
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    counts, flags, again = proc.stdout.strip().splitlines()
    devices, cores, cpu_only = counts.split()
    assert "--xla_cpu_enable_concurrency_optimized_scheduler=false" in flags
    assert "--xla_backend_optimization_level=2" in flags and "optimization_level=1" not in flags
    if cpu_only == "True":
        assert int(devices) == int(cores)
    assert again.startswith("True 1 ") and "already started" in again


# --------------------------------------------------------------------------------------
# The run directory
# --------------------------------------------------------------------------------------
SMALL = ["--total-timesteps", "2048", "--num-envs", "4", "--num-steps", "32", "--num-seeds", "2", "--quiet"]


@pytest.mark.parametrize("case", ["cannot-be-created", "under-a-file"])
def test_unusable_runs_dir_exits_2_before_anything_runs(case, tmp_path, capsys):
    ppo = load_algorithm("ppo")
    if case == "cannot-be-created":
        runs_dir = "/proc/no-such-runs-dir"
    else:
        (tmp_path / "a-file").write_text("not a directory")
        runs_dir = str(tmp_path / "a-file" / "runs")
    code, out, err = run_main(ppo, [*SMALL, "--runs-dir", runs_dir], capsys)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "--runs-dir" in lines[0] and "Traceback" not in err
    if case == "under-a-file":
        assert (tmp_path / "a-file").read_text() == "not a directory"


def test_run_dir_and_config_exist_before_compiling(tmp_path, capsys, monkeypatch):
    ppo = load_algorithm("ppo")
    seen = {}

    def compile_programs(algo, config, train, plan, population):
        seen["dirs"] = list(tmp_path.iterdir())
        seen["files"] = sorted(p.name for p in seen["dirs"][0].iterdir()) if seen["dirs"] else []
        raise KeyboardInterrupt  # stop here: this test is about what exists before compiling

    monkeypatch.setattr(main, "compile_programs", compile_programs)
    with pytest.raises(KeyboardInterrupt):
        main.command_line(ppo, [*SMALL, "--runs-dir", str(tmp_path)])
    assert len(seen["dirs"]) == 1 and seen["files"] == ["config.json"]
    config = json.loads((seen["dirs"][0] / "config.json").read_text())
    assert config["total_timesteps"] == 2048 and config["sweep"] == {}


@pytest.mark.parametrize("stop", [KeyboardInterrupt, RuntimeError])
def test_a_run_stopped_during_training_keeps_its_finished_updates(stop, tmp_path, capsys, monkeypatch):
    """Stopped after the second chunk (of 2 updates each): the run directory keeps config.json, the
    finished updates' metrics and a summary saying why; one line on stderr; no traceback."""
    ppo = load_algorithm("ppo")
    record_chunk, calls = chunks.record_chunk, []

    def record_then_stop(*args):
        metrics = record_chunk(*args)
        calls.append(1)
        if len(calls) == 2:
            raise stop("stopped by the test")
        return metrics

    monkeypatch.setattr(chunks, "record_chunk", record_then_stop)
    code, out, err = run_main(ppo, [*SMALL, "--runs-dir", str(tmp_path)], capsys)
    assert code == (130 if stop is KeyboardInterrupt else 1)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "after 4 of 16 updates" in lines[0] and "Traceback" not in err
    run_dir = results_dir(out)
    assert {p.name for p in run_dir.iterdir()} == {"config.json", "metrics.npz", "summary.json", "learning_curve.png"}
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["completed_updates"] == 4 and summary["num_updates"] == 16
    assert ("Ctrl-C" in summary["stopped"]) == (stop is KeyboardInterrupt)
    with np.load(run_dir / "metrics.npz") as metrics:
        assert metrics["episode_return"].shape == (1, 2, 4) and metrics["wall_seconds"].shape == (4,)
        np.testing.assert_array_equal(metrics["env_steps"][0, 0], [128, 256, 384, 512])


def test_a_plot_that_fails_costs_nothing_else(tmp_path, capsys, monkeypatch):
    ppo = load_algorithm("ppo")

    def broken_plot(*args):
        raise ValueError("no backend")

    monkeypatch.setattr(rundir, "learning_curves_png", broken_plot)
    code, out, err = run_main(ppo, [*SMALL, "--runs-dir", str(tmp_path)], capsys)
    assert code == 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith("warning: could not draw learning_curve.png (no backend)")
    run_dir = results_dir(out)
    assert {p.name for p in run_dir.iterdir()} == {
        "config.json",
        "metrics.npz",
        "summary.json",
        "params.msgpack",
        "checkpoint.msgpack",
    }


def test_runs_initialised_one_after_another_equal_the_vmapped_init():
    """On CPU the harness initialises its runs with lax.map (a vmapped init batches flax's LAPACK
    QRs, which deadlocked XLA's CPU pool): the runners are exactly those of jax.vmap(train.init)."""
    ppo = load_algorithm("ppo")
    config = dataclasses.replace(ppo.Config(), num_seeds=3, num_envs=4, num_steps=8, total_timesteps=64)
    train = ppo.make_train(config)
    plan = plan_runs(protocol.load(ppo), config, [{}, {"lr": 1e-3}])
    one_by_one = chunks.initial_runners(train, plan)
    vmapped = jax.jit(jax.vmap(train.init))(plan.keys, plan.hparams)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(one_by_one), jax.device_get(vmapped))


def test_no_harness_function_is_over_45_lines():
    """Functions of one job: each def of the harness, from its line to its last non-blank line, at most 45 lines."""
    long = []
    for path in sorted((ROOT / "algorithms" / "onefile_harness").glob("*.py")):
        text = path.read_text()
        for match in re.finditer(r"^( *)def (\w+)\(", text, re.M):
            end = re.compile(rf"^ {{0,{len(match.group(1))}}}\S", re.M).search(text, match.end())
            body = text[match.start() : end.start() if end else len(text)].rstrip()
            if body.count("\n") + 1 > 45:
                long.append(f"{path.name}: {match.group(2)} is {body.count(chr(10)) + 1} lines")
    assert not long, long
