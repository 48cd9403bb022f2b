"""`python algorithms/<name>.py ...` in the repository: the file hands its module to `command_line`,
which checks the input, plans the runs, trains them in chunks and writes the run directory."""

import argparse
import importlib.util
import os
import sys
import time
import types
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax

from . import checkpoints, pbt, plan, protocol, rundir, suites, xla
from .chunks import Programs, TrainingLog, compile_programs, progress_reporter, train_in_chunks
from .cli import parse_args
from .evaluation import drawable_env, evaluate_saved
from .protocol import Algorithm, UsageError
from .stats import point_label
from .tracking import Tracker


class Job(NamedTuple):
    """One command: what to train (or evaluate) and where."""

    algo: Algorithm
    config: Any  # the file's Config
    sweep: dict
    points: list
    args: argparse.Namespace
    train: Callable  # the file's make_train(config)
    run_dir: str | None  # None on every host but host 0
    checkpoint: dict | None  # what --resume continues from
    params: Any  # what --eval-only evaluates
    pbt: pbt.Settings | None  # --pbt's settings; None without

    @property
    def program(self) -> str:
        return f"{self.algo.name}.py"


def command_line(module: types.ModuleType, argv: Sequence[str] | None = None) -> int:
    """The command line of the algorithm file `module`. Exit status: 0 done, 2 bad input (nothing
    compiled or written), 3 NaN or inf appeared, 1 training or writing stopped by an error, 130
    stopped by Ctrl-C."""
    if not xla.backend_started():  # in this process, JAX has not computed yet: set XLA's flags
        xla.configure()
    is_host_0 = jax.process_index() == 0  # under jax.distributed, host 0 reports and writes
    name = os.path.basename(module.__file__)
    try:
        algo = protocol.load(module)
        job = prepare(algo, module.__doc__ or name, argv, is_host_0)
    except (UsageError, getattr(module, "ConfigError", UsageError)) as error:
        print(f"{name}: error: {error}", file=sys.stderr)
        return 2
    say = (lambda *args: print(*args, flush=True)) if is_host_0 and not job.args.quiet else lambda *_: None
    if job.args.compile_cache:
        xla.enable_compile_cache()
    runs = plan.plan_runs(algo, job.config, job.points)
    if job.args.eval_only:
        return evaluate_saved(job, runs, say)
    return train(job, runs, say)


def prepare(algo: Algorithm, doc: str, argv: Sequence[str] | None, is_host_0: bool) -> Job:
    """Parses and checks the command line, reads what --resume or --eval-only continue from, and
    makes a new run's directory: every bad input is refused before anything compiles."""
    config, args, given = parse_args(algo, doc, argv)
    if args.resume and args.eval_only:
        raise UsageError("--resume and --eval-only: give one of them")
    if args.render and not args.eval_only:
        raise UsageError("--render draws a trained policy: use it with --eval-only RUN_DIR")
    sweep = plan.parse_sweep(algo, args.sweep)
    source, population = args.resume or args.eval_only, None
    if source:
        config, sweep, population = checkpoints.saved_config(
            algo, "--resume" if args.resume else "--eval-only", source, config, sweep, given
        )
    algo.validate(config)
    suites.register(config.env_name)
    points = plan.sweep_points(algo, config, sweep)
    if population is not None:
        population = pbt.Settings.from_json(population)
    elif not source:
        population = pbt.settings_from(algo, config, args, given, points)
    # Building the env stops an unknown one, or one of the wrong action kind, here.
    train = algo.make_train(config, suites.vec_env(algo, config.env_name, config.num_envs))
    if not args.eval_only:
        plan.check_memory(algo, config, train, len(points) * config.num_seeds)
    if population is not None and not args.eval_only:
        pbt.check_runner(algo, config, train)
    if args.render:
        drawable_env(algo, config.env_name)
    if args.track:
        module = {"tensorboard": "tensorboardX", "wandb": "wandb"}[args.track]
        if importlib.util.find_spec(module) is None:
            raise UsageError(f"--track {args.track} needs {module}: pip install {module}")
    checkpoint = checkpoints.load_checkpoint(algo, source, config) if args.resume else None
    params = checkpoints.load_params(source) if args.eval_only else None
    run_dir = source or (
        rundir.create_run_dir(algo.name, args.runs_dir, config, sweep, population) if is_host_0 else None
    )
    if args.resume and is_host_0:  # the run's config.json says what it now trains for
        rundir.write_file(os.path.join(source, "config.json"), rundir.config_json(config, sweep, population))
    return Job(algo, config, sweep, points, args, train, run_dir if is_host_0 else None, checkpoint, params, population)


