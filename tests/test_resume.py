"""Checkpoints and --resume: a run stopped with Ctrl-C and resumed equals the run that never
stopped, bit for bit, for every algorithm file; a checkpoint is whole or absent; what may not
change on resume is refused before anything is written.

Each run is the file's command line (the run harness) called in this process, with the small flags
of tests/test_cli.py; Ctrl-C is a real SIGINT sent to this process from inside training.
"""

import dataclasses
import hashlib
import json
import os
import pathlib
import signal
import types

import jax
import numpy as np
import pytest
from flax import serialization
from specs import SPECS
from test_cli import _leaves

from conftest import ROOT, command_line, load_algorithm, run_main
from conftest import run_dir_of as results_dir
from onefile_harness import checkpoints, chunks, plan, protocol, rundir

# Every file's resume test compiles its own programs: ppo.py's runs in the fast loop, the others
# with the slow tests (conftest reads this).
SLOW_EXCEPT_PPO = {"test_stopped_and_resumed_run_equals_the_run_that_never_stopped"}
# A checkpoint holds the whole Runner, whatever its fields, and resuming calls the same train.update: a file made from
# another (conftest.BUILT_FROM) is left to that one's resume test (each costs 15-25 s in CI), and checked here only for
# what it may add, a Runner field the checkpoint would not carry unchanged (the test below, at the cost of an init).
SKIP_BUILT_FROM = SLOW_EXCEPT_PPO


@pytest.fixture(scope="module", params=[n for n in SPECS if (ROOT / "algorithms" / f"{n}.py").exists()])
def name(request):
    return request.param


def load(run_dir: pathlib.Path):
    with np.load(run_dir / "metrics.npz") as npz:
        metrics = {k: npz[k] for k in npz.files}
    params = serialization.msgpack_restore((run_dir / "params.msgpack").read_bytes())
    return metrics, params, json.loads((run_dir / "summary.json").read_text())


def interrupt_at_chunk(monkeypatch, chunk: int) -> None:
    """Ctrl-C (SIGINT to this process) while the given chunk of updates is being recorded."""
    record_chunk, calls = chunks.record_chunk, []

    def record_and_interrupt(*args):
        calls.append(1)
        if len(calls) == chunk:
            os.kill(os.getpid(), signal.SIGINT)
        return record_chunk(*args)

    monkeypatch.setattr(chunks, "record_chunk", record_and_interrupt)


def test_stopped_and_resumed_run_equals_the_run_that_never_stopped(name, tmp_path, capsys, monkeypatch):
    module, small = load_algorithm(name), [*SPECS[name].small, "--quiet"]
    code, out, _ = run_main(module, [*small, "--runs-dir", tmp_path / "whole"], capsys)
    assert code == 0
    whole = results_dir(out)

    with monkeypatch.context() as patch:
        interrupt_at_chunk(patch, 2)
        code, out, err = run_main(module, [*small, "--runs-dir", tmp_path / "stopped"], capsys)
    assert code == 130, err
    stopped = results_dir(out)
    assert f"--resume {stopped}" in err.strip().splitlines()[-1] and "Traceback" not in err
    checkpoint = serialization.msgpack_restore((stopped / "checkpoint.msgpack").read_bytes())
    done = int(checkpoint["updates_done"])
    assert 0 < done < SPECS[name].small_updates

    code, out, err = run_main(module, ["--resume", stopped, "--quiet"], capsys)
    assert code == 0, err
    assert results_dir(out) == stopped
    (metrics, params, summary), (want_metrics, want_params, want_summary) = load(stopped), load(whole)
    assert metrics.keys() == want_metrics.keys()
    for key in set(metrics) - {"wall_seconds"}:  # wall-clock differs between any two runs
        np.testing.assert_array_equal(metrics[key], want_metrics[key], err_msg=key)
    want_leaves = dict(_leaves(want_params))
    for path, leaf in _leaves(params):
        np.testing.assert_array_equal(leaf, want_leaves[path], err_msg=path)
    for key in ("final_return_per_seed", "eval_return_mean", "final_return_iqm"):
        assert summary[key] == want_summary[key], key
    assert np.all(np.diff(metrics["wall_seconds"]) >= 0)


