"""The run harness's statistics over seeds (onefile_harness/stats.py): each run's final return and
the learning curve drawn from the same episodes, the interquartile mean and its bootstrap confidence
interval (Agarwal et al. 2021), against NumPy loops and scipy. (rliable 1.2.0 installs beside the
stack but fails at run time with NumPy 2.4 and pandas 3, so the harness computes them itself.)"""

import json
import math

import numpy as np
import pytest
import scipy.stats

from conftest import ROOT
from onefile_harness import stats


def random_metrics(seed: int, runs=(2, 3), updates=40):
    """Per-update mean returns and finished-episode counts, with updates where none ended."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 3, (*runs, updates)) * (rng.random((*runs, updates)) < 0.6)
    returns = np.where(counts > 0, rng.normal(100, 30, (*runs, updates)), np.nan)
    return {"episode_return": returns, "episodes_finished": counts}


def reference_window_returns(metrics, fraction):
    """One run and update at a time: episodes ending in the last ceil(fraction * U) updates."""
    returns, counts = metrics["episode_return"], metrics["episodes_finished"]
    updates = returns.shape[-1]
    window = max(1, math.ceil(updates * fraction))
    out = np.full(returns.shape, np.nan)
    for run in np.ndindex(returns.shape[:-1]):
        last = np.nan
        for u in range(updates):
            lo = max(0, u - window + 1)
            n = counts[run][lo : u + 1].sum()
            if n > 0:
                last = sum(returns[run][t] * counts[run][t] for t in range(lo, u + 1) if counts[run][t] > 0) / n
            out[run][u] = last
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("fraction", [0.05, 0.2])
def test_window_returns_match_a_loop_and_end_at_the_final_return(seed, fraction):
    metrics = random_metrics(seed)
    got = stats.window_returns(metrics, fraction)
    np.testing.assert_allclose(got, reference_window_returns(metrics, fraction), rtol=1e-12, equal_nan=True)
    finals = stats.final_returns(metrics, fraction)
    has_episodes = np.isfinite(finals)
    np.testing.assert_allclose(got[..., -1][has_episodes], finals[has_episodes], rtol=1e-12)


def test_curve_weighs_every_seed_alike():
    """One seed finishes many episodes per update, another one rarely: pooled episodes would follow
    the busy seed; the curve is the mean of each seed's own return."""
    counts = np.array([[[5] * 20], [[1 if u % 10 == 9 else 0 for u in range(20)]]]).reshape(1, 2, 20)
    returns = np.where(counts > 0, np.array([10.0, 90.0])[None, :, None], np.nan)
    curve = np.nanmean(stats.window_returns({"episode_return": returns, "episodes_finished": counts}), axis=1)
    assert curve[0, -1] == pytest.approx(50.0)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 9, 16])
def test_iqm_is_scipys_trimmed_mean(n):
    values = np.random.default_rng(n).normal(size=(7, n))
    np.testing.assert_allclose(stats.iqm(values), scipy.stats.trim_mean(values, 0.25, axis=-1), rtol=1e-12)


def test_bootstrap_interval_against_a_numpy_loop():
    scores = np.array([120.0, 480.0, 500.0, 500.0, 310.0, 499.0, 500.0, 42.0])
    rng = np.random.default_rng(0)
    draws = rng.integers(0, len(scores), (2000, len(scores)))
    iqms = [scipy.stats.trim_mean(scores[d], 0.25) for d in draws]
    assert stats.bootstrap_interval(scores) == pytest.approx(tuple(np.percentile(iqms, [2.5, 97.5])), rel=1e-12)
    low, high = stats.bootstrap_interval(scores)
    assert low <= stats.iqm(scores) <= high


def test_compare_writes_the_harness_figures(tmp_path):
    """benchmarks/compare.py on two run directories: one row per sweep point, with the IQM and
    interval the harness computes, and a figure."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import compare

    run_dirs = []
    for index, points in enumerate((1, 2)):
        metrics = random_metrics(index, runs=(points, 4), updates=30)
        metrics["env_steps"] = np.broadcast_to(np.arange(1, 31) * 100, (points, 4, 30))
        metrics["wall_seconds"] = np.arange(1, 31) * 0.1
        run_dir = tmp_path / f"run{index}"
        run_dir.mkdir()
        np.savez(run_dir / "metrics.npz", **metrics)
        summary = {"algorithm": "ppo", "env_name": "CartPole-v1", "trained_timesteps": 3000, "eval_return_mean": 1.0}
        if points > 1:
            summary["sweep"] = [{"sweep_point": {"lr": lr}, "eval_return_mean": 2.0} for lr in (1e-3, 3e-3)]
        (run_dir / "summary.json").write_text(json.dumps(summary))
        run_dirs.append(run_dir)
    out = tmp_path / "comparison"
    assert compare.main([*map(str, run_dirs), "--out", str(out)]) == 0
    table = (tmp_path / "comparison.md").read_text()
    assert table.count("| ppo run") == 3 and "lr=0.003" in table
    finals = stats.final_returns({k: v[1] for k, v in random_metrics(1, runs=(2, 4), updates=30).items()})
    assert f"{stats.iqm(finals[np.isfinite(finals)]):.1f} [" in table
    assert (tmp_path / "comparison.png").read_bytes()[:4] == b"\x89PNG"
