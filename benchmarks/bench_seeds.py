"""How many seeds reach each file's target at its defaults, over several seed sets, as a user runs it.

    python benchmarks/bench_seeds.py                     # every file's default run, --seed 0, 1 and 2 (24 seeds)
    python benchmarks/bench_seeds.py --only ppo_trxl --only iqn
    python benchmarks/bench_seeds.py --row "ppo_trxl 475 --num-envs 32 --num-minibatches 8" --seed-sets 0 --num-seeds 24
    python benchmarks/bench_seeds.py --jobs 4                    # on a GPU: four command lines at a time

Each run is the file's own command line in a fresh process (`python algorithms/<name>.py --seed S FLAGS`, 8 seeds by
default). A seed reaches the target when its final return (the mean return of its training episodes that ended in the
last 5% of updates, as the README's tables define it) is at least the target; its greedy evaluation is counted apart.
Seed set S trains the seeds `jax.random.split(PRNGKey(S), num_seeds)`: sets 0, 1 and 2 are 24 different seeds.
Writes seeds_<backend>.jsonl (every run, appended, with per-seed returns) and seeds_<backend>.md (the newest
measurement of each row) into --out (benchmarks/results by default).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from common import ROOT, algorithm_path, describe, machine, write_markdown

# Each file's default run and the return every seed should reach there (the README's targets).
DEFAULTS = {
    "ppo": 475.0,  # CartPole-v1, solved at 475 (episodes end at 500)
    "dqn": 475.0,
    "c51": 475.0,
    "qr_dqn": 475.0,
    "iqn": 475.0,
    "rainbow": 475.0,
    "pqn": 475.0,
    "ppo_rnn": 475.0,  # CartPole-v1-no-velocity: the same threshold, the velocities remembered
    "ppo_trxl": 0.9,  # MemoryChain-bsuite-30: +1 for the bit seen 30 steps before, -1 otherwise
    "ppo_continuous": -250.0,  # Pendulum-v1 (sac.py and td3.py, off-policy, reach -200)
    "sac": -200.0,
    "td3": -200.0,
    "ppo_rnd": 0.9,  # DeepSea-bsuite: 0.99 for reaching the treasure, about 0 otherwise
    "ippo": -21.0,  # MPE_simple_spread_v3, the agents' mean return: a uniformly random policy about -27.5
    "mappo": -21.0,
    "ippo_rnn": -21.0,  # the same env, its default 1M steps
    "mappo_rnn": -21.0,
    "pqn_vdn": -13.0,  # the same env and return (its training episodes are epsilon-greedy at 0.1)
    "alphazero": 475.0,  # CartPole-v1, each action a search over the env's own step
}


def command(name: str, seed: int, num_seeds: int, flags: list, runs_dir: str) -> list:
    return [sys.executable, algorithm_path(name), *flags, "--seed", str(seed), "--num-seeds", str(num_seeds)] + [
        "--quiet",
        "--runs-dir",
        runs_dir,
    ]


def read_run(proc: subprocess.Popen, runs_dir: str) -> dict:
    """The finished process's run: per-seed final and greedy returns from its summary and metrics."""
    import numpy as np

    out, err = proc.communicate()
    lines = out.strip().splitlines()
    if proc.returncode not in (0, 3) or not lines or not lines[-1].startswith("results: "):
        return {"error": f"exit {proc.returncode}: {err[-600:]}"}
    run_dir = os.path.join(ROOT, lines[-1][len("results: ") :])
    with open(os.path.join(run_dir, "summary.json")) as file:
        summary = json.load(file)
    with np.load(os.path.join(run_dir, "metrics.npz")) as npz:
        greedy = npz["eval_return"][0].tolist()
    return {
        "env_name": summary["env_name"],
        "final": summary["final_return_per_seed"],
        "greedy": greedy,
        "train_s": summary["train_seconds"],
        "compile_s": summary["compile_seconds"],
    }


def run_rows(rows: list, seed_sets: list, num_seeds: int, jobs: int, timeout: int, record) -> None:
    """Every (row, seed set) as its own process, `jobs` at a time; `record` gets each result as it ends."""
    pending = [(row, seed) for row in rows for seed in seed_sets]
    running = []
    env = {**os.environ}
    if jobs > 1:  # several processes share one accelerator: none takes its memory up front
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    with tempfile.TemporaryDirectory() as tmp:
        while pending or running:
            while pending and len(running) < jobs:
                (name, target, flags), seed = pending.pop(0)
                runs_dir = tempfile.mkdtemp(dir=tmp)
                argv = command(name, seed, num_seeds, flags, runs_dir)
                proc = subprocess.Popen(
                    argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
                )
                running.append((proc, time.perf_counter(), name, target, flags, seed, runs_dir))
            time.sleep(0.5)
            for entry in list(running):
                proc, start, name, target, flags, seed, runs_dir = entry
                if proc.poll() is None and time.perf_counter() - start < timeout:
                    continue
                if proc.poll() is None:
                    proc.kill()
                    result = {"error": f"timed out after {timeout} s"}
                    proc.communicate()
                else:
                    result = read_run(proc, runs_dir)
                running.remove(entry)
                wall = time.perf_counter() - start
                row = {"file": name, "flags": " ".join(flags), "target": target, "seed": seed, "num_seeds": num_seeds}
                record({**row, **result, "wall_s": wall})


