"""What runs, and where: the sweep's grid of points, every point's seeds as one leading run axis,
that axis spread over the devices, and whether the runs' replay buffers fit in memory."""

import itertools
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from .protocol import Algorithm, UsageError, flag


def parse_sweep(algo: Algorithm, specs: Sequence[str]) -> dict:
    """['lr=1e-4,3e-4', 'gamma=0.9,0.99'] -> {'lr': [1e-4, 3e-4], 'gamma': [0.9, 0.99]}."""
    sweep = {}
    for spec in specs:
        name, sep, values = spec.partition("=")
        name = name.strip().lstrip("-").replace("-", "_")
        if name in sweep:
            raise UsageError(f"--sweep {spec!r}: {flag(name)} is swept twice; give all its values in one flag")
        if not sep or name not in algo.sweepable:
            raise UsageError(
                f"--sweep {spec!r}: expected FIELD=V1,V2,... with FIELD one of " + ", ".join(map(flag, algo.sweepable))
            )
        try:
            sweep[name] = [float(v) for v in values.split(",")]
        except ValueError:
            raise UsageError(f"--sweep {spec!r}: values must be numbers separated by commas") from None
    return sweep


def sweep_points(algo: Algorithm, config, sweep: dict) -> list[dict]:
    """The grid of hyperparameter values, one dict per point; [{}] when nothing is swept."""
    points = [dict(zip(sweep, values, strict=True)) for values in itertools.product(*sweep.values())]
    for point in points:
        try:
            algo.validate_hparams({name: point.get(name, getattr(config, name)) for name in algo.sweepable})
        except algo.ConfigError as error:
            raise UsageError(f"--sweep value: {error}") from None
    return points


def run_devices(num_runs: int) -> list:
    """The devices the runs are spread over: every device of every host under jax.distributed;
    on one host at most one device per run, so that no device trains padding only."""
    return jax.devices() if jax.process_count() > 1 else jax.devices()[:num_runs]


def runs_sharding(num_runs: int) -> jax.sharding.NamedSharding:
    """A 1-D mesh over `run_devices(num_runs)` that splits the leading run axis."""
    mesh = jax.sharding.Mesh(np.array(run_devices(num_runs)), ("runs",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("runs"))


def pad_runs(tree, num_runs: int):
    """Pads the leading run axis to a multiple of the device count by repeating the last run;
    the repeats train like any run and `gather_runs` drops them."""
    num_devices = len(run_devices(num_runs))
    index = np.minimum(np.arange(-(-num_runs // num_devices) * num_devices), num_runs - 1)
    return jax.tree.map(lambda x: np.asarray(x)[index], tree)


def gather_runs(tree, shape: tuple):
    """Host copies of run-axis arrays, padding dropped, runs laid out as `shape` ([points, seeds])."""
    if jax.process_count() > 1:  # every host holds only its devices' runs
        from jax.experimental import multihost_utils

        tree = multihost_utils.process_allgather(tree, tiled=True)
    size = int(np.prod(shape))
    return jax.tree.map(lambda x: np.asarray(x)[:size].reshape(*shape, *np.shape(x)[1:]), tree)


class RunPlan(NamedTuple):
    """Every run of one command: [sweep point, seed] flattened into one leading run axis (every
    point trains the same seeds), padded to a multiple of the device count."""

    points: list  # the sweep points, {field: value} each; [{}] without --sweep
    num_seeds: int
    keys: np.ndarray  # [padded runs, 2] training keys
    hparams: Any  # the file's HParams, each field [padded runs]
    eval_keys: np.ndarray  # [padded runs, 2] evaluation keys
    sharding: jax.sharding.NamedSharding

    @property
    def num_runs(self) -> int:
        return len(self.points) * self.num_seeds

    def to_host(self, tree):
        """Run-axis arrays as host arrays [points, seeds, ...], padding dropped."""
        return gather_runs(tree, (len(self.points), self.num_seeds))

    def to_devices(self, tree):
        """Host arrays [runs, ...] padded and spread over the devices."""
        return jax.device_put(pad_runs(tree, self.num_runs), self.sharding)


def plan_runs(algo: Algorithm, config, points: list[dict]) -> RunPlan:
    num_runs = len(points) * config.num_seeds
    seed_keys = jax.random.split(jax.random.PRNGKey(config.seed), config.num_seeds)
    eval_keys = jax.random.split(jax.random.PRNGKey(config.seed + 1), config.num_seeds)
    values = np.array([[point.get(name, getattr(config, name)) for name in algo.sweepable] for point in points])
    hparams = algo.HParams(*np.repeat(values.astype(np.float32), config.num_seeds, axis=0).T)
    every_point = lambda keys: np.tile(keys, (len(points), 1))  # noqa: E731
    return RunPlan(
        points=points,
        num_seeds=config.num_seeds,
        keys=pad_runs(every_point(seed_keys), num_runs),
        hparams=pad_runs(hparams, num_runs),
        eval_keys=pad_runs(every_point(eval_keys), num_runs),
        sharding=runs_sharding(num_runs),
    )


def check_memory(algo: Algorithm, config, train, num_runs: int) -> None:
    """Refuses replay buffers that cannot fit, before anything is allocated or compiled: their size
    comes from the shapes `train.init` would make, computed without making them."""
    hparams = algo.HParams(*(np.float32(getattr(config, name)) for name in algo.sweepable))
    runner = jax.eval_shape(train.init, jax.random.PRNGKey(0), hparams)
    buffer = getattr(runner, "buffer", None)
    if buffer is None:
        return
    per_run = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(buffer))
    available, where = available_memory()
    if num_runs * per_run > available:
        option = "--buffer-size" if "buffer_size" in algo.Config.__dataclass_fields__ else "the replay buffer"
        raise UsageError(
            f"{option}: the replay buffers need {readable_bytes(num_runs * per_run)} ({num_runs} run(s) x "
            f"{readable_bytes(per_run)}) but only {readable_bytes(available)} of {where} memory is available; "
            "use a smaller buffer or fewer seeds / sweep points"
        )


def available_memory() -> tuple[int, str]:
    """Bytes the replay buffers may take, and where: the accelerator's free memory, else the host's."""
    device = jax.devices()[0]
    if device.platform != "cpu":
        stats = device.memory_stats() or {}
        if "bytes_limit" in stats:
            return stats["bytes_limit"] - stats.get("bytes_in_use", 0), f"{device.platform} device"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "host"
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"), "host"


def readable_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:.3g} {unit}"
        n /= 1000
