"""An algorithm file against the file it was built from, at an equal config, side by side.

    python benchmarks/bench_variants.py                        # every pair, 2 rounds (about 20 minutes on 2 CPU cores)
    python benchmarks/bench_variants.py --only c51-cartpole --rounds 3

c51.py, qr_dqn.py and iqn.py are dqn.py with a distributional head and loss; ppo_rnd.py is ppo.py with
random network distillation; ppo_trxl.py is ppo_rnn.py with a transformer for the GRU. Each pair runs
the same flags (network, envs, batch, update ratio, budget, seeds; a `-defaults` pair only env and
seeds, each file at its own defaults) from the files' command lines in fresh processes, `rounds`
times, alternating which goes first, so that the speed ratio is taken within one time window on this
noisy host. Returns are the same every round
(a seed's run is deterministic): the table shows the first round's.

Writes into --out (benchmarks/results by default), named by backend:
  variants_<backend>.jsonl   every measurement, appended
  variants_<backend>.md      the table, from the newest measurement of each pair
"""

import argparse
import json
import os
import tempfile

import numpy as np

from common import describe, machine, run_cli, stats, write_markdown

# dqn.py's defaults written out, so that both files of a pair train the same network, batch and
# update ratio whatever their own defaults are.
DQN_FLAGS = (
    "--env-name CartPole-v1 --total-timesteps 300000 --num-envs 10 --num-steps 100 --buffer-size 10000 "
    "--batch-size 128 --learning-starts 10000 --train-frequency 10 --target-update-frequency 250 --lr 2.5e-4 "
    "--hidden-size 128 --num-layers 2 --num-seeds 8"
)
# iqn.py's CartPole defaults written out (64 units, batch 32, an annealed lr of 1e-3), for it, dqn.py and qr_dqn.py.
IQN_FLAGS = (
    "--env-name CartPole-v1 --total-timesteps 300000 --num-envs 10 --num-steps 100 --buffer-size 10000 "
    "--batch-size 32 --learning-starts 10000 --train-frequency 10 --target-update-frequency 250 --lr 1e-3 "
    "--anneal-lr --hidden-size 64 --num-layers 2 --num-seeds 8"
)
# ppo_rnd.py's defaults written out for both files (ppo.py's, but DeepSea), at the 500k steps.
PPO_FLAGS = (
    "--env-name DeepSea-bsuite --total-timesteps 500000 --num-envs 16 --num-steps 32 --update-epochs 4 "
    "--num-minibatches 4 --hidden-size 64 --num-seeds 8"
)
# ppo_trxl.py's defaults on CartPole-v1-no-velocity written out for both files (ppo_rnn.py's but the learning rate);
# ppo_trxl.py keeps its own memory_len (8 in variants_cpu.md's rows, 32 since its default env is MemoryChain-bsuite-30).
TRXL_FLAGS = (
    "--env-name CartPole-v1-no-velocity --total-timesteps 299520 --num-envs 16 --num-steps 32 --update-epochs 4 "
    "--num-minibatches 4 --lr 3e-3 --num-seeds 8"
)
# pair: (the new file, the file it was built from, the flags both run)
PAIRS = {
    "c51-cartpole": ("c51", "dqn", DQN_FLAGS),
    # Each file at its own defaults (c51.py's hidden layers are half dqn.py's): what a user sees.
    "c51-cartpole-defaults": ("c51", "dqn", "--env-name CartPole-v1 --num-seeds 8"),
    "qr_dqn-cartpole": ("qr_dqn", "dqn", DQN_FLAGS),
    # iqn.py is qr_dqn.py with sampled levels: against both, at its own network, batch and update ratio.
    "iqn-cartpole": ("iqn", "dqn", IQN_FLAGS),
    "iqn-qr_dqn-cartpole": ("iqn", "qr_dqn", IQN_FLAGS),
    # rainbow.py is c51.py with five components on: the same network, batch and update ratio at their defaults.
    "rainbow-cartpole-defaults": ("rainbow", "c51", "--env-name CartPole-v1 --num-seeds 8"),
    "ppo_rnd-deepsea": ("ppo_rnd", "ppo", PPO_FLAGS),
    # ppo_trxl.py is ppo_rnn.py with a transformer's memory in place of the GRU: the same PPO, envs, rollout and
    # width (32) at ppo_trxl.py's learning rate.
    "ppo_trxl-cartpole-nv": ("ppo_trxl", "ppo_rnn", TRXL_FLAGS),
}


