"""Rainbow's ablation: rainbow.py at its defaults, then with each component off in turn, on one environment.

    python benchmarks/bench_ablation.py                     # CartPole-v1, 8 seeds, the file's default budget
    python benchmarks/bench_ablation.py --env-name Acrobot-v1 --flags "--total-timesteps 500000"

Each row is the file's own command line (`python algorithms/rainbow.py --env-name ENV FLAGS OFF`) in a fresh
process with an empty compilation cache, as benchmarks/bench_results.py runs its rows. Final return: per
seed, the mean return of the training episodes that ended in the last 5% of updates, then mean ± std over
seeds and the lowest seed; eval: the greedy policy (the noisy layers' mean weights) after training.

Writes into --out (benchmarks/results by default), named by backend and environment:
  ablation_<backend>.jsonl        every measurement, appended
  ablation_<backend>_<env>.md     the table, from the newest measurement of each row
"""

import argparse
import json
import os
import tempfile

import numpy as np
from bench_variants import figures, returns_cell

from common import describe, machine, run_cli, write_markdown

# row: the flags that switch one component off (rainbow.py's own switches). Without noisy nets the agent
# explores epsilon-greedily as c51.py does (1 -> 0.01 over the first 30% of steps).
ABLATIONS = {
    "rainbow (all on)": "",
    "no prioritised replay": "--no-prioritized",
    "no n-step (n = 1)": "--n-step 1",
    "no dueling head": "--no-dueling",
    "no noisy nets (epsilon-greedy)": "--no-noisy --eps-start 1 --eps-end 0.01 --eps-fraction 0.3",
    "no double Q": "--no-double-dqn",
}


def measure(label: str, env: str, flags: str, seeds: int, scratch: str) -> dict:
    argv = ["--env-name", env, "--num-seeds", str(seeds), *flags.split(), *ABLATIONS[label].split()]
    with tempfile.TemporaryDirectory() as cache:  # a cold compile, as on a new machine
        result = run_cli("rainbow", argv, scratch, cache)
    return {"row": label, "env_name": env, "flags": argv, **figures(result), "machine": machine()}


def table(rows: list, env: str) -> list:
    lines = [
        f"# rainbow.py's ablation on {env} (`benchmarks/bench_ablation.py`)",
        "",
        describe(rows[0]["machine"]) + ".",
        "",
        "Each row switches one component off (its flags below); everything else is rainbow.py's defaults. Final "
        "return: per seed, the training episodes ending in the last 5% of updates, then mean ± std over seeds and "
        "the lowest seed; eval: the greedy policy after training; env steps/s: train seconds only.",
        "",
        "| row | seeds | env steps per seed | final return | eval return | seeds >= 475 (final and eval) "
        "| train s | env steps/s | flags |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        finals = np.array([np.nan if v is None else v for v in row["final_return_per_seed"]], float)
        both = ((np.nan_to_num(finals, nan=-np.inf) >= 475) & (np.array(row["eval_return_per_seed"]) >= 475)).sum()
        passed = f"{both} of {len(finals)}" if env.startswith("CartPole") else "–"
        lines.append(
            f"| {row['row']} | {len(finals)} | {row['env_steps_per_seed']:,} "
            f"| {returns_cell(row['final_return_per_seed'])} | {returns_cell(row['eval_return_per_seed'])} | {passed} "
            f"| {row['train_seconds']:.1f} | {row['steps_per_second']:,.0f} | `{ABLATIONS[row['row']]}` |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env-name", default="CartPole-v1")
    parser.add_argument("--flags", default="", help="flags every row adds (a budget, say)")
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--only", action="append", choices=sorted(ABLATIONS), help="run only these rows")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--report-only", action="store_true", help="rewrite the table from the jsonl")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    backend = machine()["backend"]
    log = os.path.join(args.out, f"ablation_{backend}.jsonl")
    if not args.report_only:
        with tempfile.TemporaryDirectory() as scratch:
            for label in args.only or ABLATIONS:
                row = measure(label, args.env_name, args.flags, args.seeds, scratch)
                print(json.dumps({k: v for k, v in row.items() if k != "machine"}), flush=True)
                with open(log, "a") as f:
                    f.write(json.dumps(row) + "\n")
    newest = {}
    for line in open(log):
        row = json.loads(line)
        if row["env_name"] == args.env_name:
            newest[row["row"]] = row
    rows = [newest[label] for label in ABLATIONS if label in newest]
    name = args.env_name.replace("/", "-")
    write_markdown(os.path.join(args.out, f"ablation_{backend}_{name}.md"), table(rows, args.env_name))


if __name__ == "__main__":
    main()
