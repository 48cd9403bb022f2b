"""Shared fixtures for the algorithm tests.

algorithms/ppo.py is a single-file script, not a package, so it is imported from its path.
It is loaded here at conftest import time, before any test module is collected, because it
sets XLA_FLAGS before importing jax; a test module doing `import jax` first would otherwise
start XLA without that flag. The `ppo` fixture hands out this one module object, so the
whole session shares one copy (and its jit caches).
"""
import importlib.util
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PPO_PATH = ROOT / "algorithms" / "ppo.py"


def _load(name: str, path: pathlib.Path):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses/typing look classes' modules up here
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


_PPO = _load("ppo", PPO_PATH)


def load_algorithm(name: str):
    """algorithms/<name>.py as a module, loaded once per session (all files set the same XLA_FLAGS)."""
    return _load(name, ROOT / "algorithms" / f"{name}.py")


@pytest.fixture(scope="session")
def ppo():
    return _PPO


@pytest.fixture(scope="session")
def root() -> pathlib.Path:
    return ROOT


@pytest.fixture(scope="session")
def ppo_path() -> pathlib.Path:
    return PPO_PATH
