"""Population-based training (--pbt) against a fixed grid of the same start values, at equal env steps.

    python benchmarks/bench_pbt.py                         # both tasks, 2 rounds (about 25 minutes on 2 CPU cores)
    python benchmarks/bench_pbt.py --only sac-pendulum --rounds 3

Each task is one population (seeds x learning rates spread over two orders of magnitude, most of
them deliberately poor) trained from the file's command line twice per round, in fresh processes,
alternating which goes first: as a grid (every member keeps its start values: a plain --sweep) and
with --pbt at its defaults. Both train the same env steps per member. Returns are the same every
round (a seed's run is deterministic); env steps/s is the median over rounds, and their ratio is
what PBT's exploit/explore step costs.

Writes into --out (benchmarks/results by default), named by backend:
  pbt_<backend>.jsonl        every measurement, appended
  pbt_<backend>.md           the table, from the newest measurement of each task
  pbt_<task>_<backend>.png   the PBT run's pbt.png: every member's learning rate and return
"""

import argparse
import json
import os
import shutil
import tempfile

import numpy as np

from common import describe, machine, run_cli, stats, write_markdown

START_LRS = "1e-5,3e-5,1e-4,1e-3"  # two orders of magnitude; the files' tuned values are 5e-4 (PPO) and 1e-3 (SAC)
# task: (algorithm file, the population's flags)
TASKS = {
    "ppo-breakout": (
        "ppo",
        "--env-name Breakout-MinAtar --total-timesteps 1000000 --num-envs 64 --num-steps 64 --num-minibatches 8 "
        f"--activation relu --hidden-size 256 --num-seeds 2 --sweep lr={START_LRS}",
    ),
    "sac-pendulum": ("sac", f"--env-name Pendulum-v1 --total-timesteps 32000 --num-seeds 2 --sweep lr={START_LRS}"),
}
VARIANTS = {"grid": [], "pbt": ["--pbt"]}


def figures(result: dict) -> dict:
    """The population's best and median member: final return and greedy evaluation, over members."""
    metrics, summary = result["metrics"], result["summary"]
    finals = stats.final_returns(metrics).reshape(-1)
    evals = metrics["eval_return"].reshape(-1)
    best = int(np.nanargmax(finals))
    out = {
        "members": len(finals),
        "env_steps_per_member": summary["trained_timesteps"],
        "best_final_return": float(finals[best]),
        "median_final_return": float(np.nanmedian(finals)),
        "best_eval_return": float(np.max(evals)),
        "median_eval_return": float(np.median(evals)),
        "best_member_eval_return": float(evals[best]),
        "steps_per_second": summary["steps_per_second"],
        "train_seconds": summary["train_seconds"],
        "compile_seconds": summary["compile_seconds"],
    }
    if "pbt" in summary:
        out["best_member_final_lr"] = summary["pbt"]["best_member"]["hparams"]["lr"]
        out["copies"] = summary["pbt"]["copies"]
    else:
        point = summary["sweep"][best // summary["num_seeds"]]["sweep_point"]
        out["best_member_final_lr"] = point["lr"]
    return out


def measure(task: str, rounds: int, scratch: str) -> dict:
    """Both variants of one task, `rounds` times, alternating which goes first."""
    name, flags = TASKS[task]
    runs = {variant: [] for variant in VARIANTS}
    for index in range(rounds):
        order = list(VARIANTS) if index % 2 == 0 else list(VARIANTS)[::-1]
        for variant in order:
            result = run_cli(name, flags.split() + VARIANTS[variant], scratch, os.path.join(scratch, "cache"))
            runs[variant].append(result)
            print(f"{task} round {index + 1} {variant}: {json.dumps(figures(result))}", flush=True)
    row = {"task": task, "algorithm": name, "flags": flags, "rounds": rounds}
    for variant, results in runs.items():
        row[variant] = figures(results[0])
        row[variant]["steps_per_second"] = float(np.median([r["summary"]["steps_per_second"] for r in results]))
    row["pbt_speed_ratio"] = row["pbt"]["steps_per_second"] / row["grid"]["steps_per_second"]
    row["pbt_png"] = os.path.join(runs["pbt"][0]["run_dir"], "pbt.png")
    return row


def table(rows: list, where: str) -> list:
    lines = [
        "# Population-based training against a fixed grid (`benchmarks/bench_pbt.py`)",
        "",
        where + ".",
        "",
        "Each population trains the same env steps per member twice: as a grid (each member keeps its start "
        "learning rate) and with `--pbt` at its defaults (every twentieth of the run the weakest 25% copy one of "
        "the fittest 25% and multiply the learning rate by 0.8 or 1.2). Best / median: over members. Final "
        "return: a member's training episodes ending in the last 5% of updates; eval: its greedy policy after "
        "training. env steps/s: all members together, median over rounds.",
        "",
        "| task | variant | members | env steps per member | best final | median final | best eval | median eval "
        "| best member's lr at the end | env steps/s | PBT speed / grid |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        for variant in VARIANTS:
            f = row[variant]
            ratio = f"{row['pbt_speed_ratio']:.2f}" if variant == "pbt" else ""
            lines.append(
                f"| {row['task']} | {variant} | {f['members']} | {f['env_steps_per_member']:,} | "
                f"{f['best_final_return']:.1f} | {f['median_final_return']:.1f} | {f['best_eval_return']:.1f} | "
                f"{f['median_eval_return']:.1f} | {f['best_member_final_lr']:.3g} | {f['steps_per_second']:,.0f} | "
                f"{ratio} |"
            )
    lines += ["", "Commands (each variant adds nothing, or `--pbt`):", ""]
    lines += [f"- {row['task']}: `python algorithms/{row['algorithm']}.py {row['flags']}`" for row in rows]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", choices=sorted(TASKS), help="run only these tasks")
    parser.add_argument("--rounds", type=int, default=2, help="times each variant runs (alternating order)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args()
    where = machine()
    backend = where["backend"]
    with tempfile.TemporaryDirectory() as scratch:
        rows = []
        for task in args.only or TASKS:
            row = {**measure(task, args.rounds, scratch), "machine": where}
            shutil.copy(row.pop("pbt_png"), os.path.join(args.out, f"pbt_{task}_{backend}.png"))
            with open(os.path.join(args.out, f"pbt_{backend}.jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")
            rows.append(row)
    newest = {}
    with open(os.path.join(args.out, f"pbt_{backend}.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            newest[row["task"]] = row
    write_markdown(os.path.join(args.out, f"pbt_{backend}.md"), table(list(newest.values()), describe(where)))


if __name__ == "__main__":
    main()
