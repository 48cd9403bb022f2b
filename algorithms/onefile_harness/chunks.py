"""Training as calls of one compiled chunk of updates, with progress between them and Ctrl-C
stopping at a chunk's end."""

import dataclasses
import math
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import pbt, suites
from .plan import RunPlan
from .stats import nanmean


class Programs(NamedTuple):
    run: Callable  # (runners, first update) -> (runners, metrics of `chunk` updates), compiled
    evaluate: Callable  # (saved params, keys) -> mean greedy return of every run
    chunk: int  # updates per call of `run`


def chunk_updates(train, chunk: int, num_updates: int) -> Callable:
    """`run(runner, first) -> (runner, metrics)`: `chunk` calls of `train.update` in one scan, from
    update `first` on. Only where `chunk` does not divide the run do updates past its end exist: the
    last chunk skips them, returning zeros the host drops."""

    def skip_past_end(runner, index):
        metrics = jax.eval_shape(train.update, runner, index)[1]
        return jax.lax.cond(
            index < num_updates,
            train.update,
            lambda runner, _: (runner, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), metrics)),
            runner,
            index,
        )

    step = train.update if num_updates % chunk == 0 else skip_past_end

    def run(runner, first):
        return jax.lax.scan(step, runner, first + jnp.arange(chunk, dtype=jnp.int32))

    return run


def initial_runners(train, plan: RunPlan):
    """Every run's first runner, made on one device (the plan spreads them out after). On CPU the runs
    are initialised one after another, not vmapped: vmapped, flax's orthogonal init becomes batched
    LAPACK QRs, which jaxlib splits over XLA's CPU thread pool while holding one of its threads, and a
    few of them at once deadlock the pool (ppo_rnd.py's four networks on Craftax's 1,345-dim
    observations; any init run on several CPU devices at once). 4 Craftax runs take 10 s this way."""
    if plan.sharding.mesh.devices.flat[0].platform != "cpu":
        return jax.jit(jax.vmap(train.init))(plan.keys, plan.hparams)
    one_by_one = lambda keys, hparams: jax.lax.map(lambda run: train.init(*run), (keys, hparams))  # noqa: E731
    return jax.jit(one_by_one)(plan.keys, plan.hparams)


def runs_apart(function, plan: RunPlan, replicated: tuple = ()):
    """`function` of arrays with a leading run axis (but the arguments `replicated`, given whole to every device)
    run on each device for that device's runs, as one program per device (`jax.shard_map`): the runs never talk
    to each other, so no device waits on another. Under jit's sharding alone, XLA's partitioner kept alphazero.py's
    search (mctx's batched tree updates) as one program over both CPU devices, 11x slower (docs/speed-tricks.md)."""
    runs, whole = jax.sharding.PartitionSpec("runs"), jax.sharding.PartitionSpec()

    def sharded(*args):
        specs = tuple(whole if i in replicated else runs for i in range(len(args)))
        return jax.shard_map(function, mesh=plan.sharding.mesh, in_specs=specs, out_specs=runs, check_vma=False)(*args)

    return sharded


def compile_programs(algo, config, train, plan: RunPlan, population: pbt.Settings | None = None):
    """The first runners (on the devices) and the compiled programs that train and evaluate them.
    With --pbt a chunk is one PBT interval, ending with the exploit/explore step."""
    runner = jax.device_put(initial_runners(train, plan), plan.sharding)
    chunk = population.interval if population else max(1, math.ceil(config.num_updates / 10))  # ~10 reports
    run = jax.vmap(chunk_updates(train, chunk, config.num_updates), (0, None))
    if population is not None:
        run = pbt.with_exploit(run, population, config.num_updates, algo, config)
    else:  # each device trains its runs alone (PBT's exploit step reads every run)
        run = runs_apart(run, plan, replicated=(1,))
    # The runners are donated: each chunk updates them (replay buffers included) in place.
    run = jax.jit(run, out_shardings=plan.sharding, donate_argnums=0)
    evaluate = jax.jit(runs_apart(jax.vmap(suites.make_evaluate(algo, config)), plan), out_shardings=plan.sharding)
    run = run.lower(runner, jnp.int32(0)).compile()
    jax.block_until_ready(runner)
    return runner, Programs(run=run, evaluate=evaluate, chunk=chunk)


