"""Compares run directories: their learning curves on one figure, against env steps and against
wall-clock, and a table of final returns with the interquartile mean and its 95% bootstrap
confidence interval over seeds (Agarwal et al. 2021).

    python benchmarks/compare.py runs/ppo-CartPole-v1-* runs/dqn-CartPole-v1-*
    python benchmarks/compare.py RUN_DIR ... --out comparison      # comparison.md and comparison.png

Every sweep point of a run directory is one row and one curve. A curve is the mean over seeds of
each seed's own return (its episodes ending in the trailing 5% of updates, the definition the
tables use), with the band from the lowest to the highest seed; nothing else is smoothed. The IQM,
its interval and the curves are computed by the run harness's own functions (onefile_harness/stats.py),
so they are the figures each run's summary.json holds; a file run alone writes the same summary.json names
and metrics.npz arrays, and compares like any run.
"""

import argparse
import json
import os
import sys
import warnings

import numpy as np

from common import stats, write_markdown


def read_run(run_dir: str) -> list[dict]:
    """One dict per sweep point of a run directory: label, summary figures, metrics."""
    try:
        with open(os.path.join(run_dir, "summary.json")) as f:
            summary = json.load(f)
        with np.load(os.path.join(run_dir, "metrics.npz")) as npz:
            metrics = {k: npz[k] for k in npz.files}
    except (OSError, ValueError) as error:
        raise SystemExit(f"compare.py: error: {run_dir} is not a finished run directory ({error})") from None
    name = f"{summary['algorithm']} {os.path.basename(os.path.normpath(run_dir))}"
    points = summary.get("sweep", [{**summary, "sweep_point": {}}])
    rows = []
    for index, point in enumerate(points):
        label = name + "".join(f" {k}={v:g}" for k, v in point["sweep_point"].items())
        per_point = {key: value[index] for key, value in metrics.items() if np.ndim(value) == 3}
        per_point["wall_seconds"] = metrics["wall_seconds"]
        rows.append({"label": label, "summary": summary, "point": point, "metrics": per_point})
    return rows


def figures(row: dict) -> dict:
    """Final return per seed and its mean, std, IQM and 95% interval, from the harness."""
    finals = stats.final_returns(row["metrics"])
    finite = finals[np.isfinite(finals)]
    return {
        "finals": finals,
        "mean": float(np.mean(finite)) if len(finite) else None,
        "std": float(np.std(finite)) if len(finite) else None,
        "iqm": float(stats.iqm(finite)) if len(finite) else None,
        "interval": stats.bootstrap_interval(finite) if len(finite) else None,
    }


def table(rows: list[dict]) -> list[str]:
    lines = [
        "| run | env | seeds | env steps per seed | final return (mean ± std) | IQM [95% CI] | greedy eval |",
        "|---|---|---|---|---|---|---|",
    ]
    show = lambda x: "–" if x is None else f"{x:.1f}"  # noqa: E731
    for row in rows:
        f, summary = figures(row), row["summary"]
        interval = "–" if f["interval"] is None else f"{f['iqm']:.1f} [{f['interval'][0]:.1f}, {f['interval'][1]:.1f}]"
        steps = summary.get("trained_timesteps", 0)
        lines.append(
            f"| {row['label']} | {summary['env_name']} | {len(f['finals'])} | {steps:,} | {show(f['mean'])} ± "
            f"{show(f['std'])} | {interval} | {show(row['point'].get('eval_return_mean'))} |"
        )
    return lines


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_steps, by_seconds) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for index, row in enumerate(rows):
        curves = stats.window_returns(row["metrics"])  # [seeds, updates]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            mean, low, high = np.nanmean(curves, 0), np.nanmin(curves, 0), np.nanmax(curves, 0)
        style = dict(color=f"C{index}")
        for ax, x in ((by_steps, row["metrics"]["env_steps"][0]), (by_seconds, row["metrics"]["wall_seconds"])):
            ax.plot(x, mean, label=f"{row['label']} ({curves.shape[0]} seeds)", **style)
            ax.fill_between(x, low, high, alpha=0.2, **style)
    by_steps.set(xlabel="environment steps (per seed)", ylabel="return")
    by_seconds.set(xlabel="seconds of training (compile not included)")
    for ax in (by_steps, by_seconds):
        ax.grid(alpha=0.3)
    by_steps.legend(fontsize="small", loc="best")
    fig.suptitle(
        "mean over seeds of each seed's return (its episodes ending in the last 5% of updates); band: lowest to "
        "highest seed",
        fontsize="small",
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    parser.add_argument("--out", default="comparison", help="writes OUT.md and OUT.png")
    args = parser.parse_args(argv)
    rows = [row for run_dir in args.run_dirs for row in read_run(run_dir)]
    lines = table(rows)
    print("\n".join(lines))
    write_markdown(args.out + ".md", ["# Run comparison", "", *lines])
    plot(rows, args.out + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
