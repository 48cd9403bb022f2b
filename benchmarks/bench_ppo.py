"""Measures algorithms/ppo.py on CartPole-v1 and writes a markdown table of what it saw.

    python benchmarks/bench_ppo.py                      # our figures only
    PUREJAXRL=/path/to/purejaxrl python benchmarks/bench_ppo.py --rounds 3
                                                        # side by side with PureJAXRL's ppo.py

What it measures, each in a fresh process (so every compile is cold unless stated):
  1. The command line with its defaults, twice, sharing one new compilation cache: compile
     seconds cold and warm, train seconds, final return of every seed, and the wall-clock
     until all seeds have reached return 475 (compile + the share of training it took).
  2. Throughput at PureJAXRL's CartPole hyperparameters (4 envs x 128 steps, 4 epochs x 4
     minibatches, lr 2.5e-4 annealed, 5e5 steps) for 1, 8 and 32 vmapped seeds, timed like
     ../shared/peers/purejaxrl_bench.py times PureJAXRL: compile_s = lower + compile of
     jax.jit(jax.vmap(train)), steps/s = env steps of all seeds / run seconds. With $PUREJAXRL
     set, PureJAXRL's own ppo.py runs right after (or before, alternating) each of ours,
     and the ratio is taken within that pair. Timings on a shared machine vary: compare only
     inside one run of this script.
Results: benchmarks/results/ppo_<backend>.md and a .jsonl of every measurement.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from common import ROOT, algorithm_path, describe, machine, run_cli, write_markdown

PPO = algorithm_path("ppo")
PEERS = os.environ.get("PEERS_DIR", os.path.join(os.path.dirname(ROOT), "shared", "peers"))
# PureJAXRL's ppo.py CartPole config, in our field names.
PUREJAXRL_CONFIG = dict(num_envs=4, num_steps=128, update_epochs=4, num_minibatches=4, lr=2.5e-4,
                        anneal_lr=True, gamma=0.99, gae_lambda=0.95, clip_eps=0.2, ent_coef=0.01,
                        vf_coef=0.5, max_grad_norm=0.5, activation="tanh", hidden_size=64,
                        num_layers=2, total_timesteps=500_000)
THRESHOLD = 475.0


def worker(seeds: int, preset: str) -> None:
    """Times our train at PureJAXRL's config (or our defaults), as the peer driver times theirs."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("ppo", PPO)
    ppo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ppo)
    import jax
    import numpy as np

    config = ppo.Config(**(PUREJAXRL_CONFIG if preset == "purejaxrl" else {}), num_seeds=seeds)
    keys = jax.random.split(jax.random.PRNGKey(0), seeds)
    start = time.perf_counter()
    lowered = jax.jit(jax.vmap(ppo.make_train(config))).lower(keys)
    compiled = lowered.compile()
    compiled_at = time.perf_counter()
    _, metrics = jax.block_until_ready(compiled(keys))
    run_s = time.perf_counter() - compiled_at
    steps = config.num_updates * config.batch_size
    finals = ppo.final_returns({k: np.asarray(v) for k, v in metrics.items()})
    print("RESULT " + json.dumps({"bench": "ours_ppo", "num_seeds": seeds, "compile_s": compiled_at - start,
                                  "run_s": run_s, "steps_per_s": steps * seeds / run_s,
                                  "final_return_mean": float(np.mean(finals))}), flush=True)


def run_result(cmd: list, env: dict | None = None, timeout: int = 900) -> dict | None:
    """Runs a driver in a fresh process and returns its `RESULT {json}` line, or None."""
    try:
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"  timed out after {timeout} s: {' '.join(cmd)}", flush=True)
        return None
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    print(f"  no result (exit {out.returncode}): {' '.join(cmd)}\n{out.stderr[-2000:]}", flush=True)
    return None


