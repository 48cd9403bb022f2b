"""Measures algorithms/ippo.py side by side with JaxMARL's own IPPO baseline (baselines/IPPO/ippo_ff_mpe.py) on
MPE_simple_spread_v3, at that baseline's config (baselines/IPPO/config/ippo_ff_mpe.yaml of a JaxMARL checkout).

    python benchmarks/bench_marl.py --jaxmarl /path/to/JaxMARL                       # 4 seeds, 2e6 steps, 1 pair
    python benchmarks/bench_marl.py --jaxmarl /path/to/JaxMARL --seeds 4 --total-timesteps 2e6 --pairs 3

What it measures, each side in a fresh process with an empty JAX compile cache (JAX_COMPILATION_CACHE_DIR a
new temporary directory, as bench_parity.py does):
  - ours: as bench_rejax.py times ours, in-process through this script's --worker (not ippo.py's command
    line, whose harness spreads seeds over the CPU devices it splits the host into): `jax.jit(jax.vmap(train))`
    of ippo.py's make_train at the yaml's hyperparameters (each field mapped to a Config field, YAML_TO_OURS),
    after the harness's XLA flags (xla.configure()), on one device; compile_s = lower + compile, run_s the
    compiled call, steps/s = env steps of all seeds / run_s. final return: per seed, the mean return of the
    episodes that ended in the last 5% of updates (the harness's final_returns), per agent (the agents' mean
    reward summed over an episode); greedy eval: make_evaluate's 16 episodes after training, not timed.
  - JaxMARL: benchmarks/peers/jaxmarl_driver.py, its unmodified file and yaml, timed the same way; its final
    return is, per seed, the mean over the last 5% of updates of the `returned_episode_returns` the file logs
    through wandb.log (MPELogWrapper's: the sum over agents of each env's last finished episode's returns),
    divided by the number of agents.
Each pair runs one process of each side, the order alternating between pairs (ours first in the first);
ratios ours / JaxMARL are taken within a pair, then the median over pairs. Results: marl_<backend>.md and a
.jsonl of every measurement (appended), under --out (default benchmarks/results).
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from common import ROOT, describe, load_algorithm, machine, run_result, stats, write_markdown, xla

PEERS = os.path.join(ROOT, "benchmarks", "peers")
PEER_DRIVER = os.path.join(PEERS, "jaxmarl_driver.py")
CONFIG_PATH = os.path.join("baselines", "IPPO", "config", "ippo_ff_mpe.yaml")
YAML_TO_OURS = {  # the yaml's keys, as ippo.py's Config fields
    "ENV_NAME": "env_name",
    "LR": "lr",
    "NUM_ENVS": "num_envs",
    "NUM_STEPS": "num_steps",
    "TOTAL_TIMESTEPS": "total_timesteps",
    "UPDATE_EPOCHS": "update_epochs",
    "NUM_MINIBATCHES": "num_minibatches",
    "GAMMA": "gamma",
    "GAE_LAMBDA": "gae_lambda",
    "CLIP_EPS": "clip_eps",
    "ENT_COEF": "ent_coef",
    "VF_COEF": "vf_coef",
    "MAX_GRAD_NORM": "max_grad_norm",
    "ACTIVATION": "activation",
    "ANNEAL_LR": "anneal_lr",
}
NOT_HYPERPARAMETERS = {"SEED", "NUM_SEEDS", "ENTITY", "PROJECT", "WANDB_MODE"}  # seeds are set here; wandb unused
INTEGERS = {"num_envs", "num_steps", "total_timesteps", "update_epochs", "num_minibatches"}
DIFFERENCES = [
    "episode ends: MPE's only end is its time limit (max_steps); JaxMARL's GAE treats it as a termination "
    "(done zeroes the bootstrap value), ippo.py bootstraps through it from V of the true last observation",
    "the learning-rate anneal: JaxMARL's falls once per update (count // (minibatches * epochs)), ippo.py's at "
    "every gradient step",
    "the final return: ippo.py averages the episodes that ended in the last 5% of updates; JaxMARL's logged "
    "figure averages, over every step of those updates, each env's last finished episode (lagging by up to one "
    "episode), and sums over agents (MPELogWrapper multiplies each reward by the number of agents), so it is "
    "divided by the number of agents here",
    "the network, the losses (clipped surrogate, clipped value loss, per-minibatch advantage normalisation), "
    "the optimiser (one Adam over actor and critic, global-norm clip) and the per-agent rewards are alike",
]


def jaxmarl_config(jaxmarl: str) -> dict:
    """The baseline's yaml as the driver reads it."""
    sys.path.insert(0, PEERS)
    from jaxmarl_driver import yaml_config

    return yaml_config(os.path.join(jaxmarl, CONFIG_PATH))


