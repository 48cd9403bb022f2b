"""The convolutional torso on this backend: the files' `Conv` as one matmul of the image's patches, sliced (its
form on CPU), against XLA's own convolution (`lax.conv_general_dilated`, what nn.Conv computes), in the compiled
training loop:

    python benchmarks/bench_conv.py                       # about 6 minutes on 2 CPU cores

For each file and each form, fresh processes, the order alternating between rounds: one
`jax.jit(jax.vmap(train))` of the file's default Config with `--network cnn` on Breakout-MinAtar (8 seeds), its
total_timesteps cut to a few updates, compile (lower + compile) and run timed apart. The ratio is the median over
rounds of patches / lax.conv within the round. Results: conv_<backend>.md and .jsonl.
"""

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
import time

from common import ROOT, describe, load_algorithm, machine, run_result, write_markdown

UPDATES = {"ppo": 6, "dqn": 6, "pqn": 6}  # updates timed per run: enough to dwarf the run's fixed costs


def worker(name: str, form: str) -> None:
    """One run of `name` with the given convolution form, timed as bench_speed.py's worker times ours."""
    module = load_algorithm(name)
    module.configure_xla()
    import jax

    module.Conv = functools.partial(module.Conv, patches=form == "patches")  # the Torso looks Conv up when called
    default = module.Config(env_name="Breakout-MinAtar", network="cnn")
    config = dataclasses.replace(default, total_timesteps=UPDATES[name] * default.steps_per_update)
    if hasattr(config, "learning_starts"):  # dqn.py: gradient steps from the first update, so that they are timed
        config = dataclasses.replace(config, learning_starts=0)
    keys = jax.random.split(jax.random.PRNGKey(0), config.num_seeds)
    train = module.make_train(config)
    start = time.perf_counter()
    compiled = jax.jit(jax.vmap(train)).lower(keys).compile()
    compiled_at = time.perf_counter()
    jax.block_until_ready(compiled(keys))
    run_s = time.perf_counter() - compiled_at
    steps = config.num_updates * config.steps_per_update * config.num_seeds
    result = dict(algorithm=name, form=form, compile_s=compiled_at - start, run_s=run_s, steps_per_s=steps / run_s)
    print("RESULT " + json.dumps(result), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--algorithms", default="ppo,dqn,pqn")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    parser.add_argument("--worker", nargs=2, metavar=("ALGORITHM", "FORM"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(*args.worker)
    where = machine()
    os.makedirs(args.out, exist_ok=True)
    jsonl, rows = os.path.join(args.out, f"conv_{where['backend']}.jsonl"), []
    for name in args.algorithms.split(","):
        ratios, compile_ratios = [], []
        for index in range(args.rounds):
            forms = ["patches", "conv"][:: 1 if index % 2 == 0 else -1]
            command = [sys.executable, os.path.abspath(__file__), "--worker", name]
            results = {form: run_result([*command, form], timeout=1200) for form in forms}
            with open(jsonl, "a") as file:
                file.write(json.dumps({"round": index, **results, "machine": where}) + "\n")
            ratios.append(results["patches"]["steps_per_s"] / results["conv"]["steps_per_s"])
            compile_ratios.append(results["patches"]["compile_s"] / results["conv"]["compile_s"])
            speeds = {form: f"{result['steps_per_s']:,.0f}" for form, result in results.items()}
            print(f"{name} round {index + 1}: env steps/s {speeds}, patches/conv {ratios[-1]:.2f}x", flush=True)
        speed, compile_ = statistics.median(ratios), statistics.median(compile_ratios)
        rows.append(f"| {name}.py | {args.rounds} | {speed:.2f}x | {compile_:.2f}x |")
    write_markdown(
        os.path.join(args.out, f"conv_{where['backend']}.md"),
        [
            "# The convolutional torso: a matmul on patches against XLA's convolution",
            "",
            describe(where) + ".",
            "",
            "Each file's default Config with `--network cnn` on Breakout-MinAtar (8 seeds, a few updates), fresh",
            "processes alternating; the median over rounds of patches / lax.conv within the round. Every",
            f"measurement: `conv_{where['backend']}.jsonl`.",
            "",
            "| file | rounds | env steps/s, patches / lax.conv | compile, patches / lax.conv |",
            "|---|---|---|---|",
            *rows,
        ],
    )


if __name__ == "__main__":
    main()
