"""Checkpoints and what continues from a run directory: --resume (the whole training state, bit
for bit) and --eval-only (the saved parameters)."""

import dataclasses
import json
import os

import jax
import numpy as np
from flax import serialization

from .chunks import TrainingLog
from .plan import RunPlan, pad_runs
from .protocol import UsageError, flag
from .rundir import write_file

CHECKPOINT = "checkpoint.msgpack"


def saved_config(algo, option: str, run_dir: str, config, sweep: dict, given: set):
    """The Config, sweep and --pbt settings (config.json's "pbt", None without) a run directory was
    trained with; of the flags given now, only those that cannot change the compiled program or the
    results so far may differ."""
    try:
        with open(os.path.join(run_dir, "config.json")) as f:
            saved = json.load(f)
    except (OSError, ValueError) as error:
        raise UsageError(f"{option} {run_dir}: no readable config.json there ({error})") from None
    fields = {field.name for field in dataclasses.fields(algo.Config)}
    saved_sweep, saved_pbt = saved.pop("sweep", {}), saved.pop("pbt", None)
    result = algo.Config(**{name: value for name, value in saved.items() if name in fields})
    may_change = {"--resume": {"total_timesteps"}, "--eval-only": {"eval_episodes"}}[option]
    for name in sorted(given & fields):
        if getattr(config, name) != getattr(result, name):
            if name not in may_change:
                raise UsageError(
                    f"--{flag(name)} cannot change with {option} (the run has "
                    f"{getattr(result, name)!r}); may change: {', '.join(map(flag, may_change))}"
                )
            result = dataclasses.replace(result, **{name: getattr(config, name)})
    if "sweep" in given and sweep != saved_sweep:
        raise UsageError(f"--sweep cannot change with {option} (the run swept {saved_sweep})")
    pbt_options = sorted(name for name in given if name.startswith("pbt"))
    if pbt_options:
        raise UsageError(f"--{flag(pbt_options[0])} cannot change with {option}: the run's own are in its config.json")
    return result, saved_sweep, saved_pbt


def save_checkpoint(job, plan: RunPlan, runner, log: TrainingLog) -> int | None:
    """Writes every run's whole training state (every runner field: parameters, optimizer, env
    states, observations, episode counters, statistics, random keys, the replay buffer unless
    --no-checkpoint-buffer) with the metrics so far into RUN_DIR/checkpoint.msgpack, atomically:
    a crash while writing leaves the previous checkpoint whole. Returns its size on host 0."""
    if not job.args.checkpoint:
        return None
    state = plan.to_host(runner)  # every host takes part: a gather under jax.distributed
    keep = job.args.checkpoint_buffer
    leaves = {
        jax.tree_util.keystr(path): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_leaves_with_path(state)
        if keep or not is_buffer(path)
    }
    if job.run_dir is None:
        return None
    data = serialization.msgpack_serialize(
        {
            "algorithm": job.algo.name,
            "updates_done": log.num_updates,
            "train_seconds": log.seconds,
            "metrics": log.metrics(),
            "runner": leaves,
            "buffer_saved": keep or not hasattr(runner, "buffer"),
        }
    )
    write_file(os.path.join(job.run_dir, CHECKPOINT), data)
    return len(data)


def is_buffer(path) -> bool:
    return getattr(path[0], "name", None) == "buffer"


def load_checkpoint(algo, run_dir: str, config) -> dict:
    try:
        with open(os.path.join(run_dir, CHECKPOINT), "rb") as f:
            checkpoint = serialization.msgpack_restore(f.read())
    except (OSError, ValueError) as error:
        raise UsageError(f"--resume {run_dir}: no readable {CHECKPOINT} there ({error})") from None
    if checkpoint["algorithm"] != algo.name:
        raise UsageError(f"--resume {run_dir}: a checkpoint of {checkpoint['algorithm']}.py, not {algo.name}.py")
    done = int(checkpoint["updates_done"])
    if done > config.num_updates:
        raise UsageError(
            f"--total-timesteps {config.total_timesteps:,}: the run has already trained "
            f"{done * config.steps_per_update:,} steps per run"
        )
    return checkpoint


def restore_runner(runner, checkpoint: dict, plan: RunPlan):
    """The fresh runners with every saved field put back; a field the checkpoint left out (the
    replay buffer) stays as `init` made it."""
    saved = checkpoint["runner"]

    def restore(path, leaf):
        key = jax.tree_util.keystr(path)
        if key not in saved:
            return leaf
        value = np.asarray(saved[key])
        value = value.reshape(plan.num_runs, *value.shape[2:])  # [points, seeds, ...] -> [runs, ...]
        if value.shape[1:] != leaf.shape[1:] or value.dtype != leaf.dtype:
            raise UsageError(
                f"--resume: the checkpoint's {key} is {value.dtype}{list(value.shape[1:])}, "
                f"this program's {leaf.dtype}{list(leaf.shape[1:])}"
            )
        return pad_runs(value, plan.num_runs)

    return jax.device_put(jax.tree_util.tree_map_with_path(restore, runner), plan.sharding)


def resume_log(checkpoint: dict) -> TrainingLog:
    metrics = {name: np.asarray(value) for name, value in checkpoint["metrics"].items()}
    return TrainingLog(chunks=[metrics], chunk_ends=[float(checkpoint["train_seconds"])])


def load_params(run_dir: str):
    try:
        with open(os.path.join(run_dir, "params.msgpack"), "rb") as f:
            return serialization.msgpack_restore(f.read())
    except (OSError, ValueError) as error:
        raise UsageError(
            f"--eval-only {run_dir}: no readable params.msgpack there ({error}); a stopped "
            "run writes it once --resume has finished it"
        ) from None
