"""The algorithm files themselves: each reads algorithm first and ends with the one block every file
needs to run alone, the same text in all of them and short; each file keeps within its line budget;
importing a file does nothing but define things; every file offers the run harness's interface
(algorithms/onefile_harness/protocol.py).

A shared block is a section whose banner title says "(the same in every algorithm file"; it runs to
the next banner. To change one, edit it in ppo.py and run `python tests/test_files.py`, which
copies ppo.py's shared blocks into every other file.
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
SHARED = "(the same in every algorithm file"


def shared_blocks(text: str) -> dict[str, tuple[int, str]]:
    """{title: (its first line number, its text)} of a file's shared blocks."""
    blocks = {}
    for match in re.finditer(re.escape(BAR) + r"# (.*)\n", text):
        title = match.group(1)
        if SHARED in title:
            end = text.find(BAR, text.index(BAR, match.end() - 1) + len(BAR))
            end = len(text) if end == -1 else end
            blocks[title.split(" (")[0]] = (text.count("\n", 0, match.start()) + 1, text[match.start() : end])
    return blocks


def block_differences(texts: dict) -> list[str]:
    """One message per shared block of a file that differs from the first file's: which file and
    block, from which line of the file, and a short diff."""
    (reference_name, reference_text), *others = texts.items()
    reference = shared_blocks(reference_text)
    messages = []
    for name, text in others:
        blocks = shared_blocks(text)
        for title, (_, want) in reference.items():
            if title not in blocks:
                messages.append(f"{name}: has no shared block {title!r}")
                continue
            start, got = blocks[title]
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


# Line budgets (`wc -l`): ppo.py, any file, the files' mean, and the shared block in each file (from 747,
# 997, 9,015 in all and 363 lines before the files were rebuilt around gymnax's own step; the mean was a
# total of 6,000 for the first ten files).
PPO_LINES, FILE_LINES, MEAN_LINES, SHARED_LINES = 500, 700, 600, 200


def test_files_keep_their_line_budgets():
    lines = {path.name: len(path.read_text().splitlines()) for path in ALGORITHM_FILES}
    assert lines["ppo.py"] <= PPO_LINES, lines
    assert all(count <= FILE_LINES for count in lines.values()), lines
    assert sum(lines.values()) <= MEAN_LINES * len(lines), (sum(lines.values()), lines)
    for title, (_, block) in shared_blocks(ordered_texts()["ppo.py"]).items():
        assert len(block.splitlines()) <= SHARED_LINES, (title, len(block.splitlines()))


@pytest.mark.parametrize("path", ALGORITHM_FILES, ids=[p.name for p in ALGORITHM_FILES])
def test_every_file_reads_algorithm_first(path):
    """Config, then the networks, then make_train, then the policy's action; the shared block last;
    every loss of network weights and every acting policy takes a key; no function but make_train
    over 45 lines."""
    text = path.read_text()
    order = [text.index(marker) for marker in ("class Config", "class HParams", "def make_train(")]
    order += [text.index("def make_act("), text.index("# Running this file")]
    assert order == sorted(order), f"{path.name}: {order}"
    for match in re.finditer(r"^( *)def (\w+)\((.*?)\)(?: -> [^:]+)?:\n", text, re.M | re.S):
        indent, name, args = match.groups()
        takes_weights = any(word in args for word in ("params", "actor", "critic"))  # a loss, not a formula
        if "loss" in name and takes_weights and not name.startswith(("make_", "_")):
            assert "key" in args, f"{path.name}: {name}({args}) takes no key"
        end = re.compile(rf"^ {{0,{len(indent)}}}\S", re.M).search(text, match.end())
        length = text.count("\n", match.start(), end.start() if end else len(text))
        assert name == "make_train" or length <= 45, f"{path.name}: {name} is {length} lines"
    assert re.search(r"def act\(params, obs: jax.Array, key: jax.Array", text), f"{path.name}: act takes no key"


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
    text = (ROOT / "algorithms" / "ppo.py").read_text().replace("HARNESS_PROTOCOL = 3", "HARNESS_PROTOCOL = 99")
    (tmp_path / "ppo.py").write_text(text)
    (tmp_path / "onefile_harness").symlink_to(ROOT / "algorithms" / "onefile_harness")
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "ppo.py")], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "protocol 99" in lines[0] and "protocol 3" in lines[0], proc.stderr


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


if __name__ == "__main__":  # python tests/test_files.py [FILE ...]: copy ppo.py's shared blocks into the files
    reference = shared_blocks((ROOT / "algorithms" / "ppo.py").read_text())
    for path in [pathlib.Path(p).resolve() for p in sys.argv[1:]] or ALGORITHM_FILES:
        text = original = path.read_text()
        for title, (_, block) in shared_blocks(text).items():
            text = text.replace(block, reference[title][1])
        if text != original:
            path.write_text(text)
            print(f"{path.name}: shared blocks replaced by ppo.py's")