def test_every_runner_field_goes_through_a_checkpoint_unchanged(name, config, train, tmp_path):
    """Every file's runners (two seeds, as the harness makes them) saved by save_checkpoint, read back by
    load_checkpoint and put by restore_runner into runners made from other keys: every leaf, its dtype, shape and
    values as saved (a new Runner field of a dtype the checkpoint would not carry, say, fails here)."""
    algo, config = protocol.load(load_algorithm(name)), dataclasses.replace(config, num_seeds=2)
    runs = plan.plan_runs(algo, config, [{}])
    runner = chunks.initial_runners(train, runs)
    job = types.SimpleNamespace(algo=algo, run_dir=str(tmp_path), args=types.SimpleNamespace(checkpoint=True))
    job.args.checkpoint_buffer = True
    assert checkpoints.save_checkpoint(job, runs, runner, chunks.TrainingLog()) > 0
    others = runs._replace(keys=runs.keys[::-1].copy())
    fresh = chunks.initial_runners(train, others)
    restored = checkpoints.restore_runner(fresh, checkpoints.load_checkpoint(algo, str(tmp_path), config), runs)
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(restored), jax.tree.leaves(runner), strict=True):
        got, want = np.asarray(got), np.asarray(want)
        assert (got.dtype, got.shape) == (want.dtype, want.shape), jax.tree_util.keystr(path)
        np.testing.assert_array_equal(got, want, err_msg=jax.tree_util.keystr(path))


def snapshot(directory: pathlib.Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def finished_ppo_run(tmp_path_factory):
    """A small ppo.py run with a checkpoint every chunk."""
    ppo = load_algorithm("ppo")
    runs = tmp_path_factory.mktemp("runs")
    small = [*SPECS["ppo"].small, "--quiet", "--checkpoint-every", "1", "--runs-dir", runs]
    assert command_line(ppo, small) == 0
    (run_dir,) = runs.iterdir()
    return run_dir


@pytest.mark.parametrize(
    "argv, option",
    [
        (["--lr", "1e-2"], "--lr"),
        (["--num-envs", "8"], "--num-envs"),
        (["--sweep", "lr=1e-3,2e-3"], "--sweep"),
        (["--total-timesteps", "1024"], "--total-timesteps"),  # less than the run has trained
        (["--eval-only", "somewhere"], "--eval-only"),
    ],
)
def test_resume_refuses_what_may_not_change(finished_ppo_run, argv, option, capsys):
    ppo = load_algorithm("ppo")
    before = snapshot(finished_ppo_run)
    code, out, err = run_main(ppo, ["--resume", finished_ppo_run, *argv], capsys)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and option in lines[0], err
    assert snapshot(finished_ppo_run) == before


def test_resume_with_a_larger_budget_trains_the_rest(finished_ppo_run, capsys, tmp_path):
    import shutil

    ppo = load_algorithm("ppo")
    run_dir = tmp_path / "run"
    shutil.copytree(finished_ppo_run, run_dir)
    code, out, err = run_main(ppo, ["--resume", run_dir, "--total-timesteps", "4096", "--quiet"], capsys)
    assert code == 0, err
    metrics, _, summary = load(run_dir)
    assert metrics["env_steps"].shape[-1] == 32 and summary["trained_timesteps"] == 4096
    assert json.loads((run_dir / "config.json").read_text())["total_timesteps"] == 4096
    before, _, _ = load(finished_ppo_run)
    for key in set(before) - {"wall_seconds", "eval_return"}:  # the first 16 updates are the checkpoint's
        np.testing.assert_array_equal(metrics[key][..., :16], before[key], err_msg=key)


def test_a_checkpoint_is_whole_or_not_there(finished_ppo_run, tmp_path, monkeypatch):
    """write_file renames a finished file over the old one: a crash while writing (here: the
    rename fails) leaves the previous checkpoint loadable."""
    ppo = load_algorithm("ppo")
    path = tmp_path / "checkpoint.msgpack"
    path.write_bytes((finished_ppo_run / "checkpoint.msgpack").read_bytes())

    def crash(*args):
        raise OSError("disk full")

    monkeypatch.setattr(rundir.os, "replace", crash)
    with pytest.raises(OSError):
        rundir.write_file(str(path), b"half a checkpoint")
    monkeypatch.undo()
    config = ppo.Config(total_timesteps=2048, num_envs=4, num_steps=32)
    checkpoint = checkpoints.load_checkpoint(protocol.load(ppo), str(tmp_path), config)
    assert int(checkpoint["updates_done"]) == 16


@pytest.mark.slow
def test_resume_without_the_replay_buffer_refills_it(tmp_path, capsys, monkeypatch):
    dqn = load_algorithm("dqn")
    small = [*SPECS["dqn"].small, "--quiet", "--no-checkpoint-buffer"]
    with monkeypatch.context() as patch:
        interrupt_at_chunk(patch, 3)
        code, out, _ = run_main(dqn, [*small, "--runs-dir", tmp_path], capsys)
    assert code == 130
    run_dir = results_dir(out)
    checkpoint = serialization.msgpack_restore((run_dir / "checkpoint.msgpack").read_bytes())
    assert not checkpoint["buffer_saved"] and not any(".buffer" in key for key in checkpoint["runner"])
    code, out, err = run_main(dqn, ["--resume", run_dir], capsys)
    assert code == 0, err
    assert "replay buffer was not saved" in out
    metrics, _, _ = load(run_dir)
    assert metrics["finite"].all() and metrics["env_steps"].shape[-1] == SPECS["dqn"].small_updates
