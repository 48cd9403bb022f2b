"""The guard on ppo.py's speed and compile time against PureJAXRL's ppo.py, at PureJAXRL's CartPole-v1 config:

    python benchmarks/bench_parity.py --purejaxrl /path/to/purejaxrl        # about 5 minutes on 2 CPU cores

For 1 and 8 vmapped seeds, three pairs of fresh processes, the order alternating within each pair (ours first in
the first pair, PureJAXRL first in the second, ...): each side one `jax.jit(jax.vmap(train))` call, compile
(lower + compile) and run timed apart (bench_speed.py's worker, benchmarks/peers/purejaxrl_driver.py), with an
empty compile cache. Each ratio is the median over pairs of ours / PureJAXRL's within the pair. The guard holds
when env steps/s is at least 0.9x PureJAXRL's and compile at most 1.1x. Results: parity_<backend>.md and .jsonl.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile

from common import ROOT, describe, machine, run_result, write_markdown

SPEED_AT_LEAST, COMPILE_AT_MOST = 0.9, 1.1


def pair(seeds: int, purejaxrl: str, peer_first: bool) -> dict:
    """One fresh process of each side, in the order given, each with an empty compile cache."""
    ours = [
        sys.executable,
        os.path.join(ROOT, "benchmarks", "bench_speed.py"),
        "ppo",
        "--worker",
        "--seeds",
        str(seeds),
    ]
    peer = [sys.executable, os.path.join(ROOT, "benchmarks", "peers", "purejaxrl_driver.py"), "ppo"]
    peer += ["--purejaxrl", purejaxrl, "--seeds", str(seeds)]
    results = {}
    for side, command in [("purejaxrl", peer), ("ours", ours)][:: 1 if peer_first else -1]:
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": cache}
            results[side] = run_result(command, env=env, timeout=900)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--purejaxrl", required=True, help="root of a PureJAXRL checkout")
    parser.add_argument("--seed-counts", default="1,8")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = parser.parse_args()
    where = machine()
    os.makedirs(args.out, exist_ok=True)
    jsonl = os.path.join(args.out, f"parity_{where['backend']}.jsonl")
    rows = []
    for seeds in [int(s) for s in args.seed_counts.split(",")]:
        speed, compile_ = [], []
        for index in range(args.pairs):
            result = pair(seeds, os.path.abspath(args.purejaxrl), peer_first=bool(index % 2))
            with open(jsonl, "a") as file:
                file.write(json.dumps({"seeds": seeds, "pair": index, **result, "machine": where}) + "\n")
            ours, peer = result["ours"], result["purejaxrl"]
            if ours and peer:
                speed.append(ours["steps_per_s"] / peer["steps_per_s"])
                compile_.append(ours["compile_s"] / peer["compile_s"])
                print(
                    f"{seeds} seeds, pair {index + 1}: speed {speed[-1]:.2f}x, compile {compile_[-1]:.2f}x", flush=True
                )
        if speed:
            rows.append((seeds, len(speed), statistics.median(speed), statistics.median(compile_)))
    lines = ["# ppo.py against PureJAXRL's ppo.py: the parity guard", "", describe(where) + ".", ""]
    lines += ["Median over pairs of fresh processes (order alternating) of ours / PureJAXRL's; the guard: env steps/s"]
    lines += [
        f"at least {SPEED_AT_LEAST}x, compile at most {COMPILE_AT_MOST}x. Every measurement: "
        f"`{os.path.basename(jsonl)}`.",
        "",
    ]
    lines += ["| seeds | pairs | env steps/s ratio | compile ratio | guard |", "|---|---|---|---|---|"]
    for seeds, count, speed, compile_ in rows:
        holds = "holds" if speed >= SPEED_AT_LEAST and compile_ <= COMPILE_AT_MOST else "fails"
        lines.append(f"| {seeds} | {count} | {speed:.2f}x | {compile_:.2f}x | {holds} |")
    write_markdown(os.path.join(args.out, f"parity_{where['backend']}.md"), lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