def our_config(jaxmarl: str, total_timesteps: float, seeds: int) -> dict:
    """ippo.py's Config fields for the yaml, at --total-timesteps; refuses a yaml key it cannot map."""
    yaml = jaxmarl_config(jaxmarl)
    unmapped = set(yaml) - set(YAML_TO_OURS) - NOT_HYPERPARAMETERS - {"ENV_KWARGS"}
    if unmapped or yaml.get("ENV_KWARGS"):
        raise SystemExit(f"{CONFIG_PATH}: no Config field of ippo.py for {sorted(unmapped) or 'ENV_KWARGS'}")
    fields = {ours: yaml[key] for key, ours in YAML_TO_OURS.items() if key in yaml}
    fields |= dict(total_timesteps=total_timesteps, num_seeds=seeds)
    return {k: int(v) if k in INTEGERS else v for k, v in fields.items()}


def worker(jaxmarl: str, total_timesteps: float, seeds: int) -> None:
    """Times our train as one jitted call on one device, as the peer driver times JaxMARL's."""
    module = load_algorithm("ippo")
    xla.configure()  # the XLA flags the command line sets, before any JAX computation
    import jax
    import numpy as np

    config = module.Config(**our_config(jaxmarl, total_timesteps, seeds))
    keys = jax.random.split(jax.random.PRNGKey(0), seeds)
    train = module.make_train(config)
    start = time.perf_counter()
    compiled = jax.jit(jax.vmap(train)).lower(keys).compile()
    compiled_at = time.perf_counter()
    runner, metrics = jax.block_until_ready(compiled(keys))
    run_s = time.perf_counter() - compiled_at
    metrics = {k: np.asarray(v) for k, v in metrics.items()}
    evaluate = jax.jit(jax.vmap(module.make_evaluate(config)))
    greedy = np.asarray(evaluate(module.saved_params(runner), jax.random.split(jax.random.PRNGKey(1), seeds)))
    final = stats.final_returns(metrics)
    steps = int(metrics["env_steps"][0, -1])
    print(
        "RESULT "
        + json.dumps(
            {
                "bench": "ours_ippo",
                "env": config.env_name,
                "num_seeds": seeds,
                "total_timesteps": config.total_timesteps,
                "num_updates": config.num_updates,
                "env_steps_per_seed": steps,
                "compile_s": compiled_at - start,
                "run_s": run_s,
                "steps_per_s": steps * seeds / run_s,
                "final_return_mean": float(np.nanmean(final)),
                "final_return_std": float(np.nanstd(final)),
                "final_return_per_seed": [float(x) for x in final],
                "eval_return_mean": float(np.mean(greedy)),
                "finite": bool(metrics["finite"].all()),
                "xla_flags": os.environ.get("XLA_FLAGS", ""),
            }
        ),
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jaxmarl", metavar="PATH", help="root of a JaxMARL checkout (for baselines/IPPO)")
    parser.add_argument("--seeds", type=int, default=4, help="vmapped seeds per measurement")
    parser.add_argument("--total-timesteps", type=float, default=2e6, help="env steps per seed (yaml: 1e7)")
    parser.add_argument("--pairs", type=int, default=1, help="pairs of processes, the order alternating")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    parser.add_argument("--peer-python", default=sys.executable, help="interpreter with jaxmarl installed")
    parser.add_argument("--worker", action="store_true", help="internal: time ours and print RESULT")
    args = parser.parse_args()
    if not args.jaxmarl or not os.path.isfile(os.path.join(args.jaxmarl, CONFIG_PATH)):
        parser.error(f"--jaxmarl PATH: the root of a JaxMARL checkout (with {CONFIG_PATH})")
    jaxmarl = os.path.abspath(args.jaxmarl)
    if args.worker:
        return worker(jaxmarl, args.total_timesteps, args.seeds)
    config = our_config(jaxmarl, args.total_timesteps, args.seeds)  # refuses an unmappable yaml before running

    where = machine()
    os.makedirs(args.out, exist_ok=True)
    raw_path = os.path.join(args.out, f"marl_{where['backend']}.jsonl")
    records = []
    for index in range(args.pairs):
        ours = [sys.executable, os.path.abspath(__file__), "--worker", "--jaxmarl", jaxmarl]
        ours += ["--seeds", str(args.seeds), "--total-timesteps", repr(args.total_timesteps)]
        peer = [args.peer_python, PEER_DRIVER, "ippo_ff_mpe", "--jaxmarl", jaxmarl]
        peer += ["--seeds", str(args.seeds), "--total-timesteps", repr(args.total_timesteps)]
        jobs = [("ours", ours), ("jaxmarl", peer)][:: -1 if index % 2 else 1]
        for side, command in jobs:
            load_before = os.getloadavg()[0]
            with tempfile.TemporaryDirectory() as cache:
                env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": cache}
                result = run_result(command, env=env, timeout=3600)
            if not result:
                continue
            result = {
                "side": side,
                "pair": index,
                "seeds": args.seeds,
                "load_1min_before": load_before,
                "load_1min_after": os.getloadavg()[0],
                "unix_time": time.time(),
                **result,
                "machine": where,
            }
            records.append(result)
            with open(raw_path, "a") as f:
                f.write(json.dumps(result) + "\n")
            print(
                f"pair {index + 1} {side:7s} {args.seeds} seed(s): compile {result['compile_s']:.1f} s, "
                f"{result['steps_per_s']:,.0f} env steps/s, return per agent {result['final_return_mean']:.2f} "
                f"(load {load_before:.1f})",
                flush=True,
            )
    write_table(records, config, where, os.path.join(args.out, f"marl_{where['backend']}.md"), raw_path)


def write_table(records: list, config: dict, where: dict, path: str, raw_path: str) -> None:
    fmt = lambda x, f: "–" if x is None else format(x, f)  # noqa: E731
    med = lambda rs, k: statistics.median(r[k] for r in rs if r.get(k) is not None) if rs else None  # noqa: E731
    runs = {side: [r for r in records if r["side"] == side] for side in ("ours", "jaxmarl")}
    pairs = [(o, t) for o in runs["ours"] for t in runs["jaxmarl"] if o["pair"] == t["pair"]]
    ratio = lambda k: statistics.median(o[k] / t[k] for o, t in pairs) if pairs else None  # noqa: E731
    peer = runs["jaxmarl"][0] if runs["jaxmarl"] else {}
    commit = peer.get("jaxmarl_commit")
    version = (
        f"commit {commit}"
        if commit
        else f"commit unknown (the clone is no git checkout; ippo_ff_mpe.py is git blob {peer.get('baseline_blob')})"
        if peer
        else "no JaxMARL measurement"
    )
    shown = ", ".join(f"{k} {v}" for k, v in config.items() if k not in ("num_seeds", "total_timesteps"))
    lines = [
        "# ippo.py against JaxMARL's IPPO (ippo_ff_mpe.py) on MPE_simple_spread_v3",
        "",
        f"{describe(where)}. Written by `benchmarks/bench_marl.py`; each measurement is a fresh process with an "
        f"empty compile cache. Every measurement: `{os.path.basename(raw_path)}`.",
        "",
        f"Both at JaxMARL's own config (`baselines/IPPO/config/ippo_ff_mpe.yaml`, JaxMARL {version}): {shown}; "
        f"{config['total_timesteps']:,} env steps per seed (the yaml's 1e7 overridden), {config['num_seeds']} "
        "seeds vmapped in one `jax.jit(jax.vmap(train))` call, compile (lower + compile) and run timed apart. "
        "Ours: ippo.py's make_train in this script's worker, after the harness's XLA flags, on one device. "
        "JaxMARL: `benchmarks/peers/jaxmarl_driver.py` (the unmodified file; its per-update "
        "`io_callback(wandb.log)` runs, into a stand-in that records what it logs). env steps/s: env steps of all "
        "seeds per second of the compiled run. Final return per agent (the agents' mean reward summed over an "
        "episode), mean ± std over seeds: ours, the episodes that ended in the last 5% of updates; JaxMARL, its "
        "logged `returned_episode_returns` (the sum over agents) over the last 5% of updates, divided by the "
        "number of agents. Greedy eval (ours): 16 episodes after training. Medians over pairs; each ratio is "
        "ours / JaxMARL within one pair (order alternating). Load: the 1-minute load average before each "
        "measurement.",
        "",
        "JaxMARL's MPE episode end is a time limit, which JaxMARL treats as a termination while ippo.py "
        "bootstraps through it.",
        "",
        "| side | seeds | env steps per seed | final return per agent | greedy eval | env steps/s | compile s | load |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for side, name in (("ours", "ippo.py"), ("jaxmarl", "JaxMARL ippo_ff_mpe.py")):
        rs = runs[side]
        loads = [r["load_1min_before"] for r in rs]
        lines.append(
            f"| {name} | {rs[0]['num_seeds'] if rs else '–'} | {fmt(rs[0]['env_steps_per_seed'] if rs else None, ',')}"
            f" | {fmt(med(rs, 'final_return_mean'), '.2f')} ± {fmt(med(rs, 'final_return_std'), '.2f')} | "
            f"{fmt(med(rs, 'eval_return_mean') if side == 'ours' else None, '.2f')} | "
            f"{fmt(med(rs, 'steps_per_s'), ',.0f')} | {fmt(med(rs, 'compile_s'), '.1f')} | "
            f"{fmt(min(loads) if loads else None, '.1f')} to {fmt(max(loads) if loads else None, '.1f')} |"
        )
    lines.append(
        f"| ours / JaxMARL ({len(pairs)} pair(s)) | | | | | {fmt(ratio('steps_per_s'), '.2f')}x | "
        f"{fmt(ratio('compile_s'), '.2f')}x | |"
    )
    lines += ["", "How the two differ, and where they are alike:", ""] + [f"- {item}" for item in DIFFERENCES]
    write_markdown(path, lines)


if __name__ == "__main__":
    main()
