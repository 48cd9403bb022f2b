"""What every benchmark script here shares: running an algorithm file's command line in a fresh
process, reading back the run directory it wrote, and describing the machine it ran on."""

import json
import os
import platform
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "algorithms"))  # the run harness package beside the files
from onefile_harness import stats, suites, xla  # noqa: E402, F401  (the benchmarks' shared imports)


def algorithm_path(name: str) -> str:
    return os.path.join(ROOT, "algorithms", f"{name}.py")


def load_algorithm(name: str):
    """algorithms/<name>.py as a module: importing it defines things and does nothing else."""
    import importlib.util
    import sys

    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, algorithm_path(name))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


def seed_curves(metrics: dict) -> np.ndarray:
    """Each seed's own return per update, as the run directory's curve and the tables define it
    (the harness's window_returns: episodes ending in the trailing 5% window): [..., seeds, updates]."""
    return stats.window_returns(metrics)


def run_cli(name: str, flags: list, runs_dir: str, cache_dir: str, timeout: int = 1800) -> dict:
    """`python algorithms/<name>.py FLAGS --quiet` in a fresh process with the given compile cache
    (an empty one measures a cold compile). Returns the run directory's summary and metrics, the
    process's wall-clock, and the exit code (3 means non-finite values appeared)."""
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": cache_dir}
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, algorithm_path(name), *map(str, flags), "--quiet", "--runs-dir", runs_dir],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    wall = time.perf_counter() - start
    lines = proc.stdout.strip().splitlines()
    if proc.returncode not in (0, 3) or not lines or not lines[-1].startswith("results: "):
        raise RuntimeError(
            f"{name}.py {' '.join(map(str, flags))} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
        )
    run_dir = os.path.join(ROOT, lines[-1][len("results: ") :])
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    with np.load(os.path.join(run_dir, "metrics.npz")) as npz:
        metrics = {k: npz[k] for k in npz.files}
    return {
        "summary": summary,
        "metrics": metrics,
        "run_dir": run_dir,
        "process_wall_s": wall,
        "exit_code": proc.returncode,
    }


def machine() -> dict:
    """Where a measurement was taken: enough to know which figures may be compared."""
    from importlib import metadata

    import jax

    versions = {}
    for package in ("jax", "jaxlib", "flax", "optax", "gymnax", "distrax", "jaxmarl", "mctx", "pgx"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return {
        "platform": platform.machine(),
        "cpu_cores": os.cpu_count(),
        "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
        "python": platform.python_version(),
        "versions": versions,
        "date": time.strftime("%Y-%m-%d"),
    }


def describe(machine: dict) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in machine["versions"].items())
    return (
        f"Measured {machine['date']} on {machine['platform']} with {machine['cpu_cores']} CPU cores, backend "
        f"{machine['backend']} ({machine['device']}), Python {machine['python']}, {versions}"
    )


def write_markdown(path: str, lines: list) -> None:
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {path}", flush=True)


def run_result(cmd: list, env: dict | None = None, timeout: int = 900) -> dict | None:
    """Runs a driver in a fresh process and returns its `RESULT {json}` line, or None."""
    try:
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"  timed out after {timeout} s: {' '.join(cmd)}", flush=True)
        return None
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    print(f"  no result (exit {out.returncode}): {' '.join(cmd)}\n{out.stderr[-2000:]}", flush=True)
    return None
