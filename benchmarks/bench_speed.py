"""Measures the speed of algorithms/ppo.py or dqn.py on CartPole-v1, side by side with PureJAXRL.

    python benchmarks/bench_speed.py ppo                # our figures only
    python benchmarks/bench_speed.py ppo --purejaxrl /path/to/purejaxrl --rounds 3
                                                        # side by side with PureJAXRL's ppo.py
    python benchmarks/bench_speed.py dqn --purejaxrl /path/to/purejaxrl --peer-python /venv/bin/python
                                                        # PureJAXRL's dqn.py needs flashbax

What it measures, each in a fresh process (so every compile is cold unless stated):
  1. The command line with its defaults, twice, sharing one new compilation cache: compile
     seconds cold and warm, train seconds, final return of every seed, and the wall-clock
     until all seeds have reached return 475 (compile + the share of training it took).
  2. Throughput at PureJAXRL's CartPole hyperparameters for each seed count, three ways:
     - `jit`: one `jax.jit(jax.vmap(train))` call on one device, timed like
       benchmarks/peers/purejaxrl_driver.py times PureJAXRL (`make_train` before the clock, as the
       driver does; compile_s = lower + compile, steps/s = env steps of all seeds / run seconds),
       under the command line's XLA flags (the older CPU scheduler, optimisation level 1);
     - `jit, XLA defaults`: the same under JAX's own XLA flags (the concurrency-optimised
       scheduler, which has deadlocked vmapped PPO here, and optimisation level 3);
     - `command line`: `python algorithms/<algo>.py` with those hyperparameters, as a user runs
       it; on a CPU-only install it spreads the seeds over one XLA device per core.
     With --purejaxrl PATH (the root of a PureJAXRL checkout), PureJAXRL's own file runs in the
     same round through benchmarks/peers/purejaxrl_driver.py, under both flag settings (the order
     alternates between rounds), and each ratio is taken within its round. Timings on a shared
     machine vary: compare only inside one run of this script.
Results: benchmarks/results/<algo>_<backend>.md and a .jsonl of every measurement.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from common import ROOT, describe, load_algorithm, machine, run_cli, run_result, stats, write_markdown, xla

PEER_DRIVER = os.path.join(ROOT, "benchmarks", "peers", "purejaxrl_driver.py")
# PureJAXRL's CartPole configs (the dicts at the bottom of its ppo.py and dqn.py), in our field names.
PUREJAXRL_CONFIG = {
    "ppo": dict(
        num_envs=4,
        num_steps=128,
        update_epochs=4,
        num_minibatches=4,
        lr=2.5e-4,
        anneal_lr=True,
        gamma=0.99,
        gae_lambda=0.95,
        clip_eps=0.2,
        ent_coef=0.01,
        vf_coef=0.5,
        max_grad_norm=0.5,
        activation="tanh",
        hidden_size=64,
        num_layers=2,
        total_timesteps=500_000,
    ),
    # PureJAXRL's dqn.py clips no gradients; our clip at norm 1000 never binds on CartPole. Its
    # Q-network is 120-84 wide; ours has layers of one width, so 120-120: more arithmetic for us.
    "dqn": dict(
        num_envs=10,
        buffer_size=10_000,
        batch_size=128,
        learning_starts=10_000,
        train_frequency=10,
        target_update_frequency=500,
        tau=1.0,
        lr=2.5e-4,
        anneal_lr=False,
        gamma=0.99,
        eps_start=1.0,
        eps_end=0.05,
        eps_fraction=0.5,
        double_dqn=False,
        loss="mse",
        activation="relu",
        hidden_size=120,
        num_layers=2,
        total_timesteps=500_000,
    ),
}
PRESET_TEXT = {
    "ppo": "4 envs x 128 steps, 4 x 4 minibatches, 5e5 steps",
    "dqn": "10 envs, buffer 10k, batch 128, train every 10 and target every 500 env steps, 5e5 steps",
}
THRESHOLD = 475.0
# JAX's own XLA flags for the CPU, spelled out so that neither side's set-up adds its own.
XLA_DEFAULTS = "--xla_cpu_enable_concurrency_optimized_scheduler=true --xla_backend_optimization_level=3"


def worker(algorithm: str, seeds: int, preset: str) -> None:
    """Times our train as one jitted call on one device, as the peer driver times PureJAXRL's."""
    module = load_algorithm(algorithm)
    xla.configure()  # the XLA flags the command line sets, before any JAX computation
    import jax
    import numpy as np

    config = module.Config(**(PUREJAXRL_CONFIG[algorithm] if preset == "purejaxrl" else {}), num_seeds=seeds)
    keys = jax.random.split(jax.random.PRNGKey(0), seeds)
    made = time.perf_counter()
    train = module.make_train(config)  # gymnax's import and the env: before the clock, as for PureJAXRL
    start = time.perf_counter()
    lowered = jax.jit(jax.vmap(train)).lower(keys)
    compiled = lowered.compile()
    compiled_at = time.perf_counter()
    _, metrics = jax.block_until_ready(compiled(keys))
    run_s = time.perf_counter() - compiled_at
    metrics = {k: np.asarray(v) for k, v in metrics.items()}
    steps = int(metrics["env_steps"][0, -1])
    print(
        "RESULT "
        + json.dumps(
            {
                "bench": f"ours_{algorithm}",
                "num_seeds": seeds,
                "make_train_s": start - made,
                "compile_s": compiled_at - start,
                "run_s": run_s,
                "steps_per_s": steps * seeds / run_s,
                "final_return_mean": float(np.mean(stats.final_returns(metrics))),
                "xla_flags": os.environ.get("XLA_FLAGS", ""),
            }
        ),
        flush=True,
    )


