"""The algorithm files themselves: each reads algorithm first and ends with the one block every file
needs to run alone, the same text in all of them and short; each file keeps within its line budget;
importing a file does nothing but define things; every file offers the run harness's interface
(algorithms/onefile_harness/protocol.py).

A shared block is a section whose banner title says "(the same in every single-agent file: tests/test_files.py)"
or names its files, "(the same in dqn.py, c51.py: tests/test_files.py)"; it runs to the next banner (a title
between two bars, or `# ---- title ----`). To change one, edit it in the first file its title names (ppo.py for
every file) and run `python tests/test_files.py`, which copies each shared block from that file into the others.
The multi-agent files' block ("every multi-agent file") is ppo.py's with an env section of its own (EnvStep,
VecEnv: JaxMARL's env, its agents an axis): the copy puts ppo.py's block around that section.
"""

import difflib
import os
import pathlib
import re
import subprocess
import sys

import pytest

from conftest import ROOT, load_algorithm
from onefile_harness import protocol

ALGORITHM_FILES = sorted((ROOT / "algorithms").glob("*.py"))
BAR = "# " + "-" * 86 + "\n"
BANNER = re.compile(rf"^(?:{re.escape(BAR)}# (.*)\n{re.escape(BAR)}|# ---- (.*) ----\n)", re.M)
SHARED = re.compile(r"\(the same in (.*?): tests/test_files\.py\)")
EVERY_FILE, EVERY_MULTI_AGENT_FILE = "every single-agent file", "every multi-agent file"
MULTI_AGENT_FILES = [
    path.name for path in ALGORITHM_FILES if f"(the same in {EVERY_MULTI_AGENT_FILE}:" in path.read_text()
]
# A multi-agent block's own part: from EnvStep to Episodes (which, with the rest, is ppo.py's).
MULTI_AGENT = "Running a multi-agent file"  # that block's title
ENV_SECTION = re.compile(r"^class EnvStep\(NamedTuple\):.*?(?=^class Episodes\()", re.M | re.S)


def shared_blocks(text: str) -> dict[str, tuple[int, str]]:
    """{title: (its first line number, its text)} of a file's shared blocks, each from its banner to the next."""
    banners = list(BANNER.finditer(text))
    blocks = {}
    for match, following in zip(banners, [*banners[1:], None], strict=True):
        title = match.group(1) or match.group(2)
        if SHARED.search(title):
            end = following.start() if following else len(text)
            blocks[title.split(" (")[0]] = (text.count("\n", 0, match.start()) + 1, text[match.start() : end])
    return blocks


def sharing_files(block: str, names: list[str]) -> list[str]:
    """The files a shared block's title names, the one it is copied from first (for every file: `names`)."""
    named = SHARED.search(block).group(1)
    if named in (EVERY_FILE, EVERY_MULTI_AGENT_FILE):
        return [name for name in names if (name in MULTI_AGENT_FILES) == (named == EVERY_MULTI_AGENT_FILE)]
    return named.split(", ")


def as_multi_agent(single_agent_block: str, multi_agent_block: str) -> str:
    """ppo.py's block made a multi-agent file's: that block's banner (3 lines) and env section put in."""
    banner, body = multi_agent_block.split("\n", 3)[:3], single_agent_block.split("\n", 3)[3]
    section = ENV_SECTION.search(multi_agent_block).group(0)
    return "\n".join(banner) + "\n" + ENV_SECTION.sub(lambda _: section, body)


def block_differences(texts: dict) -> list[str]:
    """One message per shared block of a file that differs from the one in the first file its title names
    (for every file: the first of `texts`), or that a file named lacks: which file and block, from which line
    of the file, and a short diff."""
    blocks = {name: shared_blocks(text) for name, text in texts.items()}
    titles = {title: block for found in blocks.values() for title, (_, block) in found.items()}
    messages = []
    for title, block in titles.items():
        reference_name, *others = [name for name in sharing_files(block, list(texts)) if name in texts]
        if title not in blocks[reference_name]:
            messages.append(f"{reference_name}: has no shared block {title!r}")
            continue
        want = blocks[reference_name][title][1]
        for name in others:
            if title not in blocks[name]:
                messages.append(f"{name}: has no shared block {title!r}")
                continue
            start, got = blocks[name][title]
            if got == want:
                continue
            ours, theirs = want.splitlines(keepends=True), got.splitlines(keepends=True)
            first = next(
                (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours), len(theirs))
            )
            diff = "".join(list(difflib.unified_diff(ours, theirs, reference_name, name, n=1))[:12])
            messages.append(
                f"{name}: its block {title!r} differs from {reference_name}'s from its line {start + first} on:\n{diff}"
            )
    return messages


