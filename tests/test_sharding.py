"""Runs sharded over several devices train exactly like runs on one device.

XLA can split the host CPU into N devices (--xla_force_host_platform_device_count), which must
be set before jax starts, so each case is a command-line run in its own process. 3 seeds x 2
sweep points = 6 runs: 2 devices hold 3 runs each, 4 devices need padding to 8; ppo.py's are a
--pbt population. Each run has a timeout: XLA on CPU has deadlocked multi-device programs here (see
ppo.py's init), and a hang must fail the test rather than stall CI.
"""

import concurrent.futures
import os
import subprocess
import sys

import numpy as np
import pytest
from flax import serialization
from specs import SPECS
from test_cli import _leaves, results_dir

from conftest import ROOT, TEST_XLA_FLAGS

pytestmark = pytest.mark.slow

# Each file's small command-line run (tests/specs), with 3 seeds and 2 sweep points.
SHARDED = ("--num-seeds", "3", "--sweep", "lr=1e-3,3e-3", "--quiet")
# ppo.py's 6 runs are a --pbt population: its exploit steps copy members across devices (and never
# from the padding of the 4-device runs).
POPULATION = {"ppo": ("--pbt", "--pbt-interval", "2", "--pbt-fraction", "0.5")}
# The sharding code is the harness, the same text in every file, and it shards whatever runner a
# file's train returns: ppo.py (on-policy) and sac.py (replay buffer, several networks and
# optimizers) stand for the rest, to keep CI within its budget. Every file's own command-line
# tests (test_cli.py) also run on one device per core.
SHARDED_FILES = ("ppo", "sac")


@pytest.fixture(scope="module", params=[n for n in SHARDED_FILES if (ROOT / "algorithms" / f"{n}.py").exists()])
def name(request) -> str:
    """The file under test; named `name` so that conftest keeps its tests in one xdist worker, which
    then makes the runs below once, not once per worker."""
    return request.param


@pytest.fixture(scope="module")
def runs(name, tmp_path_factory):
    """metrics.npz and params.msgpack of the same runs on 1, 2 and 4 devices."""

    # Directories made here, not in the threads: tmp_path_factory is not thread-safe.
    dirs = {
        devices: (tmp_path_factory.mktemp("cache"), tmp_path_factory.mktemp(f"runs{devices}")) for devices in (1, 2, 4)
    }

    def run(devices: int):
        cache_dir, runs_dir = dirs[devices]
        env = dict(
            os.environ,
            XLA_FLAGS=" ".join([f"--xla_force_host_platform_device_count={devices}", *TEST_XLA_FLAGS]),
            JAX_COMPILATION_CACHE_DIR=str(cache_dir),
        )
        try:
            return subprocess.run(
                [
                    sys.executable,
                    str(ROOT / "algorithms" / f"{name}.py"),
                    *SPECS[name].small,
                    *SHARDED,
                    *POPULATION.get(name, ()),
                    "--runs-dir",
                    str(runs_dir),
                ],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=240,
            )
        except subprocess.TimeoutExpired:
            return None

    # The three processes run side by side: each spends seconds importing and compiling.
    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        procs = dict(zip((1, 2, 4), pool.map(run, (1, 2, 4)), strict=False))
    out = {"name": name}
    for devices, proc in procs.items():
        if proc is None:
            pytest.fail(f"{name}.py on {devices} devices did not finish in 240 s (deadlock?)")
        assert proc.returncode == 0, proc.stderr
        run_dir = results_dir(proc, ROOT)
        with np.load(run_dir / "metrics.npz") as npz:
            metrics = {k: npz[k] for k in npz.files}
        params = serialization.msgpack_restore((run_dir / "params.msgpack").read_bytes())
        out[devices] = metrics, params
    return out


@pytest.mark.parametrize("devices", [2, 4])
def test_sharded_runs_equal_single_device_runs(runs, devices):
    single_metrics, single_params = runs[1]
    rtol, atol = SPECS[runs["name"]].tolerance
    metrics, params = runs[devices]
    assert metrics.keys() == single_metrics.keys()
    for name, value in single_metrics.items():
        assert metrics[name].shape == value.shape, name
        if name == "wall_seconds":  # differs between any two runs
            continue
        if value.dtype.kind == "f":
            # Sharded and single-device programs may associate float sums differently.
            np.testing.assert_allclose(metrics[name], value, rtol=rtol, atol=atol, err_msg=name)
        else:
            np.testing.assert_array_equal(metrics[name], value, err_msg=name)
    single_leaves = dict(_leaves(single_params))
    for path, leaf in _leaves(params):
        assert leaf.shape[:2] == (2, 3), path  # [sweep point, seed]: the padding is gone
        np.testing.assert_allclose(leaf, single_leaves[path], rtol=rtol, atol=atol, err_msg=path)
    if "pbt_copied_from" in metrics:  # a population: some member copied one held by another device
        copied = metrics["pbt_copied_from"].reshape(6, -1)
        members, _ = np.nonzero(copied >= 0)
        assert (members // 3 != copied[copied >= 0] // 3).any(), "no copy between the 2 devices' halves"
