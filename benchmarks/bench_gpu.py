"""The accelerator benchmark in one command, on whatever JAX backend is present (GPU, TPU or CPU):

    python benchmarks/bench_gpu.py --purejaxrl /path/to/purejaxrl      # about 5 minutes on one H100/H200

1. algorithms/ppo.py against PureJAXRL's ppo.py at PureJAXRL's CartPole-v1 config (4 envs x 128
   steps, 5e5 steps per seed) at 1, 8 and 2,048 vmapped seeds: each side one `jax.jit(jax.vmap(train))`
   call in a fresh process, compile (lower + compile) and run timed apart (bench_speed.py's worker
   and benchmarks/peers/purejaxrl_driver.py, which time both sides the same way).
2. The default run of every algorithm file, as a user runs it (`python algorithms/<name>.py`):
   compile and train seconds and env steps/s from its summary.json, and its final return.

Without --purejaxrl, part 1 times ours alone. Results: benchmarks/results/gpu_<device>.md and .jsonl.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = (
    "ppo",
    "dqn",
    "c51",
    "qr_dqn",
    "iqn",
    "rainbow",
    "pqn",
    "ppo_continuous",
    "ppo_rnd",
    "ppo_rnn",
    "ppo_trxl",
    "sac",
    "td3",
)


def result_line(command: list, timeout: int) -> dict:
    """Runs `command` in a fresh process; its `RESULT {json}` line, or the error in one dict."""
    start = time.perf_counter()
    try:
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        return {"error": (proc.stderr or proc.stdout)[-600:]}
    return {**json.loads(lines[-1][len("RESULT ") :]), "process_wall_s": time.perf_counter() - start}


def default_run(name: str, runs_dir: str, timeout: int) -> dict:
    """`python algorithms/<name>.py` at its defaults: compile, train, env steps/s, final return."""
    out = os.path.join(runs_dir, name)
    command = [sys.executable, os.path.join("algorithms", f"{name}.py"), "--runs-dir", out, "--quiet"]
    start = time.perf_counter()
    try:
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"file": name, "error": f"timed out after {timeout} s"}
    if proc.returncode:
        return {"file": name, "error": proc.stderr[-600:]}
    (run_dir,) = os.listdir(out)
    with open(os.path.join(out, run_dir, "summary.json")) as file:
        summary = json.load(file)
    return {
        "file": name,
        "env_name": summary["env_name"],
        "num_seeds": summary["num_seeds"],
        "compile_s": summary["compile_seconds"],
        "train_s": summary["train_seconds"],
        "steps_per_s": summary["steps_per_second"],
        "final_return_mean": summary.get("final_return_mean"),
        "process_wall_s": time.perf_counter() - start,
    }


def table(device: str, pairs: list, defaults: list) -> str:
    lines = [
        f"# Accelerator benchmark: {device}",
        "",
        f"`python benchmarks/bench_gpu.py`, {time.strftime('%Y-%m-%d')}.",
    ]
    lines += ["", "## ppo.py against PureJAXRL's ppo.py, PureJAXRL's CartPole-v1 config (5e5 steps per seed)", ""]
    lines += [
        "| seeds | ours compile s | ours env steps/s | PureJAXRL compile s | PureJAXRL env steps/s | speed ratio |"
    ]
    lines += ["|---|---|---|---|---|---|"]
    for seeds, ours, peer in pairs:
        fmt = lambda r, k, f: f.format(r[k]) if k in r else r.get("error", "–")[:40].replace("\n", " ")  # noqa: E731
        ratio = f"{ours['steps_per_s'] / peer['steps_per_s']:.2f}x" if "steps_per_s" in ours and peer else "–"
        peer = peer or {"error": "not run"}
        lines.append(
            f"| {seeds} | {fmt(ours, 'compile_s', '{:.1f}')} | {fmt(ours, 'steps_per_s', '{:,.0f}')} | "
            f"{fmt(peer, 'compile_s', '{:.1f}')} | {fmt(peer, 'steps_per_s', '{:,.0f}')} | {ratio} |"
        )
    lines += ["", "## Every file's default run (`python algorithms/<name>.py`)", ""]
    lines += [
        "| file | env | seeds | compile s | train s | env steps/s | final return |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in defaults:
        if "error" in row:
            lines.append(f"| {row['file']} | error: {row['error'][-80:].replace(chr(10), ' ')} | | | | | |")
            continue
        final = "–" if row["final_return_mean"] is None else f"{row['final_return_mean']:.1f}"
        lines.append(
            f"| {row['file']} | {row['env_name']} | {row['num_seeds']} | {row['compile_s']:.1f} | "
            f"{row['train_s']:.1f} | {row['steps_per_s']:,.0f} | {final} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--purejaxrl", help="root of a PureJAXRL checkout (github.com/luchris429/purejaxrl)")
    parser.add_argument("--seed-counts", default="1,8,2048")
    parser.add_argument("--files", default=",".join(FILES), help="the files whose default run is timed")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    parser.add_argument("--budget", type=float, default=480.0, help="seconds; later parts are skipped past it")
    args = parser.parse_args()
    deadline = time.perf_counter() + args.budget
    left = lambda: int(min(300, max(30, deadline + 60 - time.perf_counter())))  # noqa: E731
    import jax

    device = jax.devices()[0].device_kind
    print(f"backend {jax.default_backend()}, device {device}", flush=True)
    slug = device.replace(" ", "_").replace("/", "_")
    os.makedirs(args.out, exist_ok=True)
    pairs, defaults, records = [], [], []

    def record(entry: dict) -> None:
        """Keeps each result as it comes, so a run cut short still leaves its table."""
        records.append(entry)
        print(json.dumps(entry), flush=True)
        with open(os.path.join(args.out, f"gpu_{slug}.jsonl"), "w") as file:
            file.writelines(json.dumps({"device": device, **r}) + "\n" for r in records)
        with open(os.path.join(args.out, f"gpu_{slug}.md"), "w") as file:
            file.write(table(device, pairs, defaults))

    for seeds in [int(s) for s in args.seed_counts.split(",")]:
        if time.perf_counter() > deadline:
            break
        worker = ["benchmarks/bench_speed.py", "ppo", "--worker", "--seeds", str(seeds), "--preset", "purejaxrl"]
        ours = result_line([sys.executable, *worker], timeout=left())
        peer = None
        if args.purejaxrl:
            driver = [sys.executable, "benchmarks/peers/purejaxrl_driver.py", "ppo", "--purejaxrl", args.purejaxrl]
            peer = result_line([*driver, "--seeds", str(seeds)], timeout=left())
        pairs.append((seeds, ours, peer))
        record({"part": "ppo_vs_purejaxrl", "seeds": seeds, "ours": ours, "purejaxrl": peer})
    with tempfile.TemporaryDirectory() as runs_dir:
        for name in args.files.split(","):
            if time.perf_counter() > deadline:
                break
            defaults.append(default_run(name, runs_dir, timeout=left()))
            record({"part": "default_run", **defaults[-1]})
    print(table(device, pairs, defaults))


if __name__ == "__main__":
    main()
