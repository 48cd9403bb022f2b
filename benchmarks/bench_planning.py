"""How many env steps, and how much wall-clock, each CartPole-v1 file needs to reach 475: alphazero.py beside ppo.py
and dqn.py, each at its default (`python algorithms/<name>.py --seed S`, 8 seeds in one program), run one after the
other in one session on one machine.

    python benchmarks/bench_planning.py                 # alphazero, ppo, dqn; --seed 0
    python benchmarks/bench_planning.py --only alphazero --seed 1

A seed has reached 475 at the first update where its return, as the README's tables define it (the mean return of
its training episodes ending in the trailing 5% of updates), is at least 475; its wall-clock there is the training
time spread over the updates (compile apart). A search costs num_simulations steps of the env's own model per env
step, which the env-step count does not show and the wall-clock does.
Writes planning_<backend>.jsonl (appended) and .md (the newest measurement) into benchmarks/results.
"""

import argparse
import json
import os
import tempfile

import numpy as np

from common import ROOT, describe, machine, run_cli, seed_curves, write_markdown

TARGET = 475.0
FILES = ("alphazero", "ppo", "dqn")


def steps_to_target(run: dict) -> dict:
    """Per seed: the env steps and training seconds at the first update whose return reaches TARGET (None: never)."""
    metrics, summary = run["metrics"], run["summary"]
    curves = seed_curves(metrics)[0]  # [seeds, updates] of the one sweep point
    steps = metrics["env_steps"][0, 0]
    seconds = summary["train_seconds"] * np.arange(1, len(steps) + 1) / len(steps)
    first = [int(np.argmax(c >= TARGET)) if (c >= TARGET).any() else None for c in curves]
    return dict(
        env_steps=[None if i is None else int(steps[i]) for i in first],
        seconds=[None if i is None else float(seconds[i]) for i in first],
        final=[float(x) if x is not None else None for x in summary["final_return_per_seed"]],
        compile_seconds=summary["compile_seconds"],
        train_seconds=summary["train_seconds"],
        steps_per_second=summary["steps_per_second"],
        total_env_steps=int(steps[-1]),
    )


def median(values: list) -> str:
    reached = [v for v in values if v is not None]
    return "-" if not reached else f"{np.median(reached):,.0f}" if max(reached) > 100 else f"{np.median(reached):.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", choices=FILES, help="measure only these files (repeatable)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = parser.parse_args()
    rows = {}
    for name in args.only or FILES:
        runs = tempfile.mkdtemp(prefix=f"planning-{name}-")
        run = run_cli(name, ["--seed", args.seed], runs, os.path.join(runs, "cache"), timeout=3600)
        rows[name] = steps_to_target(run)
        print(name, json.dumps(rows[name]), flush=True)
    record = dict(machine=machine(), seed=args.seed, target=TARGET, rows=rows)
    backend = record["machine"]["backend"]
    with open(os.path.join(args.out, f"planning_{backend}.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")
    lines = ["# Env steps and wall-clock to CartPole-v1's 475", "", describe(record["machine"]) + ".", ""]
    lines += [f"Each file's default run, `--seed {args.seed}`, 8 seeds in one program, one after the other.", ""]
    lines += ["| file | seeds reaching 475 | env steps to 475 (median) | train seconds to 475 (median) |"]
    lines += ["| --- | --- | --- | --- |"]
    for name, row in rows.items():
        reached = sum(s is not None for s in row["env_steps"])
        lines.append(
            f"| {name}.py | {reached} of {len(row['env_steps'])} | {median(row['env_steps'])} | "
            f"{median(row['seconds'])} (compile {row['compile_seconds']:.0f} s, {row['steps_per_second']:,.0f} "
            f"env steps/s) |"
        )
    lines += ["", "Per seed (env steps to 475):", ""]
    lines += [f"- {name}.py: {row['env_steps']}" for name, row in rows.items()]
    write_markdown(os.path.join(args.out, f"planning_{backend}.md"), lines)


if __name__ == "__main__":
    main()
