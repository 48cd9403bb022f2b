"""Runs every algorithm file on its environments and writes the results table and learning curves.

    python benchmarks/bench_results.py                        # every row of RUNS (tens of minutes on 2 CPU cores)
    python benchmarks/bench_results.py --only pqn --only dqn:Acrobot-v1
    python benchmarks/bench_results.py --seeds 2 --scale 0.05 --out /tmp/smoke   # a quick smoke run

Each row is the algorithm's own command line (`python algorithms/<name>.py --env-name ENV ...`)
in a fresh process with an empty compilation cache, so "compile s" is a cold compile and
"train s" the jitted training alone (the command line reports progress between chunks of it).
Final return: per seed, the mean return of the training episodes that ended in the last 5% of
updates, then mean ± std over seeds; eval: the greedy (deterministic) policy after training.

Writes into --out (benchmarks/results by default), named by backend:
  results_<backend>.jsonl  every measurement, appended (with per-update mean learning curves)
  results_<backend>.md     the table, from the newest measurement of each row
  results_<backend>.png    learning curves against env steps and against wall-clock seconds
"""

import argparse
import json
import os
import tempfile

import numpy as np

from common import ROOT, algorithm_path, describe, machine, run_cli, seed_curves, write_markdown

# (algorithm file, environment, flags beyond the file's defaults). The budget is the file's default
# unless the flags set one; seeds come from --seeds unless the flags set them. A row is known by its
# algorithm, environment and variant flags (VARIANT_FLAGS: PPO and DPO side by side, ...).
PPO_MINATAR = (  # PureJAXRL's MinAtar config (64 envs x 64 steps, 8 minibatches, lr 5e-4, relu), 256 hidden units
    "--total-timesteps 1000000 --num-envs 64 --num-steps 64 --num-minibatches 8 --lr 5e-4 --activation relu "
    "--hidden-size 256 --num-seeds 4"
)
RUNS = [
    ("ppo", "CartPole-v1", ""),
    ("ppo", "CartPole-v1", "--objective dpo"),
    ("dqn", "CartPole-v1", ""),
    ("pqn", "CartPole-v1", ""),
    ("c51", "CartPole-v1", ""),
    ("qr_dqn", "CartPole-v1", ""),
    ("iqn", "CartPole-v1", ""),
    ("rainbow", "CartPole-v1", ""),
    ("ppo", "Acrobot-v1", "--total-timesteps 300000"),
    ("dqn", "Acrobot-v1", "--total-timesteps 300000"),
    ("pqn", "Acrobot-v1", "--total-timesteps 300000"),
    # CleanRL's c51_jax.py budget on Acrobot (its published -86.7 ± 2.2 over 3 seeds).
    # dqn.py's target interval and learning rate (c51.py's defaults until 2026-11-25); at c51.py's own
    # (CartPole's) it reached -88.4 ± 3.5.
    ("c51", "Acrobot-v1", "--total-timesteps 500000 --target-update-frequency 250 --lr 2.5e-4"),
    # The paper's kappa 1: at the default 100 (for CartPole's larger values) it reached -88.4 ± 1.8.
    ("qr_dqn", "Acrobot-v1", "--total-timesteps 500000 --kappa 1"),
    ("iqn", "Acrobot-v1", "--total-timesteps 500000"),
    ("rainbow", "Acrobot-v1", "--total-timesteps 500000"),
    # CleanRL's dqn_jax.py budget on MountainCar (its published -188.9): epsilon-greedy rarely finds the goal.
    ("dqn", "MountainCar-v0", "--total-timesteps 500000 --num-seeds 4"),
    ("iqn", "MountainCar-v0", "--total-timesteps 500000 --num-seeds 4"),
    # Noisy nets explore by their own noise after epsilon's first 10%.
    ("rainbow", "MountainCar-v0", "--total-timesteps 500000 --num-seeds 4"),
    # The four MinAtar games of gymnax-blines' PPO marks, the MLP and the convolutional torso at equal steps and flags.
    *[
        ("ppo", f"{game}-MinAtar", PPO_MINATAR + network)
        for game in ("Asterix", "Breakout", "Freeway", "SpaceInvaders")
        for network in ("", " --network cnn")
    ],
    (
        "dqn",
        "Breakout-MinAtar",
        "--total-timesteps 1000000 --buffer-size 100000 --learning-starts 10000 --lr 1e-4 --hidden-size 256 "
        "--target-update-frequency 1000 --num-seeds 4",
    ),
    # dqn.py's row; C51's atoms in the paper's Atari range (rewards of 1 per brick, discounted values near 10).
    (
        "c51",
        "Breakout-MinAtar",
        "--total-timesteps 1000000 --buffer-size 100000 --learning-starts 10000 --lr 1e-4 --hidden-size 256 "
        "--target-update-frequency 1000 --v-min -10 --v-max 10 --num-seeds 4",
    ),
    (
        "qr_dqn",
        "Breakout-MinAtar",
        "--total-timesteps 1000000 --buffer-size 100000 --learning-starts 10000 --lr 1e-4 --hidden-size 256 "
        "--target-update-frequency 1000 --num-seeds 4",
    ),
    (
        "iqn",
        "Breakout-MinAtar",
        "--total-timesteps 1000000 --buffer-size 100000 --learning-starts 10000 --lr 1e-4 --hidden-size 256 "
        "--target-update-frequency 1000 --num-seeds 4",
    ),
    (
        "rainbow",
        "Breakout-MinAtar",
        "--total-timesteps 1000000 --buffer-size 100000 --learning-starts 10000 --lr 1e-4 --hidden-size 256 "
        "--target-update-frequency 1000 --v-min -10 --v-max 10 --num-seeds 4",
    ),
    (
        "pqn",
        "Breakout-MinAtar",
        "--total-timesteps 1000000 --num-envs 64 --num-steps 32 --lr 2.5e-4 --hidden-size 256 --num-seeds 4",
    ),
    ("ppo_continuous", "Pendulum-v1", ""),
    ("ppo_continuous", "Pendulum-v1", "--objective dpo"),
    ("ppo_continuous", "MountainCarContinuous-v0", ""),
    ("sac", "Pendulum-v1", ""),
    ("td3", "Pendulum-v1", ""),
    ("sac", "MountainCarContinuous-v0", "--total-timesteps 50000"),
    ("td3", "MountainCarContinuous-v0", "--total-timesteps 50000"),
    # Wide exploration noise finds the goal; 500-step rollouts let the last update end 999-step episodes.
    (
        "td3",
        "MountainCarContinuous-v0",
        "--total-timesteps 50000 --num-envs 10 --num-steps 500 --exploration-noise 1.0",
    ),
    ("ppo_rnd", "DeepSea-bsuite", ""),
    # Sparse reward: the goal pays nothing more than ending -1 a step; RND's bonus must outweigh those -1s.
    (
        "ppo_rnd",
        "MountainCar-v0",
        "--num-steps 128 --total-timesteps 499712 --lr 1e-3 --normalize-obs --int-coef 100 --ext-coef 1",
    ),
    ("ppo_rnn", "CartPole-v1-no-velocity", ""),
    ("ppo_rnn", "MemoryChain-bsuite", ""),
    # ppo_trxl.py's default (a memory of 32 steps: the whole 31-step episode), and its earlier default env.
    ("ppo_trxl", "MemoryChain-bsuite-30", ""),
    ("ppo_trxl", "CartPole-v1-no-velocity", "--memory-len 8"),
    # One bit held for 60 steps (MEMORY_ENVS): the GRU at its defaults loses it on some seeds; the transformer's
    # memory of 64 steps sees it directly (with 3 layers, its default, one seed of 8 never learned it).
    ("ppo_rnn", "MemoryChain-bsuite-60", ""),
    ("ppo_trxl", "MemoryChain-bsuite-60", "--memory-len 64 --num-layers 2"),
    # Suites beyond gymnax (pip install -r requirements-envs.txt); tests/test_suites.py's learning
    # tests run the cheapest of them.
    ("ppo", "xminigrid/MiniGrid-DoorKey-5x5", "--total-timesteps 500000 --ent-coef 0.03"),
    ("ppo_rnn", "xminigrid/MiniGrid-DoorKey-5x5", "--total-timesteps 500000 --hidden-size 64 --lr 1e-3 --ent-coef 0.1"),
    (
        "ppo_continuous",
        "brax/inverted_pendulum",
        "--total-timesteps 300000 --num-envs 128 --num-steps 32 --num-seeds 4",
    ),
    # 250 steps per update: 1,000-step episodes end at update boundaries, so the last 5% holds ends.
    ("sac", "brax/inverted_pendulum", "--total-timesteps 60000 --num-steps 250 --num-seeds 4"),
    ("td3", "brax/inverted_pendulum", "--total-timesteps 60000 --num-steps 250 --num-seeds 4"),
    # PureJAXRL's ppo_continuous_action.py config (benchmarks/bench_brax.py), as long as ~15 minutes allow here.
    (
        "ppo_continuous",
        "brax/hopper:positional",
        "--total-timesteps 10000000 --num-envs 2048 --num-steps 10 --num-minibatches 32 --lr 3e-4 --no-anneal-lr "
        "--gamma 0.99 --ent-coef 0 --hidden-size 256 --num-seeds 2",
    ),
    (
        "ppo",
        "craftax/Craftax-Classic-Symbolic-v1",
        "--total-timesteps 1000000 --num-envs 64 --num-steps 64 --num-minibatches 8 --hidden-size 256 --lr 5e-4 "
        "--num-seeds 4",
    ),
    (
        "ppo_rnd",
        "craftax/Craftax-Classic-Symbolic-v1",
        "--total-timesteps 1000000 --num-envs 64 --num-steps 64 --num-minibatches 8 --hidden-size 256 --lr 5e-4 "
        "--num-seeds 4",
    ),
    # The memory files at ppo.py's Craftax flags (the transformer 128 wide, 4 heads, within this CPU's time).
    (
        "ppo_rnn",
        "craftax/Craftax-Classic-Symbolic-v1",
        "--total-timesteps 1000000 --num-envs 64 --num-steps 64 --num-minibatches 8 --hidden-size 256 --lr 5e-4 "
        "--num-seeds 4",
    ),
    (
        "ppo_trxl",
        "craftax/Craftax-Classic-Symbolic-v1",
        "--total-timesteps 1000000 --num-envs 64 --num-steps 64 --num-minibatches 8 --embed-size 128 --num-heads 4 "
        "--lr 5e-4 --num-seeds 4",
    ),
    (
        "pqn",
        "craftax/Craftax-Classic-Symbolic-v1",
        "--total-timesteps 1000000 --num-envs 64 --num-steps 32 --hidden-size 256 --lr 2.5e-4 --eps-start 0.1 "
        "--eps-end 0.005 --reward-scale 1.0 --num-seeds 4",
    ),
]


