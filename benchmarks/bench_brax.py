"""algorithms/ppo_continuous.py against PureJAXRL's ppo_continuous_action.py on Brax, at PureJAXRL's
own config (hopper, Brax's positional backend, 2048 envs x 10 steps, 4 epochs of 32 minibatches,
lr 3e-4 constant, 256-unit tanh networks, observation and reward normalisation), same budget and
seeds, each in a fresh process, alternating order between rounds.

    python benchmarks/bench_brax.py --purejaxrl /path/to/purejaxrl --total-timesteps 3e6 --rounds 1

Both are timed the same way: jax.jit(jax.vmap(train)).lower(keys).compile() (compile_s), then the
compiled call until block_until_ready (run_s); env steps/s = env steps of all seeds / run_s. Final
return: per seed, the mean return of the training episodes that ended in the last 5% of updates.
Ours also reports the greedy (mean action) evaluation return. Differences that remain (listed in
the table): PureJAXRL's Brax wrapper ends episodes at 1,000 steps as terminations (no bootstrap),
ours bootstraps through the time limit; PureJAXRL clips actions in a wrapper, ours clips them too.
Writes results/brax_<backend>.{md,jsonl}.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, describe, load_algorithm, machine, run_result, stats, suites, write_markdown, xla  # noqa: E402

PEER_DRIVER = os.path.join(ROOT, "benchmarks", "peers", "purejaxrl_driver.py")
# PureJAXRL's ppo_continuous_action.py config (its `config = {...}` at commit 31756b1), in our flags.
OURS = dict(
    env_name="brax/hopper:positional",
    num_envs=2048,
    num_steps=10,
    update_epochs=4,
    num_minibatches=32,
    lr=3e-4,
    anneal_lr=False,
    gamma=0.99,
    gae_lambda=0.95,
    clip_eps=0.2,
    ent_coef=0.0,
    vf_coef=0.5,
    max_grad_norm=0.5,
    activation="tanh",
    hidden_size=256,
    num_layers=2,
    normalize_obs=True,
    normalize_reward=True,
    log_std_init=0.0,
)
NOTES = [
    "time limit: PureJAXRL's BraxGymnaxWrapper reports the 1,000-step limit as done (no bootstrap); ours "
    "truncates and bootstraps from the true final observation",
    "fresh episodes: Brax's AutoResetWrapper (PureJAXRL's) restarts every env from the same first state; ours "
    "draws new ones (one per 32 env steps)",
    "alike: reward normalisation by a running std of the discounted return, observation normalisation, a "
    "state-independent log std starting at 0, actions clipped to [-1, 1]",
]


def worker(seeds: int, total_timesteps: int) -> None:
    """Times ours as one jitted call, as the peer driver times PureJAXRL."""
    module = load_algorithm("ppo_continuous")
    xla.configure()  # the command line's XLA flags, before any JAX computation
    import jax
    import numpy as np

    config = module.Config(**OURS, total_timesteps=total_timesteps, num_seeds=seeds)
    suites.register(config.env_name)  # brax/... through gymnax's registry, as the command line does
    keys = jax.random.split(jax.random.PRNGKey(0), seeds)
    start = time.perf_counter()
    train = module.make_train(config, suites.vec_env(module, config.env_name, config.num_envs))  # pooled resets
    compiled = jax.jit(jax.vmap(train)).lower(keys).compile()
    compiled_at = time.perf_counter()
    runner, metrics = jax.block_until_ready(compiled(keys))
    run_s = time.perf_counter() - compiled_at
    metrics = {k: np.asarray(v) for k, v in metrics.items()}
    evaluate = jax.jit(jax.vmap(suites.make_evaluate(module, config)))
    greedy = np.asarray(evaluate(module.saved_params(runner), jax.random.split(jax.random.PRNGKey(1), seeds)))
    steps = int(metrics["env_steps"][0, -1])
    finals = stats.final_returns(metrics)
    result = {
        "bench": "ours_ppo_continuous",
        "num_seeds": seeds,
        "env_steps_per_seed": steps,
        "compile_s": compiled_at - start,
        "run_s": run_s,
        "steps_per_s": steps * seeds / run_s,
        "final_return_mean": float(np.nanmean(finals)),
        "final_return_per_seed": [float(x) for x in finals],
        "eval_return_mean": float(np.mean(greedy)),
    }
    print("RESULT " + json.dumps(result), flush=True)


def write_table(records: list, path: str, about: str) -> None:
    lines = [
        "# Brax hopper: ppo_continuous.py and PureJAXRL's ppo_continuous_action.py",
        "",
        about + ".",
        "",
        "PureJAXRL's own config (hopper, positional backend, 2048 envs x 10 steps, 4 epochs x 32 minibatches, "
        "lr 3e-4, tanh 256-256, normalised observations and rewards), the same budget and seeds; each one jitted "
        "call of `jax.vmap(train)`, compile apart. Final return: mean over seeds of each seed's training "
        "episodes that ended in the last 5% of updates; eval: greedy (ours only).",
        "",
        "| round | system | seeds | env steps per seed | compile s | run s | env steps/s | final return | eval |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        evaluation = f"{r['eval_return_mean']:.1f}" if "eval_return_mean" in r else "–"
        lines.append(
            f"| {r['round'] + 1} | {r['kind']} | {r['num_seeds']} | {r['env_steps_per_seed']:,} | "
            f"{r['compile_s']:.1f} | {r['run_s']:.1f} | {r['steps_per_s']:,.0f} | "
            f"{r['final_return_mean']:.1f} | {evaluation} |"
        )
    lines += ["", "Notes:", *(f"- {note}" for note in NOTES)]
    write_markdown(path, lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--purejaxrl", metavar="PATH", help="root of a PureJAXRL checkout (commit 31756b1)")
    parser.add_argument("--total-timesteps", type=float, default=3e6, help="env steps per seed, both systems")
    parser.add_argument("--seeds", type=int, default=1, help="vmapped seeds, both systems")
    parser.add_argument("--rounds", type=int, default=1, help="repetitions, the order alternating between rounds")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    parser.add_argument("--worker", action="store_true", help="internal: time ours and print RESULT")
    args = parser.parse_args()
    total = int(args.total_timesteps)
    if args.worker:
        return worker(args.seeds, total)
    if not args.purejaxrl or not os.path.isdir(os.path.join(args.purejaxrl, "purejaxrl")):
        parser.error("--purejaxrl PATH: the root of a PureJAXRL checkout")
    info = machine()
    raw_path = os.path.join(args.out, f"brax_{info['backend']}.jsonl")
    records = []
    for round_index in range(args.rounds):
        ours = [sys.executable, os.path.abspath(__file__), "--worker", "--seeds", str(args.seeds)]
        ours += ["--total-timesteps", str(total)]
        peer = [sys.executable, PEER_DRIVER, "ppo_continuous_action", "--purejaxrl", os.path.abspath(args.purejaxrl)]
        peer += ["--seeds", str(args.seeds), "--total-timesteps", str(total)]
        jobs = [("ours", ours), ("PureJAXRL", peer)]
        if round_index % 2:
            jobs.reverse()
        for name, cmd in jobs:
            result = run_result(cmd, timeout=3600)
            if not result:
                continue
            result = {"kind": name, "round": round_index, "machine": info, **result}
            result.setdefault("env_steps_per_seed", total)
            records.append(result)
            with open(raw_path, "a") as f:
                f.write(json.dumps(result) + "\n")
            print(
                f"round {round_index + 1} {name}: compile {result['compile_s']:.1f} s, "
                f"{result['steps_per_s']:,.0f} env steps/s, return {result['final_return_mean']:.1f}",
                flush=True,
            )
    write_table(records, os.path.join(args.out, f"brax_{info['backend']}.md"), describe(info))


if __name__ == "__main__":
    main()