def preset_flags(algorithm: str, seeds: int) -> list:
    flags = []
    for name, value in PUREJAXRL_CONFIG[algorithm].items():
        flag = "--" + name.replace("_", "-")
        flags += [flag if value else "--no-" + flag[2:]] if isinstance(value, bool) else [flag, value]
    return flags + ["--num-seeds", seeds, "--eval-episodes", 1]


def cli_result(algorithm: str, flags: list, cache_dir: str, runs_dir: str) -> dict:
    """One command-line run in a fresh process; returns its summary plus time-to-threshold."""
    import numpy as np

    result = run_cli(algorithm, flags, runs_dir, cache_dir, timeout=900)
    summary = result["summary"]
    returns = np.nan_to_num(result["metrics"]["episode_return"][0], nan=-np.inf)  # [seeds, updates]
    reached = np.maximum.accumulate(returns >= THRESHOLD, axis=1).all(axis=0)
    fraction = (int(np.argmax(reached)) + 1) / returns.shape[1] if reached.any() else None
    return {
        **summary,
        "process_wall_s": result["process_wall_s"],
        "threshold_fraction_of_training": fraction,
        "seconds_to_threshold": None
        if fraction is None
        else summary["compile_seconds"] + fraction * summary["train_seconds"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("algorithm", choices=sorted(PUREJAXRL_CONFIG))
    parser.add_argument("--worker", action="store_true", help="internal: time one jitted call and print RESULT")
    parser.add_argument("--seeds", type=int, default=1, help="worker: vmapped seeds")
    parser.add_argument(
        "--preset",
        default="purejaxrl",
        choices=["purejaxrl", "defaults"],
        help="worker: PureJAXRL's CartPole hyperparameters or the file's defaults",
    )
    parser.add_argument("--seed-counts", default="1,8", help="throughput at these seed counts")
    parser.add_argument("--rounds", type=int, default=2, help="repetitions of the throughput comparison")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    parser.add_argument(
        "--purejaxrl", metavar="PATH", help="root of a PureJAXRL checkout: time its own file in every round as well"
    )
    parser.add_argument(
        "--peer-python",
        default=sys.executable,
        help="interpreter for benchmarks/peers/purejaxrl_driver.py (dqn needs one with flashbax)",
    )
    args = parser.parse_args()
    algorithm = args.algorithm
    if args.worker:
        return worker(algorithm, args.seeds, args.preset)
    purejaxrl = args.purejaxrl and os.path.abspath(args.purejaxrl)
    if purejaxrl and not os.path.isfile(os.path.join(purejaxrl, "purejaxrl", f"{algorithm}.py")):
        parser.error(f"--purejaxrl: no purejaxrl/{algorithm}.py under {purejaxrl}")
    if purejaxrl and algorithm == "dqn":
        check = subprocess.run([args.peer_python, "-c", "import flashbax"], capture_output=True, timeout=120)
        if check.returncode:
            parser.error(
                f"PureJAXRL's dqn.py needs flashbax, which {args.peer_python} cannot import "
                "(pip install flashbax, or pass --peer-python)"
            )

    import jax

    backend = jax.default_backend()
    os.makedirs(args.out, exist_ok=True)
    raw_path = os.path.join(args.out, f"{algorithm}_{backend}.jsonl")
    records = []

    def record(kind: str, result: dict) -> None:
        result = {"kind": kind, "unix_time": time.time(), **result}
        records.append(result)
        with open(raw_path, "a") as f:
            f.write(json.dumps(result) + "\n")

    me = [sys.executable, os.path.abspath(__file__), algorithm, "--worker"]
    with tempfile.TemporaryDirectory() as tmp:
        cache, runs = os.path.join(tmp, "cache"), os.path.join(tmp, "runs")
        for attempt in ("cold", "warm"):
            result = cli_result(algorithm, [], cache, runs)
            record(f"cli_defaults_{attempt}", result)
            finals = [round(x) for x in result["final_return_per_seed"]]
            print(
                f"defaults ({attempt} cache): compile {result['compile_seconds']:.1f} s, train "
                f"{result['train_seconds']:.1f} s, final returns {finals}",
                flush=True,
            )

        # The command line runs the updates in ~10 chunks to report progress, over one device per
        # core; one jitted call of the whole run on one device shows what both together change.
        result = run_result([*me, "--preset", "defaults", "--seeds", str(records[0]["num_seeds"])])
        if result:
            record("monolithic_defaults", result)
            print(f"defaults as one jitted call on one device: {result['steps_per_s']:,.0f} steps/s", flush=True)

        for round_index in range(args.rounds):
            for seeds in map(int, args.seed_counts.split(",")):
                jit = [*me, "--seeds", str(seeds)]
                # XLA's concurrency-optimised scheduler has deadlocked vmapped PPO here: a short timeout.
                defaults = {**os.environ, "XLA_FLAGS": XLA_DEFAULTS}
                jobs = [
                    ("jit", lambda: run_result(jit)),
                    ("jit_xla_defaults", lambda: run_result(jit, defaults, timeout=300)),
                    ("cli", lambda: cli_run(algorithm, seeds, os.path.join(tmp, f"cache{round_index}-{seeds}"), runs)),
                ]
                if purejaxrl:
                    peer = [args.peer_python, PEER_DRIVER, algorithm, "--purejaxrl", purejaxrl, "--seeds", str(seeds)]
                    jobs.append(("purejaxrl", lambda: run_result(peer)))
                    jobs.append(("purejaxrl_xla_defaults", lambda: run_result(peer, defaults, timeout=300)))
                if round_index % 2:
                    jobs.reverse()
                for name, job in jobs:
                    result = job()
                    if result:
                        record(f"throughput_{name}", {**result, "round": round_index, "seeds": seeds})
                        print(
                            f"round {round_index + 1} {name:18s} {seeds:3d} seeds: compile "
                            f"{result['compile_s']:.1f} s, {result['steps_per_s']:,.0f} steps/s, "
                            f"final {result['final_return_mean']:.0f}",
                            flush=True,
                        )
    write_table(algorithm, records, os.path.join(args.out, f"{algorithm}_{backend}.md"))


def cli_run(algorithm: str, seeds: int, cache_dir: str, runs_dir: str) -> dict:
    """The command line at PureJAXRL's hyperparameters, cold cache, in the worker's result format."""
    summary = run_cli(algorithm, preset_flags(algorithm, seeds), runs_dir, cache_dir, timeout=900)["summary"]
    return {
        "bench": f"cli_{algorithm}",
        "num_seeds": seeds,
        "compile_s": summary["compile_seconds"],
        "run_s": summary["train_seconds"],
        "steps_per_s": summary["steps_per_second"],
        "final_return_mean": summary["final_return_mean"],
        "devices": len(summary["devices"]),
    }


# (job, label, the PureJAXRL job it is compared with)
JOBS = (
    ("jit", "ours, one jit call", "purejaxrl"),
    ("jit_xla_defaults", "ours, one jit call, XLA defaults", "purejaxrl_xla_defaults"),
    ("cli", "ours, command line", "purejaxrl"),
)
PEERS = (("purejaxrl", "PureJAXRL"), ("purejaxrl_xla_defaults", "PureJAXRL, XLA defaults"))


def throughput_table(algorithm: str, records: list) -> list:
    """Compile seconds and env steps/s of each job per seed count (medians over rounds), and each of
    ours against PureJAXRL under the same XLA flags (ratios within a round, then their median)."""
    fmt = lambda x, f: "–" if x is None else format(x, f)  # noqa: E731
    med = lambda rs, k: statistics.median(r[k] for r in rs) if rs else None  # noqa: E731
    columns = [(job, label) for job, label, _ in JOBS] + list(PEERS)
    lines = [
        "",
        f"## PureJAXRL's CartPole hyperparameters ({PRESET_TEXT[algorithm]})",
        "",
        "Medians over rounds; each ratio is taken within a round, against PureJAXRL under the same XLA flags. "
        "`one jit call`: `jax.jit(jax.vmap(train))` on one device, timed as PureJAXRL is timed (`make_train` "
        "before the clock), under the command line's XLA flags (older CPU scheduler, optimisation level 1). "
        "`XLA defaults`: the same under JAX's own flags (the concurrency-optimised scheduler, which has "
        "deadlocked vmapped PPO here, and optimisation level 3; – where no round finished within 300 s). "
        "`command line`: "
        f"`python algorithms/{algorithm}.py` with these hyperparameters (train seconds, one device per core).",
        "",
        "| seeds | "
        + " | ".join(f"{label} compile s | {label} steps/s" for _, label in columns)
        + " | "
        + " | ".join(f"{label}: steps/s ratio | compile ratio" for _, label, _ in JOBS)
        + " |",
        "|---" * (1 + 2 * len(columns) + 2 * len(JOBS)) + "|",
    ]
    for seeds in sorted({r["seeds"] for r in records if r["kind"].startswith("throughput")}):
        runs = {
            job: [r for r in records if r["kind"] == f"throughput_{job}" and r["seeds"] == seeds] for job, _ in columns
        }
        cells = [
            f"{fmt(med(runs[j], 'compile_s'), '.2f')} | {fmt(med(runs[j], 'steps_per_s'), ',.0f')}" for j, _ in columns
        ]
        for job, _, peer in JOBS:
            pairs = [(o, t) for o in runs[job] for t in runs[peer] if o["round"] == t["round"]]
            for key in ("steps_per_s", "compile_s"):
                ratio = statistics.median(o[key] / t[key] for o, t in pairs) if pairs else None
                cells.append(fmt(ratio, ".2f"))
        lines.append(f"| {seeds} | {' | '.join(cells)} |")
    return lines


def write_table(algorithm: str, records: list, path: str) -> None:
    cold = next(r for r in records if r["kind"] == "cli_defaults_cold")
    warm = next(r for r in records if r["kind"] == "cli_defaults_warm")
    lines = [
        f"# {algorithm}.py on CartPole-v1",
        "",
        f"{describe(machine())}. Written by `benchmarks/bench_speed.py {algorithm}`; each row is a fresh process.",
        "",
        f"## Defaults (`python algorithms/{algorithm}.py`: {cold['num_seeds']} seeds, "
        f"{cold['total_timesteps']:,} steps each, on {len(cold['devices'])} device(s))",
        "",
        "| cache | compile s | train s | env steps/s | final return per seed "
        "| all seeds >= 475 after (s, incl. compile) |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in (("cold", cold), ("warm", warm)):
        to_threshold = "never" if r["seconds_to_threshold"] is None else f"{r['seconds_to_threshold']:.1f}"
        lines.append(
            f"| {name} | {r['compile_seconds']:.2f} | {r['train_seconds']:.1f} | "
            f"{r['steps_per_second']:,.0f} | {', '.join(str(round(x)) for x in r['final_return_per_seed'])} | "
            f"{to_threshold} |"
        )
    mono = next((r for r in records if r["kind"] == "monolithic_defaults"), None)
    if mono:
        lines += [
            "",
            f"The command line (progress in ~10 chunks, runs spread over {len(cold['devices'])} device(s)): "
            f"{cold['steps_per_second']:,.0f} env steps/s (cold run) against {mono['steps_per_s']:,.0f} for the "
            "same config as one `jax.jit(jax.vmap(train))` call on one device: "
            f"{cold['steps_per_second'] / mono['steps_per_s']:.2f}x.",
        ]
    lines += throughput_table(algorithm, records)
    write_markdown(path, lines)


if __name__ == "__main__":
    main()
