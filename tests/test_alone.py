"""Mistakes a researcher makes in a copied, edited file, met as they would meet them: a mistyped option, a new
Config field named like an existing one, a field added without help, an environment that cannot be built.
Each is refused in one line with exit 2 before anything compiles or is written, by the file alone and by the
run harness alike (the block that does it is the same text in every file: tests/test_files.py)."""

import os
import subprocess
import sys

import pytest

from conftest import ALGORITHM_NAMES, ROOT
from onefile_harness import cli

DQN = (ROOT / "algorithms" / "dqn.py").read_text()
FIELD = '    tau: Annotated[float, "target <- tau'  # dqn.py's Polyak rate


def edited_copy(tmp_path, name: str, text: str, harness: bool):
    """`text` saved as tmp_path/name.py, with the run harness beside it or not."""
    (tmp_path / f"{name}.py").write_text(text)
    if harness:
        (tmp_path / "onefile_harness").symlink_to(ROOT / "algorithms" / "onefile_harness")
    return tmp_path / f"{name}.py"


def run(path, *args, timeout=120):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.run(
        [sys.executable, str(path), *args], cwd=path.parent, capture_output=True, text=True, timeout=timeout, env=env
    )


def refused(proc, *words) -> str:
    """The one line of a refusal (exit 2, nothing on stdout), which holds every one of `words`."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and proc.stdout == "" and len(lines) == 1, proc.stderr
    assert all(word in lines[0] for word in words), lines[0]
    return lines[0]


def with_field(text: str, line: str) -> str:
    """dqn.py with one more Config field, written after its `tau` field."""
    start = text.index(FIELD)
    end = text.index("\n", start) + 1
    return text[:end] + line + "\n" + text[end:]


@pytest.mark.parametrize("harness", [False, True], ids=["alone", "harness"])
def test_a_mistyped_option_names_the_closest_one(tmp_path, harness):
    """A new field `m_tau` is --m-tau; `--mtau` names it, and the file alone does not blame the harness."""
    text = with_field(DQN, '    m_tau: Annotated[float, "Munchausen temperature", "0 < m_tau < inf"] = 0.03')
    path = edited_copy(tmp_path, "mdqn", text, harness)
    line = refused(run(path, "--mtau", "0.1"), "--mtau", "did you mean --m-tau?")
    assert "harness" not in line
    refused(run(path, "--num-env", "3"), "did you mean --num-envs?")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["mdqn.py"] + ["onefile_harness"] * harness)


def test_the_file_alone_names_the_harness_only_for_the_harness_options():
    """The copy's list of the harness's options is the harness's own (cli.OPTIONS), every one of them."""
    dqn = __import__("dqn")
    harness = {name.removeprefix("--") for _, name, _, _ in cli.OPTIONS} - {"runs-dir"}
    assert set(dqn.HARNESS_OPTIONS.split()) == harness
    message = dqn.unknown_option("dqn.py", ["--pbt-interval", "5"], ["--lr"])
    assert "run harness" in message and "--pbt-interval" in message
    assert "harness" not in dqn.unknown_option("dqn.py", ["--pbt-intervall", "5"], ["--lr"])


@pytest.mark.parametrize("harness", [False, True], ids=["alone", "harness"])
def test_a_field_named_twice_is_refused(tmp_path, harness):
    """A second `tau` (the Munchausen temperature's name in the paper) would silently replace the Polyak rate."""
    text = with_field(DQN, '    tau: Annotated[float, "Munchausen temperature", "0 < tau < inf"] = 0.03')
    path = edited_copy(tmp_path, "mdqn", text, harness)
    refused(run(path, "--total-timesteps", "1000"), "Config names tau twice")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["mdqn.py"] + ["onefile_harness"] * harness)


@pytest.mark.parametrize("harness", [False, True], ids=["alone", "harness"])
def test_a_plain_field_becomes_a_flag(tmp_path, harness):
    """`my_coef: float = 0.1`, with no help annotation, is --my-coef; a type no flag can take is refused."""
    path = edited_copy(tmp_path, "mdqn", with_field(DQN, "    my_coef: float = 0.1"), harness)
    proc = run(path, "--help")
    assert proc.returncode == 0 and "--my-coef" in proc.stdout, proc.stderr
    refused(run(path, "--my-coef", "x"), "--my-coef")
    (tmp_path / "mdqn.py").write_text(with_field(DQN, "    my_sizes: tuple = (1, 2)"))
    refused(run(path, "--help"), "my_sizes", "bool, int, float or str")


BROKEN = """
import contextlib, io, json, os, sys
sys.path.insert(0, {algorithms!r})
import gymnax
import onefile_harness

def broken(**kwargs):
    raise RuntimeError("could not download the data set:\\nno network here")

gymnax.register("Broken-v0", broken)
lines = {{}}
for name in {names!r}:
    module = __import__(name)
    for mode in ("alone", "harness"):
        runs_dir = os.path.join({runs!r}, name + "-" + mode)
        argv = ["--env-name", "Broken-v0", "--runs-dir", runs_dir]
        err, out = io.StringIO(), io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            code = module.main(argv) if mode == "alone" else onefile_harness.command_line(module, argv)
        lines[name + " " + mode] = [code, out.getvalue(), err.getvalue(), os.path.exists(runs_dir)]
print(json.dumps(lines))
"""


def test_an_environment_that_cannot_be_built_is_refused_in_one_line(tmp_path):
    """A registered env whose factory raises (a download without a network, say), in every file, alone and
    through the harness: one line naming the env and the reason, exit 2, no run directory."""
    code = BROKEN.format(algorithms=str(ROOT / "algorithms"), names=ALGORITHM_NAMES, runs=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    results = __import__("json").loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 2 * len(ALGORITHM_NAMES)
    for run_name, (code, out, err, wrote) in results.items():
        lines = err.strip().splitlines()
        assert code == 2 and out == "" and not wrote and len(lines) == 1, (run_name, code, out, err)
        assert "--env-name Broken-v0 cannot be built: RuntimeError: could not download" in lines[0], (run_name, err)