def ordered_texts() -> dict[str, str]:
    texts = {path.name: path.read_text() for path in ALGORITHM_FILES}
    return {"ppo.py": texts.pop("ppo.py"), **texts}


def converted(texts: dict) -> dict:
    return {name: text for name, text in texts.items() if "HARNESS_PROTOCOL = " in text}


def test_every_file_has_the_same_shared_blocks():
    texts = converted(ordered_texts())
    assert set(shared_blocks(texts["ppo.py"])) == {"Running this file"}
    differences = block_differences(texts)
    assert not differences, "the shared blocks must be the same in every file:\n" + "\n".join(differences)


@pytest.mark.parametrize("name", MULTI_AGENT_FILES)
def test_a_multi_agent_block_is_ppos_but_its_env_section(name):
    texts = ordered_texts()
    single, multi = shared_blocks(texts["ppo.py"])["Running this file"][1], shared_blocks(texts[name])[MULTI_AGENT][1]
    assert ENV_SECTION.search(multi), f"{name}: its block has no env section (EnvStep to Episodes)"
    differ = list(difflib.unified_diff(as_multi_agent(single, multi).splitlines(), multi.splitlines(), n=1))
    assert not differ, f"{name}'s block differs from ppo.py's outside its env section:\n" + "\n".join(differ[:12])


# What siblings share on purpose, each block in the files its title names (and only there).
SIBLING_BLOCKS = {
    "The replay buffer": ["dqn.py", "c51.py", "qr_dqn.py", "iqn.py"],
    "The training loop's parts": ["dqn.py", "c51.py", "qr_dqn.py", "iqn.py", "rainbow.py"],
    "The training loop": ["dqn.py", "c51.py", "qr_dqn.py"],
    "The critics, the action scale and the replay buffer": ["sac.py", "td3.py"],
    "Partially observable environments": ["ppo_rnn.py", "ppo_trxl.py"],
    "Running statistics": ["ppo_continuous.py", "ppo_rnd.py"],
}


# Functions (and classes) siblings share outside a shared block (whose banners would cost ppo.py lines): the same
# text in each file named, copied from the first by `python tests/test_files.py`.
DISCRETE_FILES = sorted(  # ppo.py first: the file the discrete files' torso is copied from
    (p.name for p in ALGORITHM_FILES if 'ACTIONS = "discrete"' in p.read_text()), key=lambda name: name != "ppo.py"
)
CONTINUOUS_FILES = sorted({p.name for p in ALGORITHM_FILES} - set(DISCRETE_FILES), key=lambda name: name != "sac.py")
SHARED_FUNCTIONS = {
    # What every network reads observations through: in the discrete-action files, optionally convolutions first
    # (--network); the continuous-action files' (sac.py first) flattens only, no image env having such actions.
    **{name: DISCRETE_FILES for name in ("CONVOLUTIONS", "Conv", "Torso", "check_network")},
    "Torso (flattening only)": CONTINUOUS_FILES,
    "sample_action": ["ppo.py", "ppo_rnd.py", "ppo_rnn.py", "ppo_trxl.py"],
    "compute_gae": ["ppo.py", "alphazero.py", "ppo_continuous.py", "ppo_rnd.py", "ppo_rnn.py", "ppo_trxl.py"],
    "policy_objective": ["ppo.py", "ppo_continuous.py", "ppo_rnd.py"],
    "make_optimizer": ["ppo.py", "ppo_continuous.py", "ppo_rnd.py", "ppo_rnn.py", "ppo_trxl.py", "pqn.py"],
    "epsilon_greedy": ["dqn.py", "pqn.py"],
}


