"""Mistakes a researcher makes in a copied, edited file, met as they would meet them: a mistyped option, a new
Config field named like an existing one, a field added without help, an environment that cannot be built.
Each is refused in one line with exit 2 before anything compiles or is written, by the file alone (its `main`) and by
the run harness (`onefile_harness.command_line`) alike: the block that does it is the same text in every file
(tests/test_files.py). The edited copies run in this process, as `python FILE ARGS` would run them (the hand-over in
`__main__` is tested on ppo.py by tests/test_cli.py); one mistyped option is typed as a user types it."""

import contextlib
import importlib.util
import io
import itertools
import os
import subprocess
import sys
import types

import gymnax
import pytest

import onefile_harness
from conftest import ALGORITHM_NAMES, ROOT, load_algorithm
from onefile_harness import cli

DQN = (ROOT / "algorithms" / "dqn.py").read_text()
FIELD = '    tau: Annotated[float, "target <- tau'  # dqn.py's Polyak rate
COPIES = itertools.count()  # each edited copy is a module of its own name in sys.modules


def edited_copy(tmp_path, name: str, text: str):
    """`text` saved as tmp_path/name.py, alone in its folder."""
    (tmp_path / f"{name}.py").write_text(text)
    return tmp_path / f"{name}.py"


def run(path, *args, harness: bool, monkeypatch):
    """`python PATH ARGS` in this process, from PATH's folder, by the file alone or through the harness: its exit
    status, stdout and stderr (argparse's own exits, --help's included, are exit statuses)."""
    monkeypatch.chdir(path.parent)  # where a run directory would go
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # no __pycache__ beside the copy
    spec = importlib.util.spec_from_file_location(f"{path.stem}_{next(COPIES)}", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look the class's module up there
    spec.loader.exec_module(module)
    return call(lambda argv: onefile_harness.command_line(module, argv) if harness else module.main(argv), args)


def call(command, args) -> types.SimpleNamespace:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = command([str(a) for a in args])
        except SystemExit as exit_:
            code = exit_.code
    return types.SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


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
def test_a_mistyped_option_names_the_closest_one(tmp_path, harness, monkeypatch):
    """A new field `m_tau` is --m-tau; `--mtau` names it, and the file alone does not blame the harness."""
    text = with_field(DQN, '    m_tau: Annotated[float, "Munchausen temperature", "0 < m_tau < inf"] = 0.03')
    path = edited_copy(tmp_path, "mdqn", text)
    line = refused(run(path, "--mtau", "0.1", harness=harness, monkeypatch=monkeypatch), "did you mean --m-tau?")
    assert "--mtau" in line and "harness" not in line
    refused(run(path, "--num-env", "3", harness=harness, monkeypatch=monkeypatch), "did you mean --num-envs?")
    assert [p.name for p in tmp_path.iterdir()] == ["mdqn.py"]


def test_the_copy_typed_as_a_user_types_it_names_the_closest_option(tmp_path):
    """`python mdqn.py --mtau 0.1` in the copy's empty folder: the same one line, exit 2, nothing written."""
    text = with_field(DQN, '    m_tau: Annotated[float, "Munchausen temperature", "0 < m_tau < inf"] = 0.03')
    path = edited_copy(tmp_path, "mdqn", text)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    argv = [sys.executable, str(path), "--mtau", "0.1"]
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert "harness" not in refused(proc, "mdqn.py", "--mtau", "did you mean --m-tau?")
    assert [p.name for p in tmp_path.iterdir()] == ["mdqn.py"]


def test_the_file_alone_names_the_harness_only_for_the_harness_options():
    """The copy's list of the harness's options is the harness's own (cli.OPTIONS), every one of them."""
    dqn = __import__("dqn")
    harness = {name.removeprefix("--") for _, name, _, _ in cli.OPTIONS} - {"runs-dir"}
    assert set(dqn.HARNESS_OPTIONS.split()) == harness
    message = dqn.unknown_option("dqn.py", ["--pbt-interval", "5"], ["--lr"])
    assert "run harness" in message and "--pbt-interval" in message
    assert "harness" not in dqn.unknown_option("dqn.py", ["--pbt-intervall", "5"], ["--lr"])


@pytest.mark.parametrize("harness", [False, True], ids=["alone", "harness"])
def test_a_field_named_twice_is_refused(tmp_path, harness, monkeypatch):
    """A second `tau` (the Munchausen temperature's name in the paper) would silently replace the Polyak rate."""
    text = with_field(DQN, '    tau: Annotated[float, "Munchausen temperature", "0 < tau < inf"] = 0.03')
    path = edited_copy(tmp_path, "mdqn", text)
    refused(run(path, "--total-timesteps", "1000", harness=harness, monkeypatch=monkeypatch), "Config names tau twice")
    assert [p.name for p in tmp_path.iterdir()] == ["mdqn.py"]


@pytest.mark.parametrize("harness", [False, True], ids=["alone", "harness"])
def test_a_plain_field_becomes_a_flag(tmp_path, harness, monkeypatch):
    """`my_coef: float = 0.1`, with no help annotation, is --my-coef; a type no flag can take is refused."""
    path = edited_copy(tmp_path, "mdqn", with_field(DQN, "    my_coef: float = 0.1"))
    proc = run(path, "--help", harness=harness, monkeypatch=monkeypatch)
    assert proc.returncode == 0 and "--my-coef" in proc.stdout, proc.stderr
    refused(run(path, "--my-coef", "x", harness=harness, monkeypatch=monkeypatch), "--my-coef")
    (tmp_path / "mdqn.py").write_text(with_field(DQN, "    my_sizes: tuple = (1, 2)"))
    refused(run(path, "--help", harness=harness, monkeypatch=monkeypatch), "my_sizes", "bool, int, float or str")


def broken(**kwargs):
    raise RuntimeError("could not download the data set:\nno network here")


def test_an_environment_that_cannot_be_built_is_refused_in_one_line(tmp_path, monkeypatch):
    """A registered env whose factory raises (a download without a network, say), in every file, alone and
    through the harness: one line naming the env and the reason, exit 2, no run directory."""
    if "Broken-v0" not in gymnax.registered_envs:  # stays registered in this worker: no other test names it
        gymnax.register("Broken-v0", broken)
    jaxmarl = load_algorithm("ippo").import_jaxmarl()  # the multi-agent files' library has no register: faked
    make = jaxmarl.make
    monkeypatch.setattr(jaxmarl, "registered_envs", [*jaxmarl.registered_envs, "Broken-v0"])
    monkeypatch.setattr(
        jaxmarl, "make", lambda name, **kwargs: broken() if name == "Broken-v0" else make(name, **kwargs)
    )
    for name, harness in itertools.product(ALGORITHM_NAMES, (False, True)):
        module, runs_dir = load_algorithm(name), tmp_path / f"{name}-{harness}"
        command = lambda argv: onefile_harness.command_line(module, argv) if harness else module.main(argv)  # noqa: E731
        proc = call(command, ["--env-name", "Broken-v0", "--runs-dir", runs_dir])
        line = refused(proc, "--env-name Broken-v0 cannot be built: RuntimeError: could not download")
        assert not runs_dir.exists(), (name, harness, line)
