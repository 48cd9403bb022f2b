"""Every command in the README and docs/ works as written, from the repository's root.

Each `python algorithms/<name>.py ...` line of a ```bash block is taken through the run harness's
checks (parsing, config, environment, suite, memory, the run directory) in this process: it must
be accepted. `RUN_DIR`-style placeholders (`runs/ppo-CartPole-v1-<time>`) stand for a run the
test makes first. The slow test then runs the cheap commands to the end, verbatim, in a folder
that mirrors the repository (its `algorithms/` and `benchmarks/` linked in), one after the other
as a reader would type them.
"""

import re
import shlex
import subprocess
import sys

import pytest

from conftest import ROOT, command_line_env, load_algorithm
from onefile_harness import main, protocol, suites

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PLACEHOLDER = re.compile(r"runs/(\w+)-([\w.-]+)-<time>")


def bash_commands(path) -> list[str]:
    """Every command line of the file's ```bash blocks, comments and `&&` chains split off."""
    blocks = re.findall(r"```bash\n(.*?)```", path.read_text(), re.S)
    lines = [line.split("  #")[0].strip() for block in blocks for line in block.splitlines()]
    return [part.strip() for line in lines if line for part in line.split("&&")]


def algorithm_commands() -> list[tuple[str, str]]:
    """(file, command) for every documented `python algorithms/<name>.py ...`."""
    return [
        (path.name, command)
        for path in DOCS
        for command in bash_commands(path)
        if re.match(r"(\w+=\S+ )*python algorithms/\w+\.py", command)
    ]


def test_the_readme_is_a_short_read():
    """At most 150 lines and 1,500 words (`wc -w`): results and caveats beyond its one table live in docs/results.md."""
    text = DOCS[0].read_text()
    assert len(text.splitlines()) <= 150 and len(text.split()) <= 1500, (len(text.splitlines()), len(text.split()))


def test_the_docs_document_commands():
    commands = algorithm_commands()
    assert len(commands) >= 12 and any("--resume" in command for _, command in commands)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A small finished ppo.py run on CartPole-v1: what `runs/ppo-CartPole-v1-<time>` stands for."""
    runs_dir = tmp_path_factory.mktemp("runs")
    flags = ["--total-timesteps", "1024", "--num-envs", "4", "--num-steps", "32", "--num-seeds", "2", "--quiet"]
    assert main.command_line(load_algorithm("ppo"), [*flags, "--runs-dir", str(runs_dir)]) == 0
    (run_dir,) = runs_dir.iterdir()
    return run_dir


@pytest.mark.xdist_group("docs-finished-run")
def test_the_readme_acts_with_a_finished_run(finished_run):
    """README's load_run / make_act block, as written (the run directory its placeholder stands for): its
    action is the greedy one, the actor's most probable on that observation."""
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", DOCS[0].read_text(), re.S) if "load_run(" in b]
    assert len([line for line in block.splitlines() if line and not line.startswith(("import", "from"))]) <= 6
    scope = {}
    exec(PLACEHOLDER.sub(str(finished_run), block), scope)  # ppo: the module the tests load (conftest)
    ppo, params, obs = load_algorithm("ppo"), scope["params"], scope["obs"]
    networks = ppo.make_networks(scope["config"], 2, obs.shape)
    assert int(scope["action"]) == int(networks.actor.apply(params["actor"], obs).argmax())


@pytest.mark.xdist_group("docs-finished-run")  # one pytest-xdist worker makes finished_run once
@pytest.mark.parametrize("where, command", algorithm_commands(), ids=lambda x: x if x.endswith(".md") else "")
def test_every_documented_command_is_accepted(where, command, finished_run, tmp_path, monkeypatch):
    """The command's options pass every check the harness makes before compiling."""
    words = shlex.split(PLACEHOLDER.sub(str(finished_run), command))
    while "=" in words[0]:  # WANDB_MODE=offline python ...
        name, _, value = words.pop(0).partition("=")
        monkeypatch.setenv(name, value)
    name = words[1].removeprefix("algorithms/").removesuffix(".py")
    if "--help" in words:
        return  # the slow test runs it
    suite = re.search(r"--env-name (\w+)/", command)
    package = suite and suites.SUITES[suite.group(1)].module  # atari/: envpool
    if suite and __import__("importlib").util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed (requirements-envs.txt)")
    argv = words[2:] + ([] if "--resume" in words or "--eval-only" in words else ["--runs-dir", str(tmp_path)])
    algo = protocol.load(load_algorithm(name))
    job = main.prepare(algo, "", argv, is_host_0=True)
    assert job.config.env_name and job.run_dir


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    """A folder where the documented commands run as written: the repository's algorithms/ and
    benchmarks/ linked in, its own runs/, and a compile cache of its own."""
    folder = tmp_path_factory.mktemp("reader")
    for name in ("algorithms", "benchmarks"):
        (folder / name).symlink_to(ROOT / name)
    return folder


def run(command: str, cwd, cache_dir, timeout: int = 600) -> subprocess.CompletedProcess:
    """`command` in bash from `cwd`, as typed, with this interpreter for `python`, the command line's
    XLA flags and its own compile cache."""
    env = command_line_env(JAX_COMPILATION_CACHE_DIR=str(cache_dir))
    command = re.sub(r"^((?:\w+=\S+ )*)python ", rf"\1{sys.executable} ", command)
    return subprocess.run(command, shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


# The commands run to the end (the others are each covered elsewhere with smaller budgets: the
# suites by test_suites.py, tracking, evaluation and rendering by test_tracking.py, other envs, seeds
# and learning rates by test_cli.py and test_learning.py, --pbt by test_pbt.py).
RUN_TO_THE_END = (
    "python algorithms/ppo.py --help",
    "python algorithms/ppo.py --checkpoint-every 2",
    "python algorithms/ppo.py --resume runs/ppo-CartPole-v1-<time>",
)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_documented_commands_run_to_the_end(sandbox):
    documented = {command for _, command in algorithm_commands()}
    assert set(RUN_TO_THE_END) <= documented, set(RUN_TO_THE_END) - documented
    for command in RUN_TO_THE_END:
        runs = sorted((sandbox / "runs").glob("ppo-CartPole-v1-*")) if (sandbox / "runs").exists() else []
        proc = run(PLACEHOLDER.sub(str(runs[-1]) if runs else "", command), sandbox, sandbox / ".cache")
        assert proc.returncode == 0, f"{command}\n{proc.stderr[-2000:]}"
        assert proc.stdout.splitlines()[0].startswith(("ppo.py with the run harness", "usage: ppo.py")), command
    compare = next(c for path in DOCS for c in bash_commands(path) if c.startswith("python benchmarks/compare.py"))
    proc = run(compare.replace("runs/dqn-CartPole-v1-*", ""), sandbox, sandbox / ".cache")  # the ppo runs above
    assert proc.returncode == 0 and (sandbox / "cmp.md").exists() and (sandbox / "cmp.png").exists(), proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_documented_copy_of_a_file_runs_alone(tmp_path):
    """README's `mkdir -p /tmp/alone && cp algorithms/ppo.py /tmp/alone/ && cd /tmp/alone && python
    ppo.py ...`, with its folder under tmp_path: it trains alone and writes its run directory."""
    (line,) = [c for c in re.findall(r"```bash\n(.*?)```", DOCS[0].read_text(), re.S) if "/tmp/alone" in c]
    proc = run(line.split("  #")[0].strip().replace("/tmp/alone", str(tmp_path / "alone")), ROOT, tmp_path / "cache")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("ppo.py alone") and len(list((tmp_path / "alone" / "runs").iterdir())) == 1