def function_text(text: str, name: str) -> str | None:
    """A top-level function's, class's or assignment's text, up to the next line that is not indented."""
    name = name.split()[0]  # "Torso (flattening only)": a second group of files with another Torso
    match = re.search(rf"^(?:(?:def|class) {name}\b|{name} = ).*?(?=^\S)", text, re.M | re.S)
    return match.group(0) if match else None


def test_siblings_share_their_functions():
    texts = ordered_texts()
    for name, files in SHARED_FUNCTIONS.items():
        want = function_text(texts[files[0]], name)
        assert want, (files[0], name)
        differ = [file for file in files[1:] if function_text(texts[file], name) != want]
        assert not differ, f"{name} differs from {files[0]}'s in {differ} (python tests/test_files.py copies it)"


def test_siblings_share_their_common_sections():
    texts = ordered_texts()
    for title, names in SIBLING_BLOCKS.items():
        holders = [name for name, text in texts.items() if title in shared_blocks(text)]
        assert sorted(holders) == sorted(names), (title, holders)
        assert sharing_files(shared_blocks(texts[names[0]])[title][1], list(texts)) == names, title


# Line budgets (`wc -l`): ppo.py, any file, the files' mean, and the shared block in each file (from 747,
# 997, 9,015 in all and 363 lines before the files were rebuilt around gymnax's own step; the mean was a
# total of 6,000 for the first ten files). The shared block grew from 198 to 263 lines with what a copied file
# reports and refuses (issue 43): the compile time apart, the harness's final line and summary.json, the closest
# option to a mistyped one, a Config field named twice, a plain field, an environment that cannot be built.
# Observations that keep their shape (issue 44) cost each file about 10 lines (the Torso a network reads them
# through, an obs_shape field) and took 2 from the shared block (VecEnv no longer flattens); the convolutional
# torso (--network, issue 44) about 44 more in each discrete-action file (CONVOLUTIONS, Conv, its Torso,
# check_network). Overcooked's layouts and shaped reward (issue 45) cost each multi-agent file about 7 lines in its
# env block and 6 in its algorithm: the mean went from 715 to 717. ippo_rnn.py (issue 45: ippo.py with ppo_rnn.py's GRU,
# 790 lines, the multi-agent block's 262 among them) took it to 722, mappo_rnn.py (its critic recurrent too, 815
# lines) to 727.
PPO_LINES, FILE_LINES, MEAN_LINES, SHARED_LINES = 625, 815, 727, 262


def test_files_keep_their_line_budgets():
    lines = {path.name: len(path.read_text().splitlines()) for path in ALGORITHM_FILES}
    assert lines["ppo.py"] <= PPO_LINES, lines
    assert all(count <= FILE_LINES for count in lines.values()), lines
    assert sum(lines.values()) <= MEAN_LINES * len(lines), (sum(lines.values()), lines)
    for title, (_, block) in shared_blocks(ordered_texts()["ppo.py"]).items():
        assert len(block.splitlines()) <= SHARED_LINES, (title, len(block.splitlines()))


def test_the_guide_to_adding_a_file_states_these_budgets():
    """docs/adding-an-algorithm.md names the budgets above, as they are (it once named older ones)."""
    text = " ".join((ROOT / "docs" / "adding-an-algorithm.md").read_text().split())
    budgets = f"`ppo.py` at most {PPO_LINES} lines, any file {FILE_LINES}, the files {MEAN_LINES} on average"
    assert f"{budgets}, the shared block {SHARED_LINES})" in text and f"last: {SHARED_LINES} lines" in text