@dataclasses.dataclass
class TrainingLog:
    """What has reached the host so far: each finished chunk's metrics ([points, seeds, updates]
    per name) and when it finished (seconds of training, earlier sessions of a resumed run
    included). A resumed run's first chunk is everything trained before, with its wall_seconds."""

    chunks: list = dataclasses.field(default_factory=list)
    chunk_ends: list = dataclasses.field(default_factory=list)

    @property
    def num_updates(self) -> int:
        return sum(chunk["episode_return"].shape[-1] for chunk in self.chunks)

    @property
    def seconds(self) -> float:
        return self.chunk_ends[-1] if self.chunk_ends else 0.0

    def metrics(self) -> dict:
        """Every finished update's metrics, plus `wall_seconds`: when each update had finished,
        measured at chunk ends and interpolated within a chunk (its updates cost alike)."""
        if not self.chunks:
            return {}
        names = [name for name in self.chunks[-1] if name != "wall_seconds"]
        metrics = {name: np.concatenate([chunk[name] for chunk in self.chunks], axis=-1) for name in names}
        walls, previous = [], 0.0
        for chunk, end in zip(self.chunks, self.chunk_ends, strict=True):
            updates = chunk["episode_return"].shape[-1]
            walls.append(chunk.get("wall_seconds", previous + (end - previous) * np.arange(1, updates + 1) / updates))
            previous = end
        metrics["wall_seconds"] = np.concatenate(walls)
        return metrics


def train_in_chunks(job, plan: RunPlan, programs: Programs, runner, log: TrainingLog, report: Callable, save: Callable):
    """Runs the updates not yet in `log` as calls of one compiled chunk, reporting between them:
    a callback inside the program would keep it out of the persistent compile cache. Each chunk
    is dispatched before the previous one is reported, so reporting costs no training time; the
    pipeline waits only where a checkpoint is due (--checkpoint-every, or Ctrl-C: then training
    stops there, and `save(runner)` writes it). Returns (final runners, whether Ctrl-C stopped it);
    `log` holds every finished chunk, also when this raises."""
    config, every, pending = job.config, job.args.checkpoint_every, None
    start = time.perf_counter() - log.seconds
    with StopRequest() as stop:
        for index, first in enumerate(range(log.num_updates, config.num_updates, programs.chunk)):
            runner, metrics = programs.run(runner, jnp.int32(first))
            if pending is not None:
                report(record_chunk(config, plan, log, *pending, start))
            pending = (first, metrics)
            if first + programs.chunk < config.num_updates and (stop.requested or (every and (index + 1) % every == 0)):
                report(record_chunk(config, plan, log, *pending, start))
                pending = None
                save(runner)
                if stop.requested:
                    return runner, True
        if pending is not None:  # None: a resumed run that had already finished
            report(record_chunk(config, plan, log, *pending, start))
    return runner, False


def record_chunk(config, plan: RunPlan, log: TrainingLog, first: int, metrics: dict, start: float) -> dict:
    """Brings a chunk's metrics to the host (waiting for it to finish) and logs them; updates
    past the config's end, which the last chunk skips, are dropped. Returns them."""
    updates = min(config.num_updates - first, metrics["episode_return"].shape[-1])
    metrics = {name: value[..., :updates] for name, value in plan.to_host(metrics).items()}
    log.chunks.append(metrics)
    log.chunk_ends.append(time.perf_counter() - start)
    return metrics


def progress_reporter(config, plan: RunPlan, log: TrainingLog, say: Callable, tracker) -> Callable:
    """What happens to each chunk's metrics once on the host: the tracker, and a progress line
    for each tenth of the run a chunk completes (--pbt's chunks may be shorter)."""
    tenth = math.ceil(config.num_updates / 10)

    def report(metrics: dict) -> None:
        if tracker is not None:
            tracker.log(metrics)
        done, seconds = log.num_updates, log.seconds
        if done < config.num_updates and done // tenth == (done - metrics["episode_return"].shape[-1]) // tenth:
            return
        steps = done * config.steps_per_update
        say(
            f"[{100 * done / config.num_updates:5.1f}%] update {done}/{config.num_updates}  env steps {steps:,}  "
            f"mean return of {plan.num_runs} runs {nanmean(metrics['episode_return']):8.2f}  "
            f"{steps * plan.num_runs / seconds:,.0f} steps/s"
        )

    return report


class StopRequest:
    """Ctrl-C during training: the first asks to stop at the end of the current chunk, after a
    checkpoint; a second one stops at once (KeyboardInterrupt)."""

    def __init__(self):
        self.requested, self.previous = False, None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            self.previous = signal.signal(signal.SIGINT, self.handle)
        return self

    def handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print(
            "Ctrl-C: stopping after this chunk with a checkpoint (Ctrl-C again: stop now)", file=sys.stderr, flush=True
        )

    def __exit__(self, *exc) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)