def train(job: Job, runs: plan.RunPlan, say: Callable) -> int:
    """Compiles, restores a checkpoint if resuming, trains in chunks, then finishes the run."""
    announce(job, runs, say)
    start = time.perf_counter()
    runner, programs = compile_programs(job.algo, job.config, job.train, runs, job.pbt)
    seconds = {"compile": time.perf_counter() - start}
    say(f"compiled in {seconds['compile']:.1f} s")
    log = TrainingLog()
    if job.checkpoint:
        runner = checkpoints.restore_runner(runner, job.checkpoint, runs)
        log = checkpoints.resume_log(job.checkpoint)
    tracker = Tracker(job, runs) if job.args.track and job.run_dir else None
    report = progress_reporter(job.config, runs, log, say, tracker)
    save = lambda runner: checkpoints.save_checkpoint(job, runs, runner, log)  # noqa: E731
    try:
        runner, interrupted = train_in_chunks(job, runs, programs, runner, log, report, save)
    except (Exception, KeyboardInterrupt) as error:
        return stopped_early(job, runs, log, error)
    if interrupted:
        return stopped_early(job, runs, log, KeyboardInterrupt(), checkpointed=True)
    seconds["train"] = log.seconds
    return finish(job, runs, programs, runner, log, seconds, say, tracker)


def announce(job: Job, runs: plan.RunPlan, say: Callable) -> None:
    config = job.config
    say(
        f"{job.program} with the run harness: {config.env_name}, {runs.num_runs} run(s) ({runs.num_seeds} seeds x "
        f"{len(runs.points)} sweep points), {config.num_updates} updates of {config.steps_per_update} env steps each, "
        f"on {len(plan.run_devices(runs.num_runs))} {jax.default_backend()} device(s)"
    )
    if job.checkpoint:
        buffer = (
            ""
            if job.checkpoint["buffer_saved"]
            else "; its replay buffer was not saved: it restarts empty and refills as the agent acts, and gradient "
            "steps go on at their schedule, drawing from what it holds"
        )
        say(f"resuming {job.run_dir} after update {int(job.checkpoint['updates_done'])}{buffer}")
    if job.pbt is not None:
        settings = job.pbt
        say(
            f"population-based training: every {settings.interval} updates the weakest {settings.fraction:.0%} copy "
            f"one of the fittest {settings.fraction:.0%} (fitness: {settings.fitness}) and {settings.perturb} "
            + ", ".join(map(protocol.flag, settings.fields))
        )
    if config.total_timesteps % config.steps_per_update:
        say(
            f"note: total_timesteps {config.total_timesteps:,} is not a multiple of the {config.steps_per_update} "
            f"env steps of an update; training {config.num_updates * config.steps_per_update:,} steps per run"
        )


def finish(job: Job, runs, programs: Programs, runner, log: TrainingLog, seconds: dict, say, tracker) -> int:
    """Evaluates the trained runs, writes the checkpoint and the run directory, and reports;
    returns the exit status."""
    start = time.perf_counter()
    saved = job.algo.saved_params(runner)
    eval_keys = jax.device_put(runs.eval_keys, runs.sharding)
    eval_returns, params = runs.to_host((programs.evaluate(saved, eval_keys), saved))
    seconds["eval"] = time.perf_counter() - start
    metrics = log.metrics()
    summary = rundir.summarise_run(job, runs, metrics, eval_returns, seconds)
    try:
        summary["checkpoint_bytes"] = checkpoints.save_checkpoint(job, runs, runner, log)
        if job.run_dir is None:  # not host 0
            return 3 if "nonfinite" in summary else 0
        rundir.write_results(job, runs, metrics, eval_returns, params, summary)
    except OSError as error:
        print(f"{job.program}: error: could not write the results into {job.run_dir}: {error}", file=sys.stderr)
        return 1
    if tracker is not None:
        tracker.finish(summary)
    report(summary, runs.num_seeds, say)
    print(f"results: {job.run_dir}", flush=True)
    if "nonfinite" in summary:
        bad = summary["nonfinite"]
        print(
            f"error: non-finite loss or parameters first appeared at update {bad['first_update']} (env step "
            f"{bad['env_steps']:,}, seed index {bad['seed_index']}"
            + (f", sweep point {bad['sweep_point']}" if runs.points != [{}] else "")
            + ")",
            file=sys.stderr,
        )
        return 3
    return 0