def figures(result: dict) -> dict:
    """A run's returns over seeds and its speed, as the README's table reports them."""
    metrics, summary = result["metrics"], result["summary"]
    finals = stats.final_returns(metrics).reshape(-1)
    return {
        "seeds": len(finals),
        "env_steps_per_seed": summary["trained_timesteps"],
        "final_return_per_seed": [None if np.isnan(x) else float(x) for x in finals],
        "eval_return_per_seed": [float(x) for x in metrics["eval_return"].reshape(-1)],
        "steps_per_second": summary["steps_per_second"],
        "compile_seconds": summary["compile_seconds"],
        "train_seconds": summary["train_seconds"],
    }


def measure(pair: str, rounds: int, scratch: str) -> dict:
    """Both files of one pair, `rounds` times, alternating which goes first."""
    new, base, flags = PAIRS[pair]
    runs = {new: [], base: []}
    for index in range(rounds):
        for name in (new, base) if index % 2 == 0 else (base, new):
            with tempfile.TemporaryDirectory() as cache:  # a cold compile, as on a new machine
                result = run_cli(name, flags.split(), scratch, cache)
            runs[name].append(figures(result))
            print(f"{pair} round {index + 1} {name}.py: {json.dumps(runs[name][-1])}", flush=True)
    row = {"pair": pair, "new": new, "base": base, "flags": flags, "rounds": rounds}
    for name, results in runs.items():
        row[name] = {**results[0], "steps_per_second": float(np.median([r["steps_per_second"] for r in results]))}
        row[name]["steps_per_second_rounds"] = [r["steps_per_second"] for r in results]
    ratios = [n["steps_per_second"] / b["steps_per_second"] for n, b in zip(runs[new], runs[base], strict=True)]
    row["speed_ratio_rounds"] = ratios
    row["speed_ratio"] = float(np.median(ratios))
    return row


def returns_cell(values: list) -> str:
    values = np.array([np.nan if v is None else v for v in values], float)
    if np.isnan(values).all():
        return "– ± –"
    digits = 2 if np.nanmax(np.abs(values)) < 10 else 1  # DeepSea pays at most 0.99
    mean, std, low = np.nanmean(values), np.nanstd(values), np.nanmin(values)
    return f"{mean:.{digits}f} ± {std:.{digits}f} (lowest {low:.{digits}f})"


def table(rows: list, where: str) -> list:
    lines = [
        "# New files against the files they were built from (`benchmarks/bench_variants.py`)",
        "",
        where + ".",
        "",
        "Both files of a pair run the same flags (listed below) in fresh processes with a cold compile cache, "
        "alternating which goes first. Final return: per seed, the training episodes ending in the last 5% of "
        "updates, then mean ± std over seeds and the lowest seed; eval: the greedy policy after training, over "
        "seeds. env steps/s: train seconds only (compile apart), median over rounds; speed ratio: new / base within "
        "each round, then the median.",
        "",
        "| pair | file | seeds | env steps per seed | final return | eval return | compile s | env steps/s "
        "| speed / base (per round) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        for name in (row["new"], row["base"]):
            f = row[name]
            ratio = ""
            if name == row["new"]:
                ratio = f"{row['speed_ratio']:.2f} ({', '.join(f'{r:.2f}' for r in row['speed_ratio_rounds'])})"
            lines.append(
                f"| {row['pair']} | {name}.py | {f['seeds']} | {f['env_steps_per_seed']:,} | "
                f"{returns_cell(f['final_return_per_seed'])} | {returns_cell(f['eval_return_per_seed'])} | "
                f"{f['compile_seconds']:.1f} | {f['steps_per_second']:,.0f} | {ratio} |"
            )
    lines += ["", "Flags (both files of a pair):", ""]
    lines += [f"- {row['pair']}: `{row['flags']}`" for row in rows]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", choices=sorted(PAIRS), help="run only these pairs")
    parser.add_argument("--rounds", type=int, default=2, help="times each file runs (alternating order)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--report-only", action="store_true", help="rewrite the table from the jsonl")
    args = parser.parse_args()
    where = machine()
    jsonl = os.path.join(args.out, f"variants_{where['backend']}.jsonl")
    with tempfile.TemporaryDirectory() as scratch:
        for pair in [] if args.report_only else args.only or PAIRS:
            row = {**measure(pair, args.rounds, scratch), "machine": where}
            with open(jsonl, "a") as f:
                f.write(json.dumps(row) + "\n")
    newest = {}
    with open(jsonl) as f:
        for line in f:
            row = json.loads(line)
            newest[row["pair"]] = row
    rows = [newest[pair] for pair in PAIRS if pair in newest]
    where_measured = describe(rows[-1]["machine"])  # the newest row's machine (--report-only runs anywhere)
    write_markdown(os.path.join(args.out, f"variants_{where['backend']}.md"), table(rows, where_measured))


if __name__ == "__main__":
    main()