def cli_defaults(cache_dir: str, runs_dir: str) -> dict:
    """One default command-line run; returns its summary plus time-to-threshold."""
    import numpy as np
    result = run_cli("ppo", [], runs_dir, cache_dir, timeout=900)
    summary = result["summary"]
    returns = np.nan_to_num(result["metrics"]["episode_return"][0], nan=-np.inf)  # [seeds, updates]
    reached = np.maximum.accumulate(returns >= THRESHOLD, axis=1).all(axis=0)
    fraction = (int(np.argmax(reached)) + 1) / returns.shape[1] if reached.any() else None
    return {**summary, "process_wall_s": result["process_wall_s"], "threshold_fraction_of_training": fraction,
            "seconds_to_threshold": None if fraction is None
            else summary["compile_seconds"] + fraction * summary["train_seconds"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", nargs="?", default="all", choices=["all", "worker"])
    parser.add_argument("--seeds", type=int, default=1, help="worker mode: vmapped seeds")
    parser.add_argument("--preset", default="purejaxrl", choices=["purejaxrl", "defaults"],
                        help="worker mode: PureJAXRL's CartPole hyperparameters or ppo.py's defaults")
    parser.add_argument("--seed-counts", default="1,8,32", help="throughput at these seed counts")
    parser.add_argument("--rounds", type=int, default=2, help="repetitions of the throughput pairs")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = parser.parse_args()
    if args.mode == "worker":
        return worker(args.seeds, args.preset)

    import jax
    backend = jax.default_backend()
    os.makedirs(args.out, exist_ok=True)
    raw_path = os.path.join(args.out, f"ppo_{backend}.jsonl")
    records = []

    def record(kind: str, result: dict) -> None:
        result = {"kind": kind, "unix_time": time.time(), **result}
        records.append(result)
        with open(raw_path, "a") as f:
            f.write(json.dumps(result) + "\n")

    with tempfile.TemporaryDirectory() as tmp:
        cache, runs = os.path.join(tmp, "cache"), os.path.join(tmp, "runs")
        for attempt in ("cold", "warm"):
            result = cli_defaults(cache, runs)
            record(f"cli_defaults_{attempt}", result)
            print(f"defaults ({attempt} cache): compile {result['compile_seconds']:.1f} s, train "
                  f"{result['train_seconds']:.1f} s, final returns {[round(x) for x in result['final_return_per_seed']]}",
                  flush=True)

    # The command line runs the updates in ~10 chunks to report progress; one jitted call of the
    # whole run at the same config shows what that costs.
    result = run_result([sys.executable, os.path.abspath(__file__), "worker", "--preset", "defaults",
                         "--seeds", str(records[0]["num_seeds"])])
    if result:
        record("monolithic_defaults", result)
        print(f"defaults as one jitted call: {result['steps_per_s']:,.0f} steps/s", flush=True)

    purejaxrl = os.environ.get("PUREJAXRL")
    peer_driver = os.path.join(PEERS, "purejaxrl_bench.py")
    if purejaxrl and not os.path.exists(peer_driver):
        print(f"PUREJAXRL is set but {peer_driver} is missing (set PEERS_DIR); running ours alone", flush=True)
        purejaxrl = None
    for round_index in range(args.rounds):
        for seeds in map(int, args.seed_counts.split(",")):
            ours = [sys.executable, os.path.abspath(__file__), "worker", "--seeds", str(seeds)]
            jobs = [("ours", ours, None),
                    # the same, under XLA's default CPU scheduler, which ppo.py turns off by default
                    ("ours_default_scheduler", ours,
                     {**os.environ, "XLA_FLAGS": "--xla_cpu_enable_concurrency_optimized_scheduler=true"})]
            if purejaxrl:
                jobs.append(("purejaxrl", [sys.executable, peer_driver, "ppo", "--seeds", str(seeds)],
                             {**os.environ, "PUREJAXRL": purejaxrl}))
            if round_index % 2:
                jobs.reverse()
            for name, cmd, env in jobs:
                result = run_result(cmd, env)
                if result:
                    record(f"throughput_{name}", {**result, "round": round_index, "seeds": seeds})
                    print(f"round {round_index + 1} {name:22s} {seeds:3d} seeds: compile {result['compile_s']:.1f} s, "
                          f"{result['steps_per_s']:,.0f} steps/s, final {result['final_return_mean']:.0f}", flush=True)
    write_table(records, os.path.join(args.out, f"ppo_{backend}.md"))


def write_table(records: list, path: str) -> None:
    cold = next(r for r in records if r["kind"] == "cli_defaults_cold")
    warm = next(r for r in records if r["kind"] == "cli_defaults_warm")
    lines = [
        "# ppo.py on CartPole-v1",
        "",
        f"{describe(machine())}. Written by `benchmarks/bench_ppo.py`; each row is a fresh process.",
        "",
        "## Defaults (`python algorithms/ppo.py`: 8 seeds, "
        f"{cold['total_timesteps']:,} steps each)",
        "",
        "| cache | compile s | train s | env steps/s | final return per seed | all seeds >= 475 after (s, incl. compile) |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in (("cold", cold), ("warm", warm)):
        to_threshold = "never" if r["seconds_to_threshold"] is None else f"{r['seconds_to_threshold']:.1f}"
        lines.append(f"| {name} | {r['compile_seconds']:.2f} | {r['train_seconds']:.1f} | {r['steps_per_second']:,.0f} | "
                     f"{', '.join(str(round(x)) for x in r['final_return_per_seed'])} | {to_threshold} |")
    mono = next((r for r in records if r["kind"] == "monolithic_defaults"), None)
    if mono:
        lines += ["", f"Progress reporting: the command line's {cold['steps_per_second']:,.0f} env steps/s (cold run) "
                  f"against {mono['steps_per_s']:,.0f} for the same config as one `jax.jit(jax.vmap(train))` call "
                  f"without progress: a ratio of {cold['steps_per_second'] / mono['steps_per_s']:.3f}."]
    lines += ["", "## PureJAXRL's CartPole hyperparameters (4 envs x 128 steps, 4 x 4 minibatches, 5e5 steps)", "",
              "Median over rounds; the ratio is taken within each round's back-to-back pair.", "",
              "`ours, XLA scheduler` is ppo.py with XLA's default CPU scheduler (PureJAXRL's setting), "
              "which ppo.py turns off because it has deadlocked vmapped PPO here.", "",
              "| seeds | ours compile s | ours steps/s | ours, XLA scheduler steps/s | PureJAXRL compile s | "
              "PureJAXRL steps/s | speed ratio (ours / PureJAXRL) | same, XLA scheduler | compile ratio |",
              "|---|---|---|---|---|---|---|---|---|"]
    seed_counts = sorted({r["seeds"] for r in records if r["kind"].startswith("throughput")})
    for seeds in seed_counts:
        ours = [r for r in records if r["kind"] == "throughput_ours" and r["seeds"] == seeds]
        theirs = [r for r in records if r["kind"] == "throughput_purejaxrl" and r["seeds"] == seeds]
        sched = [r for r in records if r["kind"] == "throughput_ours_default_scheduler" and r["seeds"] == seeds]
        med = lambda rs, k: statistics.median(r[k] for r in rs) if rs else None  # noqa: E731
        pairs = [(o, t) for o in ours for t in theirs if o["round"] == t["round"]]
        speed = statistics.median(o["steps_per_s"] / t["steps_per_s"] for o, t in pairs) if pairs else None
        sched_pairs = [(o, t) for o in sched for t in theirs if o["round"] == t["round"]]
        sched_speed = (statistics.median(o["steps_per_s"] / t["steps_per_s"] for o, t in sched_pairs)
                       if sched_pairs else None)
        compile_ratio = statistics.median(o["compile_s"] / t["compile_s"] for o, t in pairs) if pairs else None
        fmt = lambda x, f: "–" if x is None else format(x, f)  # noqa: E731
        lines.append(f"| {seeds} | {fmt(med(ours, 'compile_s'), '.2f')} | {fmt(med(ours, 'steps_per_s'), ',.0f')} | "
                     f"{fmt(med(sched, 'steps_per_s'), ',.0f')} | "
                     f"{fmt(med(theirs, 'compile_s'), '.2f')} | {fmt(med(theirs, 'steps_per_s'), ',.0f')} | "
                     f"{fmt(speed, '.2f')} | {fmt(sched_speed, '.2f')} | {fmt(compile_ratio, '.2f')} |")
    write_markdown(path, lines)


if __name__ == "__main__":
    main()