def report(summary: dict, num_seeds: int, say: Callable) -> None:
    show = lambda x: "n/a" if x is None else f"{x:.1f}"  # noqa: E731
    for point in summary.get("sweep", [summary]):
        interval = point["final_return_iqm_ci95"] or [None, None]
        say(
            f"{point_label(point.get('sweep_point', {})) or 'final'}: return {show(point['final_return_mean'])} ± "
            f"{show(point['final_return_std'])}, IQM {show(point['final_return_iqm'])} (95% CI {show(interval[0])} to "
            f"{show(interval[1])}) over {num_seeds} seeds (episodes ending in the last 5% of training), greedy eval "
            f"{show(point['eval_return_mean'])}"
        )
    if "pbt" in summary:
        report_population(summary["pbt"], say, show)
    say(
        f"compile {summary['compile_seconds']:.1f} s, train {summary['train_seconds']:.1f} s "
        f"({summary['steps_per_second']:,.0f} env steps/s), eval {summary['eval_seconds']:.1f} s"
    )


def report_population(population: dict, say: Callable, show: Callable) -> None:
    """The population at the end: the fittest member (by the stated rule, with its ties), the start its
    weights descend from, and which starts' weights the population carries."""
    best, origin = population["best_member"], population["best_member"]["descends_from"]
    tied = f"; tied at that return with member(s) {', '.join(map(str, best['tied_with']))}" if best["tied_with"] else ""
    started = f"{point_label(origin['sweep_point']) or 'the config'}, seed {origin['seed_index']}"
    say(
        f"population-based training: {population['copies']} copies in {population['exploit_steps']} exploit steps; "
        f"fittest member {best['index']} ({population['fittest_rule']}{tied}): return {show(best['final_return'])}, "
        f"greedy eval {show(best['eval_return'])}, its weights from member {origin['member']} (started at {started}), "
        "ending at "
        + ", ".join(f"{name}={best['hparams'][name]:g}" for name in population["fields"])
        + f"; median member: return {show(population['median_final_return'])}"
    )
    lines: dict = {}
    for member in population["members"]:
        lines.setdefault(member["descends_from"]["member"], []).append(member["index"])
    say(
        "weights at the end, by the start member they descend from: "
        + "; ".join(f"member {start}'s in {', '.join(map(str, ms))}" for start, ms in sorted(lines.items()))
    )


def stopped_early(job: Job, runs, log: TrainingLog, error: BaseException, checkpointed: bool = False) -> int:
    """Training stopped (an error, or Ctrl-C): the run directory keeps every update that finished
    and a summary that says why; one line on stderr says so, and how to go on after Ctrl-C."""
    interrupted = isinstance(error, KeyboardInterrupt)
    why = "interrupted (Ctrl-C)" if interrupted else f"{type(error).__name__}: {error}".splitlines()[0]
    config, run_dir = job.config, job.run_dir
    if run_dir is not None:
        summary = {
            "algorithm": job.algo.name,
            "env_name": config.env_name,
            "num_seeds": runs.num_seeds,
            "stopped": why,
            "completed_updates": log.num_updates,
            "num_updates": config.num_updates,
        }
        try:
            if log.chunks:
                metrics = log.metrics()
                summary = {**rundir.summarise_run(job, runs, metrics, None, {"train": log.seconds}), **summary}
                rundir.write_results(job, runs, metrics, None, None, summary)
            else:
                rundir.write_json(os.path.join(run_dir, "summary.json"), summary)
        except OSError:
            pass  # the error that stopped training is the one to report
        print(f"results: {run_dir}", flush=True)
    if checkpointed and job.args.checkpoint:
        how = f"; continue with --resume {run_dir}"
    else:
        how = f"; the finished updates are in {run_dir}" if run_dir else ""
    stopped = f"training stopped after {log.num_updates} of {config.num_updates} updates"
    print(f"{job.program}: error: {stopped}: {why}{how}", file=sys.stderr)
    return 130 if interrupted else 1
