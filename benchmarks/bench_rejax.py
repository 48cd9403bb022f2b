"""Measures the speed of algorithms/sac.py and td3.py side by side with rejax's SAC and TD3, at rejax's
own Pendulum-v1 hyperparameters (configs/gymnax/pendulum.yaml of a rejax checkout).

    python benchmarks/bench_rejax.py --rejax /path/to/rejax                   # sac and td3, 1 and 8 seeds
    python benchmarks/bench_rejax.py --rejax /path/to/rejax --algorithms sac --rounds 3

What it measures, each configuration in a fresh process (every compile cold):
  - ours: `jax.jit(jax.vmap(train))` of the file at rejax's hyperparameters (REJAX_CONFIG below, each
    yaml field mapped to ours; what cannot be matched is listed in MISMATCHES and in the report),
    after `configure_xla()`, on one device, timed as benchmarks/peers/rejax_driver.py times rejax:
    compile_s = lower + compile, steps/s = training env steps of all seeds / run seconds;
  - rejax: benchmarks/peers/rejax_driver.py with `--eval-freq final`, so that rejax's run holds one
    evaluation (128 episodes, at the end) instead of one every 100 env steps.
  Both report the greedy return of 128 fresh episodes after training (ours through make_evaluate,
  not timed; rejax's inside its run) and ours also the harness's final training return.
For each seed count the two run in alternating order over the rounds, and each ratio
ours / rejax is taken within its round. The 1-minute load average of the machine is recorded
with every measurement: on a shared machine compare only ratios from one run of this script.
Results: benchmarks/results/rejax_<backend>.md and a .jsonl of every measurement (appended).
"""

import argparse
import json
import math
import os
import statistics
import sys
import time

from common import ROOT, algorithm_path, describe, machine, run_result, stats, write_markdown, xla

PEER_DRIVER = os.path.join(ROOT, "benchmarks", "peers", "rejax_driver.py")
PENDULUM_HALF_RANGE = 2.0  # Pendulum-v1's actions are in [-2, 2]; rejax's noise scales are in those units
# rejax's pendulum.yaml, section by section, in our Config's field names.
REJAX_CONFIG = {
    "sac": dict(
        env_name="Pendulum-v1",
        activation="swish",  # agent_kwargs.activation
        hidden_size=64,  # rejax's default hidden_layer_sizes (64, 64)
        num_layers=2,
        num_envs=1,
        num_steps=200,  # ours only: env steps per env in one update (a metrics row); rejax has none
        buffer_size=10_000,
        learning_starts=256,  # fill_buffer: rejax trains once global_step > 256, as ours does
        batch_size=256,
        lr=0.01,  # learning_rate, for actor, critics and temperature as in rejax
        train_frequency=1,  # one gradient step (num_epochs: 1) per env step
        gradient_steps=1,
        total_timesteps=10_000,
        gamma=0.99,
        tau=1 - 0.98,  # polyak 0.98 is the weight of the old target
        # rejax's target entropy is -action_dim for the log-density of tanh(u), before the rescale to
        # [-2, 2]; ours is of the executed action, log(2) nats per dimension higher.
        target_entropy_scale=1 - math.log(PENDULUM_HALF_RANGE),
        log_std_min=-10.0,  # rejax's log_std_range (-10, 2)
        log_std_max=2.0,
        num_critics=2,
        eval_episodes=128,  # rejax's evaluation episodes
    ),
    "td3": dict(
        env_name="Pendulum-v1",
        activation="swish",  # actor_kwargs and critic_kwargs
        hidden_size=64,  # rejax's hidden_layer_sizes (64, 64)
        num_layers=2,
        num_envs=1,
        num_steps=200,
        buffer_size=10_000,
        learning_starts=1_000,  # fill_buffer, uniformly random actions until then in both
        batch_size=100,
        lr=0.001,
        train_frequency=1,
        gradient_steps=1,  # num_epochs: 1
        total_timesteps=10_000,
        gamma=0.99,
        tau=1 - 0.95,  # polyak 0.95
        exploration_noise=0.3 / PENDULUM_HALF_RANGE,  # rejax's 0.3 is in action units, ours in half ranges
        policy_noise=0.2 / PENDULUM_HALF_RANGE,  # target_noise
        noise_clip=0.5 / PENDULUM_HALF_RANGE,  # target_noise_clip
        policy_delay=2,
        num_critics=2,
        eval_episodes=128,
    ),
}
MISMATCHES = {
    "sac": [
        "normalize_observations: true (rejax normalises observations by running statistics; ours has no "
        "observation normalisation)",
        "the log std: rejax clips it to [-10, 2], ours maps it into [-10, 2] with a tanh",
        "the temperature: rejax's loss is alpha * (...), ours log_alpha * (...) (same fixed point, another step size)",
        "time limits: rejax (gymnax >= 1.0 through the driver's adapter) treats Pendulum's truncation as a "
        "termination, ours bootstraps through it",
        "before learning starts rejax acts with its initial policy, ours with uniformly random actions",
        "eval_freq: 100 in the yaml; rejax runs with one evaluation at the end (--eval-freq final), ours "
        "evaluates after training, untimed",
    ],
    "td3": [
        "normalize_observations: true (ours has none)",
        "max_grad_norm: 100 (rejax clips each gradient element to [-100, 100]; ours does not clip)",
        "the actor's loss: rejax averages Q over both critics, ours uses the first (as the TD3 paper)",
        "time limits: rejax treats Pendulum's truncation as a termination, ours bootstraps through it",
        "eval_freq: 100 in the yaml; rejax runs with one evaluation at the end (--eval-freq final)",
    ],
}