@pytest.mark.parametrize("path", ALGORITHM_FILES, ids=[p.name for p in ALGORITHM_FILES])
def test_every_file_reads_algorithm_first(path):
    """Config, then the networks, then make_train, then the policy's action; the shared block last;
    every loss of network weights and every acting policy takes a key; no function but make_train
    over 45 lines."""
    text = path.read_text()
    order = [text.index(marker) for marker in ("class Config", "class HParams", "def make_train(")]
    order += [
        text.index("def make_act("),
        text.index("# Running this file" if path.name not in MULTI_AGENT_FILES else "# " + MULTI_AGENT),
    ]
    assert order == sorted(order), f"{path.name}: {order}"
    for match in re.finditer(r"^( *)def (\w+)\((.*?)\)(?: -> [^:]+)?:\n", text, re.M | re.S):
        indent, name, args = match.groups()
        takes_weights = any(word in args for word in ("params", "actor", "critic"))  # a loss, not a formula
        if "loss" in name and takes_weights and not name.startswith(("make_", "_")):
            assert "key" in args, f"{path.name}: {name}({args}) takes no key"
        end = re.compile(rf"^ {{0,{len(indent)}}}\S", re.M).search(text, match.end())
        length = text.count("\n", match.start(), end.start() if end else len(text))
        assert name == "make_train" or length <= 45, f"{path.name}: {name} is {length} lines"
    acts = r"def act\(params, (obs: jax.Array|observation: tuple), key: jax.Array"  # a planner's: (obs, env state)
    assert re.search(acts, text), f"{path.name}: act takes no key"


def test_an_edited_block_is_reported_with_file_and_line():
    texts = ordered_texts()
    other = next(name for name in converted(texts) if name != "ppo.py") if len(converted(texts)) > 1 else "ppo.py"
    texts = {"reference.py": texts["ppo.py"], other: texts[other]}
    edited = texts[other].replace("def make_evaluate(", "def make_evaluation(")
    assert edited != texts[other]
    messages = block_differences({**texts, other: edited})
    assert len(messages) == 1 and messages[0].startswith(f"{other}: its block 'Running this file'")
    line = edited.splitlines().index(next(x for x in edited.splitlines() if "def make_evaluation(" in x)) + 1
    assert f"from its line {line} on" in messages[0] and "make_evaluation" in messages[0]


@pytest.mark.parametrize("path", ALGORITHM_FILES, ids=[p.name for p in ALGORITHM_FILES])
def test_every_file_offers_the_harness_interface(path):
    if "HARNESS_PROTOCOL = " not in path.read_text():
        pytest.skip("not converted yet")
    algo = protocol.load(load_algorithm(path.stem))
    assert algo.name == path.stem and algo.sweepable


def test_a_file_of_another_protocol_is_refused_in_one_line(tmp_path):
    text = re.sub(
        r"^HARNESS_PROTOCOL = \d+", "HARNESS_PROTOCOL = 99", (ROOT / "algorithms" / "ppo.py").read_text(), flags=re.M
    )
    (tmp_path / "ppo.py").write_text(text)
    (tmp_path / "onefile_harness").symlink_to(ROOT / "algorithms" / "onefile_harness")
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "ppo.py")], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "protocol 99" in lines[0] and f"protocol {protocol.PROTOCOL}" in lines[0], proc.stderr


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


if __name__ == "__main__":  # python tests/test_files.py [FILE ...]: copy each shared block from its first file
    names = list(ordered_texts())  # ppo.py first: the file every-file blocks come from
    for path in [pathlib.Path(p).resolve() for p in sys.argv[1:]] or ALGORITHM_FILES:
        text = original = path.read_text()
        for title, (_, block) in shared_blocks(text).items():
            source = sharing_files(block, names)[0]
            wanted = shared_blocks((ROOT / "algorithms" / source).read_text())[title][1]
            if title == MULTI_AGENT:  # ppo.py's block around the first multi-agent file's env section
                wanted = as_multi_agent(shared_blocks(ordered_texts()["ppo.py"])["Running this file"][1], wanted)
            if wanted != block:
                text = text.replace(block, wanted)
                print(f"{path.name}: its block {title!r} replaced by {source}'s")
        for name, files in SHARED_FUNCTIONS.items():
            if path.name in files[1:]:
                wanted = function_text((ROOT / "algorithms" / files[0]).read_text(), name)
                text = text.replace(function_text(text, name), wanted)
        if text != original:
            path.write_text(text)