def counts(records: list) -> dict:
    """Per row (file, flags, env: a file's default env can change): seeds run, seeds whose final (greedy) return
    reaches the target, lowest final."""
    rows = {}
    for r in records:
        if "error" in r:
            continue
        row = rows.setdefault((r["file"], r["flags"], r["env_name"]), {"env": r["env_name"], "sets": {}})
        row["target"], row["sets"][r["seed"]] = r["target"], r  # the newest target, and measurement of each seed set
    table = {}
    for key, row in rows.items():
        final = [x for r in row["sets"].values() for x in r["final"]]
        greedy = [x for r in row["sets"].values() for x in r["greedy"]]
        reach = sum(x is not None and x >= row["target"] for x in final)
        table[key] = {
            **row,
            "seeds": len(final),
            "reach": reach,
            "greedy_reach": sum(x >= row["target"] for x in greedy),
            "lowest": min((x for x in final if x is not None), default=None),
            "per_set": {
                s: sum(x is not None and x >= row["target"] for x in r["final"]) for s, r in row["sets"].items()
            },
        }
    return table


def markdown(table: dict, where: str) -> list:
    lines = ["# Seeds that reach the target, over seed sets", "", where + ".", ""]
    lines += [
        "Each seed set S is `python algorithms/<file>.py --seed S FLAGS` (8 seeds unless said), in a fresh process."
    ]
    lines += ["A seed reaches the target when its final training return (episodes ending in the last 5% of updates)"]
    lines += [
        "is at least the target; greedy: the greedy policy's evaluation after training, against the same target.",
        "",
    ]
    lines += ["| file | flags | env | target | seeds reaching it | per seed set | lowest seed | greedy reaching it |"]
    lines += ["|---|---|---|---|---|---|---|---|"]
    newest_default_env = {name: env for (name, flags, env) in table if not flags}  # records are oldest first
    for (name, flags, env), row in table.items():
        per_set = ", ".join(f"{s}: {n}" for s, n in sorted(row["per_set"].items()))
        lowest = "–" if row["lowest"] is None else f"{row['lowest']:.1f}"
        defaults = "(defaults)" if env == newest_default_env[name] else "(the defaults of its date: an earlier env)"
        lines.append(
            f"| {name} | {flags or defaults} | {row['env']} | {row['target']:g} | "
            f"{row['reach']} of {row['seeds']} | {per_set} | {lowest} | {row['greedy_reach']} of {row['seeds']} |"
        )
    return lines


def notes_below_the_table(path: str) -> list:
    """The lines written below the table of an existing seeds_<backend>.md (notes on its rows): kept when a new
    record rewrites the table."""
    if not os.path.exists(path):
        return []
    with open(path) as file:
        lines = file.read().splitlines()
    rows = [index for index, line in enumerate(lines) if line.startswith("|")]
    return lines[rows[-1] + 1 :] if rows else []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", default=[], help="a file's default row (repeatable)")
    parser.add_argument("--row", action="append", default=[], help='"FILE TARGET FLAGS...": a row of its own')
    parser.add_argument("--seed-sets", default="0,1,2")
    parser.add_argument("--num-seeds", type=int, default=8, help="seeds per set")
    parser.add_argument("--jobs", type=int, default=1, help="processes at a time (1 on a CPU host)")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per process")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = parser.parse_args()
    rows = [(name, DEFAULTS[name], []) for name in (args.only or ([] if args.row else DEFAULTS))]
    for text in args.row:
        name, target, *flags = text.split()
        rows.append((name, float(target), flags))
    where = machine()
    slug = where["backend"] if where["backend"] == "cpu" else where["device"].replace(" ", "_")
    os.makedirs(args.out, exist_ok=True)
    jsonl, md = (os.path.join(args.out, f"seeds_{slug}.{ext}") for ext in ("jsonl", "md"))

    def record(entry: dict) -> None:
        entry = {**entry, "machine": where}
        with open(jsonl, "a") as file:
            file.write(json.dumps(entry) + "\n")
        brief = {k: v for k, v in entry.items() if k not in ("machine",)}
        print(json.dumps(brief), flush=True)
        with open(jsonl) as file:
            records = [json.loads(line) for line in file]
        same = [r for r in records if r.get("machine", {}).get("device") == where["device"]]
        write_markdown(md, markdown(counts(same), describe(where)) + notes_below_the_table(md))

    run_rows(rows, [int(s) for s in args.seed_sets.split(",")], args.num_seeds, args.jobs, args.timeout, record)


if __name__ == "__main__":
    main()