def load(algorithm: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(algorithm, algorithm_path(algorithm))
    module = importlib.util.module_from_spec(spec)
    sys.modules[algorithm] = module
    spec.loader.exec_module(module)
    return module


def worker(algorithm: str, seeds: int) -> None:
    """Times our train as one jitted call on one device, as the peer driver times rejax."""
    module = load(algorithm)
    xla.configure()  # the XLA flags the command line sets, before any JAX computation
    import jax
    import numpy as np

    config = module.Config(**REJAX_CONFIG[algorithm], num_seeds=seeds)
    keys = jax.random.split(jax.random.PRNGKey(0), seeds)
    start = time.perf_counter()
    compiled = jax.jit(jax.vmap(module.make_train(config))).lower(keys).compile()
    compiled_at = time.perf_counter()
    runner, metrics = jax.block_until_ready(compiled(keys))
    run_s = time.perf_counter() - compiled_at
    metrics = {k: np.asarray(v) for k, v in metrics.items()}
    evaluate = jax.jit(jax.vmap(module.make_evaluate(config)))
    greedy = np.asarray(evaluate(module.saved_params(runner), jax.random.split(jax.random.PRNGKey(1), seeds)))
    steps = int(metrics["env_steps"][0, -1])
    print(
        "RESULT "
        + json.dumps(
            {
                "bench": f"ours_{algorithm}",
                "num_seeds": seeds,
                "env_steps_per_seed": steps,
                "gradient_steps_per_seed": int(metrics["gradient_steps"][0].sum()),
                "compile_s": compiled_at - start,
                "run_s": run_s,
                "steps_per_s": steps * seeds / run_s,
                "final_return_mean": float(np.mean(greedy)),
                "final_return_per_seed": [float(x) for x in greedy],
                "final_training_return_mean": float(np.nanmean(stats.final_returns(metrics))),
                "xla_flags": os.environ.get("XLA_FLAGS", ""),
            }
        ),
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rejax", metavar="PATH", help="root of a rejax checkout (tag v0.1.3), for its configs/")
    parser.add_argument("--algorithms", default="sac,td3", help="comma-separated: sac, td3")
    parser.add_argument("--seed-counts", default="1,8", help="vmapped seeds per measurement")
    parser.add_argument("--rounds", type=int, default=2, help="repetitions, the order alternating between rounds")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    parser.add_argument("--peer-python", default=sys.executable, help="interpreter with rejax installed")
    parser.add_argument("--worker", choices=sorted(REJAX_CONFIG), help="internal: time ours and print RESULT")
    parser.add_argument("--seeds", type=int, default=1, help="worker: vmapped seeds")
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.seeds)
    if not args.rejax or not os.path.isfile(os.path.join(args.rejax, "configs", "gymnax", "pendulum.yaml")):
        parser.error("--rejax PATH: the root of a rejax checkout (with configs/gymnax/pendulum.yaml)")
    algorithms = args.algorithms.split(",")
    for algorithm in algorithms:
        if algorithm not in REJAX_CONFIG:
            parser.error(f"--algorithms: {algorithm!r} is not one of {', '.join(REJAX_CONFIG)}")

    import jax

    os.makedirs(args.out, exist_ok=True)
    backend = jax.default_backend()
    raw_path = os.path.join(args.out, f"rejax_{backend}.jsonl")
    records = []
    for round_index in range(args.rounds):
        for algorithm in algorithms:
            for seeds in map(int, args.seed_counts.split(",")):
                ours = [sys.executable, os.path.abspath(__file__), "--worker", algorithm, "--seeds", str(seeds)]
                peer = [args.peer_python, PEER_DRIVER, algorithm, "--rejax", os.path.abspath(args.rejax)]
                peer += ["--seeds", str(seeds), "--eval-freq", "final"]
                jobs = [("ours", ours), ("rejax", peer)]
                if round_index % 2:
                    jobs.reverse()
                for name, cmd in jobs:
                    load_before = os.getloadavg()[0]
                    result = run_result(cmd, timeout=1800)
                    if not result:
                        continue
                    result = {
                        "kind": name,
                        "algorithm": algorithm,
                        "round": round_index,
                        "seeds": seeds,
                        "load_1min_before": load_before,
                        "load_1min_after": os.getloadavg()[0],
                        "unix_time": time.time(),
                        **result,
                    }
                    records.append(result)
                    with open(raw_path, "a") as f:
                        f.write(json.dumps(result) + "\n")
                    print(
                        f"round {round_index + 1} {algorithm} {name:5s} {seeds} seed(s): compile "
                        f"{result['compile_s']:.1f} s, {result['steps_per_s']:,.0f} env steps/s, return "
                        f"{result['final_return_mean']:.1f} (load {load_before:.1f})",
                        flush=True,
                    )
    write_table(records, algorithms, os.path.join(args.out, f"rejax_{backend}.md"))


def write_table(records: list, algorithms: list, path: str) -> None:
    fmt = lambda x, f: "–" if x is None else format(x, f)  # noqa: E731
    med = lambda rs, k: statistics.median(r[k] for r in rs) if rs else None  # noqa: E731
    lines = [
        "# sac.py and td3.py against rejax on Pendulum-v1",
        "",
        f"{describe(machine())}. Written by `benchmarks/bench_rejax.py`; each measurement is a fresh process.",
        "",
        "Both at rejax's own hyperparameters (`configs/gymnax/pendulum.yaml`, v0.1.3), 10,000 env steps per "
        "seed, one env, a gradient step per env step. Ours: `jax.jit(jax.vmap(train))` after "
        "`configure_xla()`, on one device. rejax: `benchmarks/peers/rejax_driver.py --eval-freq final` (one "
        "evaluation of 128 episodes at the end of its run, instead of one every 100 env steps). steps/s: "
        "training env steps of all seeds per second of the compiled run. Return: the greedy policy's mean "
        "over 128 fresh episodes after training, averaged over seeds (ours also: the final training return, "
        "episodes ending in the last 5% of updates). Medians over rounds; each ratio is ours / rejax within "
        "one round. Load: the machine's 1-minute load average before each measurement (2 cores).",
        "",
        "| algorithm | seeds | ours compile s | ours steps/s | rejax compile s | rejax steps/s | ours / rejax "
        "steps/s | ours return (greedy) | ours final training return | rejax return | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for algorithm in algorithms:
        for seeds in sorted({r["seeds"] for r in records if r["algorithm"] == algorithm}):
            runs = {
                kind: [r for r in records if r["kind"] == kind and r["algorithm"] == algorithm and r["seeds"] == seeds]
                for kind in ("ours", "rejax")
            }
            pairs = [(o, t) for o in runs["ours"] for t in runs["rejax"] if o["round"] == t["round"]]
            ratio = statistics.median(o["steps_per_s"] / t["steps_per_s"] for o, t in pairs) if pairs else None
            loads = [r["load_1min_before"] for rs in runs.values() for r in rs]
            lines.append(
                f"| {algorithm} | {seeds} | {fmt(med(runs['ours'], 'compile_s'), '.1f')} | "
                f"{fmt(med(runs['ours'], 'steps_per_s'), ',.0f')} | {fmt(med(runs['rejax'], 'compile_s'), '.1f')} | "
                f"{fmt(med(runs['rejax'], 'steps_per_s'), ',.0f')} | {fmt(ratio, '.2f')} | "
                f"{fmt(med(runs['ours'], 'final_return_mean'), '.1f')} | "
                f"{fmt(med(runs['ours'], 'final_training_return_mean'), '.1f')} | "
                f"{fmt(med(runs['rejax'], 'final_return_mean'), '.1f')} | "
                f"{fmt(min(loads) if loads else None, '.1f')} to {fmt(max(loads) if loads else None, '.1f')} |"
            )
    lines += ["", "Each yaml field maps to a Config field of ours (see `REJAX_CONFIG` in the script); these cannot:"]
    for algorithm in algorithms:
        lines += ["", f"{algorithm}:"] + [f"- {item}" for item in MISMATCHES[algorithm]]
    write_markdown(path, lines)


if __name__ == "__main__":
    main()