# Flags that make a row a variant of the same algorithm on the same env (shown in its label).
VARIANT_FLAGS = ("--objective", "--exploration-noise", "--network")


def row_key(name: str, env: str, flags) -> tuple:
    """What tells rows apart: algorithm, environment and the variant flags' values."""
    flags = flags.split() if isinstance(flags, str) else list(flags)
    variant = tuple(flags[flags.index(f) + 1] if f in flags else "" for f in VARIANT_FLAGS)
    return name, env, variant


def row_label(key: tuple) -> str:
    name, _, variant = key
    objective, *others = variant
    parts = [objective] if objective else []
    parts += [f"{flag[2:]} {value}" for flag, value in zip(VARIANT_FLAGS[1:], others, strict=True) if value]
    return f"{name}.py" + (f" ({', '.join(parts)})" if parts else "")


def measure(name: str, env: str, flags: str, seeds: int, scale: float, runs_dir: str, timeout: int) -> dict:
    flags = ["--env-name", env, *flags.split()]
    if "--num-seeds" not in flags:
        flags += ["--num-seeds", str(seeds)]
    if scale != 1.0:  # a smoke run: the same row at a fraction of its budget
        module_default = _default(name, "total_timesteps")
        budget = int(flags[flags.index("--total-timesteps") + 1]) if "--total-timesteps" in flags else module_default
        flags = _without(flags, "--total-timesteps") + ["--total-timesteps", str(max(1, int(budget * scale)))]
    with tempfile.TemporaryDirectory() as cache:
        result = run_cli(name, flags, runs_dir, cache, timeout)
    summary, metrics = result["summary"], result["metrics"]
    # Mean over seeds of each seed's own return (the run directory's curve; no sweep: one point).
    with np.errstate(all="ignore"):
        curve = _nanmean_rows(seed_curves(metrics)[0])
    every = max(1, len(curve) // 200)  # at most ~200 points of curve per row in the jsonl
    return {
        "algorithm": name,
        "env_name": env,
        "flags": flags,
        "num_seeds": summary["num_seeds"],
        "total_timesteps": summary["trained_timesteps"],
        "final_return_mean": summary["final_return_mean"],
        "final_return_std": summary["final_return_std"],
        "final_return_per_seed": summary["final_return_per_seed"],
        "eval_return_mean": summary["eval_return_mean"],
        "compile_seconds": summary["compile_seconds"],
        "train_seconds": summary["train_seconds"],
        "steps_per_second": summary["steps_per_second"],
        "exit_code": result["exit_code"],
        "curve": {
            "env_steps": metrics["env_steps"][0, 0, ::every].tolist(),
            "wall_seconds": metrics["wall_seconds"][::every].tolist(),
            "return_mean": [None if np.isnan(x) else float(x) for x in curve[::every]],
        },
        "machine": machine(),
    }


def _default(name: str, field: str):
    import ast

    tree = ast.parse(open(algorithm_path(name)).read())
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == field:
            return ast.literal_eval(node.value)  # field: Annotated[int, "doc"] = DEFAULT
    raise KeyError(field)


def _without(flags: list, flag: str) -> list:
    if flag not in flags:
        return flags
    i = flags.index(flag)
    return flags[:i] + flags[i + 2 :]


def _nanmean_rows(x: np.ndarray) -> np.ndarray:
    counts = (~np.isnan(x)).sum(0)
    return np.where(counts > 0, np.nansum(x, 0) / np.maximum(counts, 1), np.nan)


def _fmt(x) -> str:
    return "–" if x is None else f"{x:.1f}"


def _smooth(y: np.ndarray, window: int = 10) -> np.ndarray:
    """Moving average that skips NaN (updates in which no episode ended)."""
    valid = ~np.isnan(y)
    kernel = np.ones(min(window, len(y)))  # np.convolve's "same" is as long as the longer input
    total = np.convolve(np.where(valid, y, 0.0), kernel, "same")
    count = np.convolve(valid.astype(float), kernel, "same")
    return np.where(count > 0, total / np.maximum(count, 1), np.nan)


def write_table(records: list, path: str) -> None:
    latest = {}
    for r in records:  # the newest measurement of each row, in RUNS order
        latest[row_key(r["algorithm"], r["env_name"], r["flags"])] = r
    order = {row_key(*run): i for i, run in enumerate(RUNS)}
    rows = sorted(
        latest.values(), key=lambda r: order.get(row_key(r["algorithm"], r["env_name"], r["flags"]), len(order))
    )
    lines = [
        "# Results: every algorithm on its environments",
        "",
        describe(rows[-1]["machine"]) + ". Written by `benchmarks/bench_results.py`; each row is the algorithm's "
        "command line in a fresh process with an empty compile cache, its newest measurement (dated per row).",
        "",
        "Final return: per seed, the mean return of training episodes ending in the last 5% of updates; "
        "mean ± std over seeds. Eval: greedy policy after training, mean over seeds. Steps/s: env steps of all "
        "seeds per second of training (compile excluded).",
        "",
        "| env | algorithm | seeds | env steps per seed | final return | eval return | compile s | train s | "
        "env steps/s | measured | non-default flags |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        extra = " ".join(f for f in _without(_without(r["flags"], "--env-name"), "--num-seeds"))
        label = row_label(row_key(r["algorithm"], r["env_name"], r["flags"]))
        lines.append(
            f"| {r['env_name']} | {label} | {r['num_seeds']} | {r['total_timesteps']:,} | "
            f"{_fmt(r['final_return_mean'])} ± {_fmt(r['final_return_std'])} | {_fmt(r['eval_return_mean'])} | "
            f"{r['compile_seconds']:.1f} | {r['train_seconds']:.1f} | {r['steps_per_second']:,.0f} | "
            f"{r['machine']['date']} | "
            f"{'`' + extra + '`' if extra else ''} |"
        )
    write_markdown(path, lines)


def plot(records: list, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    latest = {}
    for r in records:
        latest[row_key(r["algorithm"], r["env_name"], r["flags"])] = r
    envs = list(dict.fromkeys(env for _, env, _ in RUNS if any(k[1] == env for k in latest)))
    variants = list(dict.fromkeys(row_label(row_key(*run)) for run in RUNS))
    colors = {label: f"C{i}" for i, label in enumerate(variants)}  # one colour per algorithm in every panel
    fig, axes = plt.subplots(2, len(envs), figsize=(3.6 * len(envs), 6.4), squeeze=False)
    for column, env in enumerate(envs):
        for key, r in latest.items():
            if key[1] != env:
                continue
            label = row_label(key)
            curve = r["curve"]
            y = _smooth(np.array([np.nan if v is None else v for v in curve["return_mean"]]))
            style = dict(label=f"{label} ({r['num_seeds']} seeds)", color=colors.get(label, "k"))
            axes[0, column].plot(curve["env_steps"], y, **style)
            # Wall-clock from the start of the process's compile: compile, then training.
            axes[1, column].plot(r["compile_seconds"] + np.array(curve["wall_seconds"]), y, **style)
        axes[1, column].set_xlim(left=0)
        axes[0, column].set_title(env, fontsize="medium")
        axes[0, column].set_xlabel("env steps per seed")
        axes[1, column].set_xlabel("seconds (compile + train)")
        for ax in axes[:, column]:
            ax.grid(alpha=0.3)
            ax.legend(fontsize="x-small", loc="best")
    axes[0, 0].set_ylabel("mean episode return")
    axes[1, 0].set_ylabel("mean episode return")
    where = next(iter(latest.values()))["machine"]
    fig.suptitle(
        "mean over seeds of each seed's return (its episodes ending in the last 5% of updates), "
        "moving average of 10 points; "
        f"{where['backend']} ({where['device']}), {where['cpu_cores']} CPU cores, "
        f"jax {where['versions'].get('jax')}",
        fontsize="small",
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="ALGO[:ENV]",
        help="run only these rows (repeatable); the table still shows earlier measurements",
    )
    parser.add_argument("--seeds", type=int, default=8, help="seeds per row unless the row sets --num-seeds")
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of each row's budget (smoke runs)")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    parser.add_argument("--report-only", action="store_true", help="rewrite table and figure from the jsonl")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds a row may run (rainbow.py's Breakout: more)")
    args = parser.parse_args()

    import jax

    backend = jax.default_backend()
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, f"results_{backend}")
    selected = [(n, e, f) for n, e, f in RUNS if not args.only or any(s in (n, f"{n}:{e}") for s in args.only)]
    if not args.report_only:
        if not selected:
            parser.error(f"--only matched no row; rows are: {', '.join(f'{n}:{e}' for n, e, _ in RUNS)}")
        with tempfile.TemporaryDirectory() as runs_dir:
            for name, env, flags in selected:
                if not os.path.exists(algorithm_path(name)):
                    print(f"skip {name}:{env} (no algorithms/{name}.py)", flush=True)
                    continue
                record = measure(name, env, flags, args.seeds, args.scale, runs_dir, args.timeout)
                with open(base + ".jsonl", "a") as f:
                    f.write(json.dumps(record) + "\n")
                print(
                    f"{name:15s} {env:26s} final {_fmt(record['final_return_mean'])} ± "
                    f"{_fmt(record['final_return_std'])}  eval {_fmt(record['eval_return_mean'])}  "
                    f"compile {record['compile_seconds']:.1f} s  "
                    f"train {record['train_seconds']:.1f} s  {record['steps_per_second']:,.0f} steps/s",
                    flush=True,
                )
    with open(base + ".jsonl") as f:
        records = [json.loads(line) for line in f if line.strip()]
    write_table(records, base + ".md")
    plot(records, base + ".png")


if __name__ == "__main__":
    main()
