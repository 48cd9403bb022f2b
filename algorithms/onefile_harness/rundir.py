"""The run directory and what it holds: config.json before anything compiles, then metrics.npz,
params.msgpack, summary.json and learning_curve.png; files are written whole or not at all."""

import dataclasses
import io
import itertools
import json
import math
import os
import re
import sys
import time

import jax
import numpy as np
from flax import serialization

from . import pbt
from .plan import RunPlan, run_devices
from .protocol import UsageError
from .stats import bootstrap_interval, final_returns, iqm, learning_curves_png, nanmean, number


def create_run_dir(algorithm: str, runs_dir: str, config, sweep: dict, population=None) -> str:
    """A new directory under `runs_dir` holding config.json, made before anything compiles; a
    `runs_dir` that cannot hold it is a UsageError. Never reuses a directory."""
    try:
        run_dir = new_run_dir(algorithm, runs_dir, config.env_name)
        write_file(os.path.join(run_dir, "config.json"), config_json(config, sweep, population))
    except OSError as error:
        raise UsageError(
            f"--runs-dir {runs_dir}: cannot write a run directory there ({error.strerror or error})"
        ) from None
    return run_dir


def config_json(config, sweep: dict, population=None) -> bytes:
    """The Config's fields, the sweep, and the --pbt settings (a pbt.Settings) when there are any."""
    extra = {} if population is None else {"pbt": population.as_json()}
    return json.dumps({**dataclasses.asdict(config), "sweep": sweep, **extra}, indent=2).encode()


def new_run_dir(algorithm: str, runs_dir: str, env_name: str) -> str:
    """A directory no earlier run has used: created atomically, never reused."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = re.sub(r"[^A-Za-z0-9._-]", "-", env_name)  # SUITE/NAME[:BACKEND] as one folder name
    for attempt in itertools.count():
        path = os.path.join(runs_dir, f"{algorithm}-{name}-{stamp}" + (f"-{attempt}" if attempt else ""))
        try:
            os.makedirs(path)
            return path
        except FileExistsError:
            continue


def write_file(path: str, data: bytes) -> None:
    """Writes to a temporary name, then renames: a file is either whole or not there."""
    with open(path + ".partial", "wb") as f:
        f.write(data)
    os.replace(path + ".partial", path)


def write_json(path: str, value: dict) -> None:
    write_file(path, json.dumps(value, indent=2).encode())


def write_results(job, plan: RunPlan, metrics: dict, eval_returns, params, summary: dict) -> None:
    """metrics.npz, params.msgpack (when training finished) and summary.json, then the plot."""
    arrays = {
        **{f"sweep_{name}": np.array([point[name] for point in plan.points]) for name in plan.points[0]},
        **metrics,
    }
    if eval_returns is not None:
        arrays["eval_return"] = eval_returns
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)
    write_file(os.path.join(job.run_dir, "metrics.npz"), buffer.getvalue())
    if params is not None:
        write_file(os.path.join(job.run_dir, "params.msgpack"), serialization.to_bytes(params))
    write_json(os.path.join(job.run_dir, "summary.json"), summary)
    plots = {
        "learning_curve.png": lambda: learning_curves_png(
            job.algo.name, metrics, plan.points, plan.num_seeds, job.config.env_name
        )
    }
    if job.pbt is not None:
        plots["pbt.png"] = lambda: pbt.trajectories_png(
            job.algo.name, metrics, job.pbt, job.config.env_name, eval_returns, getattr(job.config, "anneal_lr", False)
        )
    for name, draw in plots.items():
        try:
            write_file(os.path.join(job.run_dir, name), draw())
        except Exception as error:  # everything else is written: a broken plot must not cost the run
            print(f"{job.program}: warning: could not draw {name} ({error})", file=sys.stderr)


def point_figures(point: dict, final: np.ndarray, eval_returns) -> dict:
    """One sweep point's figures over its seeds' final returns (NaN: a seed with no finished episode)."""
    finite = final[np.isfinite(final)]
    return {
        "sweep_point": point,
        "final_return_mean": number(nanmean(final)),
        "final_return_std": number(np.sqrt(nanmean((final - nanmean(final)) ** 2))),
        "final_return_iqm": number(iqm(finite)) if len(finite) else None,
        "final_return_iqm_ci95": list(bootstrap_interval(finite)) if len(finite) else None,
        "final_return_per_seed": [number(x) for x in final],
        "eval_return_mean": None if eval_returns is None else number(np.mean(eval_returns)),
    }


def summarise_run(job, plan: RunPlan, metrics: dict, eval_returns, seconds: dict) -> dict:
    """summary.json: the best sweep point's figures at the top level, every point under `sweep`."""
    config, finals = job.config, final_returns(metrics)  # [points, seeds]
    per_point = [
        point_figures(point, finals[index], None if eval_returns is None else eval_returns[index])
        for index, point in enumerate(plan.points)
    ]
    ranked = [-math.inf if p["final_return_mean"] is None else p["final_return_mean"] for p in per_point]
    best = int(np.argmax(ranked))
    trained = metrics["episode_return"].shape[-1] * config.steps_per_update
    summary = {
        "algorithm": job.algo.name,
        "env_name": config.env_name,
        "num_seeds": plan.num_seeds,
        "total_timesteps": config.total_timesteps,
        "trained_timesteps": trained,
        **{k: v for k, v in per_point[best].items() if k != "sweep_point"},
        **{f"{name}_seconds": value for name, value in seconds.items()},
        "steps_per_second": trained * plan.num_runs / seconds["train"],
        "backend": jax.default_backend(),
        "devices": [str(d) for d in run_devices(plan.num_runs)],
        "versions": package_versions(),
    }
    if plan.points != [{}]:
        summary.update(best_sweep_point=plan.points[best], sweep=per_point)
    if job.pbt is not None:
        summary["pbt"] = pbt.summarise_pbt(job.pbt, metrics, eval_returns, plan.points, plan.num_seeds)
    nonfinite = first_nonfinite(config, plan, metrics)
    if nonfinite:
        summary["nonfinite"] = nonfinite
    return summary


def first_nonfinite(config, plan: RunPlan, metrics: dict) -> dict | None:
    """Where NaN or inf first appeared in a loss or the parameters: update, env step, seed, point."""
    nonfinite = ~metrics["finite"]
    if not nonfinite.any():
        return None
    update = int(np.argmax(nonfinite.any(axis=(0, 1))))
    point, seed = map(int, np.argwhere(nonfinite[:, :, update])[0])
    return {
        "first_update": update + 1,
        "env_steps": (update + 1) * config.steps_per_update,
        "seed_index": seed,
        "sweep_point": plan.points[point],
    }


def package_versions() -> dict:
    from importlib import metadata

    versions = {"python": sys.version.split()[0]}
    for name in ("jax", "jaxlib", "flax", "optax", "distrax", "gymnax", "chex", "numpy"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return versions
