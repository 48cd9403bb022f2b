"""The run harness that ends every algorithm file: the same text in all of them, no side effects
on import, XLA's flags set by the command line alone, and a run directory that exists before
anything compiles and keeps what a run had when it stops early.

Behaviour of the harness is tested once, on ppo.py: the identity test makes it hold for every file.
To change the harness, edit it in ppo.py and run `python tests/test_harness.py`, which copies it
into every other file.
"""

import difflib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, load_algorithm, run_main
from conftest import run_dir_of as results_dir

ALGORITHM_FILES = sorted((ROOT / "algorithms").glob("*.py"))
BANNER = "# " + "=" * 86 + "\n# Run harness:"


def split_at_banner(text: str, name: str) -> tuple[str, str]:
    """(the algorithm, the harness): the text before and from the banner on."""
    count = text.count(BANNER)
    if count != 1:
        raise AssertionError(f"{name}: expected the harness banner once, found it {count} times")
    index = text.index(BANNER)
    return text[:index], text[index:]


def harness_differences(texts: dict) -> list[str]:
    """One message per file whose harness differs from the first file's: which file, from which
    line of it, and a short diff."""
    (reference_name, reference_text), *others = texts.items()
    reference_start, reference = split_at_banner(reference_text, reference_name)
    messages = []
    for name, text in others:
        start, harness = split_at_banner(text, name)
        if harness == reference:
            continue
        ours, theirs = reference.splitlines(keepends=True), harness.splitlines(keepends=True)
        pairs = zip(ours, theirs, strict=False)  # the shorter one's length, then the first extra line
        first = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(ours), len(theirs)))
        diff = "".join(list(difflib.unified_diff(ours, theirs, reference_name, name, n=1))[:12])
        messages.append(
            f"{name}: its harness differs from {reference_name}'s from its line "
            f"{start.count(chr(10)) + first + 1} on:\n{diff}"
        )
    return messages


def test_every_file_has_the_same_harness():
    texts = {path.name: path.read_text() for path in ALGORITHM_FILES}
    assert len(texts) >= 5 and "ppo.py" in texts
    texts = {"ppo.py": texts.pop("ppo.py"), **texts}
    differences = harness_differences(texts)
    assert not differences, "the run harness must be the same in every file:\n" + "\n".join(differences)


def test_an_edited_harness_is_reported_with_file_and_line():
    texts = {path.name: path.read_text() for path in ALGORITHM_FILES}
    texts = {"ppo.py": texts.pop("ppo.py"), **texts}
    edited = texts["dqn.py"].replace("def new_run_dir(", "def new_run_directory(")
    assert edited != texts["dqn.py"]
    messages = harness_differences({**texts, "dqn.py": edited})
    assert len(messages) == 1 and messages[0].startswith("dqn.py:")
    line = edited.splitlines().index(next(x for x in edited.splitlines() if "def new_run_directory(" in x)) + 1
    assert f"from its line {line} on" in messages[0] and "new_run_directory" in messages[0]
    with pytest.raises(AssertionError, match="banner"):
        harness_differences({**texts, "pqn.py": texts["pqn.py"].replace(BANNER, "# harness")})


def test_importing_a_file_defines_things_and_does_nothing_else():
    """In a fresh interpreter, as a notebook or a user's script would: importing every file leaves
    XLA_FLAGS alone and JAX's backend unstarted, so the default single CPU device appears."""
    names = [path.stem for path in ALGORITHM_FILES]
    code = f"""
import os, sys
sys.path.insert(0, {str(ROOT / "algorithms")!r})
from jax._src import xla_bridge
for name in {names!r}:
    __import__(name)
    assert os.environ.get("XLA_FLAGS") is None, (name, os.environ.get("XLA_FLAGS"))
    assert not xla_bridge.backends_are_initialized(), name
import jax
print(len(jax.devices()), jax.default_backend())
"""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    count, backend = proc.stdout.split()
    if backend == "cpu":
        assert count == "1"


def test_configure_xla_sets_the_command_lines_flags():
    """configure_xla() before JAX starts: one CPU device per core on a CPU-only install, the older
    XLA scheduler; flags the user set are kept. After JAX started, it warns and changes nothing."""
    code = f"""
import os, sys, warnings
sys.path.insert(0, {str(ROOT / "algorithms")!r})
import ppo, jax
ppo.configure_xla()
flags = os.environ["XLA_FLAGS"]
print(len(jax.devices()), ppo.cpu_cores(), ppo.cpu_only())
print(flags)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    ppo.configure_xla()
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

    def compile_programs(config, plan):
        seen["dirs"] = list(tmp_path.iterdir())
        seen["files"] = sorted(p.name for p in seen["dirs"][0].iterdir()) if seen["dirs"] else []
        raise KeyboardInterrupt  # stop here: this test is about what exists before compiling

    monkeypatch.setattr(ppo, "compile_programs", compile_programs)
    with pytest.raises(KeyboardInterrupt):
        ppo.main([*SMALL, "--runs-dir", str(tmp_path)])
    assert len(seen["dirs"]) == 1 and seen["files"] == ["config.json"]
    config = json.loads((seen["dirs"][0] / "config.json").read_text())
    assert config["total_timesteps"] == 2048 and config["sweep"] == {}


@pytest.mark.parametrize("stop", [KeyboardInterrupt, RuntimeError])
def test_a_run_stopped_during_training_keeps_its_finished_updates(stop, tmp_path, capsys, monkeypatch):
    """Stopped after the second chunk (of 2 updates each): the run directory keeps config.json, the
    finished updates' metrics and a summary saying why; one line on stderr; no traceback."""
    ppo = load_algorithm("ppo")
    record_chunk, calls = ppo.record_chunk, []

    def record_then_stop(*args):
        metrics = record_chunk(*args)
        calls.append(1)
        if len(calls) == 2:
            raise stop("stopped by the test")
        return metrics

    monkeypatch.setattr(ppo, "record_chunk", record_then_stop)
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

    monkeypatch.setattr(ppo, "plot_learning_curves", broken_plot)
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


if __name__ == "__main__":  # python tests/test_harness.py: copy ppo.py's harness into every other file
    _, harness = split_at_banner((ROOT / "algorithms" / "ppo.py").read_text(), "ppo.py")
    for path in ALGORITHM_FILES:
        algorithm, _ = split_at_banner(path.read_text(), path.name)
        if algorithm + harness != path.read_text():
            path.write_text(algorithm + harness)
            print(f"{path.name}: harness replaced by ppo.py's")
