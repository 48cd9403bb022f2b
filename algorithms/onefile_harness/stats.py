"""Statistics over seeds and the learning-curve figure: a run's final return, the curves drawn from
the same definition, the interquartile mean and its bootstrap interval (Agarwal et al. 2021)."""

import io
import math
import warnings

import numpy as np

FINAL_FRACTION = 0.05  # a run's final return: its episodes that ended in this last share of the updates


def final_returns(metrics: dict, fraction: float = FINAL_FRACTION) -> np.ndarray:
    """Per run: mean return of the episodes that ended in the last `fraction` of updates."""
    returns, counts = metrics["episode_return"], metrics["episodes_finished"]
    last = max(1, int(math.ceil(returns.shape[-1] * fraction)))
    returns, counts = returns[..., -last:], counts[..., -last:]
    total = np.where(counts > 0, returns * counts, 0.0).sum(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return total / counts.sum(-1)


def window_returns(metrics: dict, fraction: float = FINAL_FRACTION) -> np.ndarray:
    """Per run and update: the mean return of the run's episodes that ended in the trailing window
    of `fraction` of all updates, carried on through updates whose window holds none (NaN before
    the first). Where the last window holds episodes, the last value is `final_returns`: the
    learning curves are drawn from this, so they agree with the tables."""
    returns, counts = metrics["episode_return"], metrics["episodes_finished"]
    window = max(1, int(math.ceil(returns.shape[-1] * fraction)))

    def trailing_sum(x):
        total = np.cumsum(x, axis=-1, dtype=np.float64)
        return total - np.concatenate([np.zeros_like(total[..., :window]), total[..., :-window]], axis=-1)

    count = trailing_sum(counts)
    with np.errstate(invalid="ignore", divide="ignore"):
        value = np.where(count > 0, trailing_sum(np.where(counts > 0, returns * counts, 0.0)) / count, np.nan)
    filled = np.maximum.accumulate(np.where(np.isnan(value), -1, np.arange(value.shape[-1])), axis=-1)
    return np.where(filled >= 0, np.take_along_axis(value, np.maximum(filled, 0), axis=-1), np.nan)


def iqm(values: np.ndarray) -> np.ndarray:
    """Interquartile mean over the last axis (Agarwal et al. 2021): the mean of what is left after
    cutting int(n / 4) values from each end, as scipy.stats.trim_mean(values, 0.25)."""
    values = np.sort(values, axis=-1)
    cut = int(values.shape[-1] * 0.25)
    return values[..., cut : values.shape[-1] - cut].mean(-1)


def bootstrap_interval(values: np.ndarray, reps: int = 2000, level: float = 0.95, seed: int = 0) -> tuple:
    """Percentile bootstrap confidence interval of the IQM of `values` (seeds resampled with
    replacement; one task, so stratifying changes nothing)."""
    values = np.asarray(values, np.float64)
    samples = values[np.random.default_rng(seed).integers(0, len(values), (reps, len(values)))]
    low, high = np.percentile(iqm(samples), [50 * (1 - level), 50 * (1 + level)])
    return float(low), float(high)


def nanmean(x, axis=None):
    """np.nanmean that stays quiet (NaN) where every value is NaN: updates with no finished episode."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(x, axis=axis)


def number(x) -> float | None:
    """A float for JSON, which has no NaN: None where no value exists (no finished episode)."""
    return float(x) if math.isfinite(x) else None


def point_label(point: dict) -> str:
    return ", ".join(f"{name}={value:g}" for name, value in point.items())


def learning_curves_png(algorithm: str, metrics: dict, points: list, num_seeds: int, env_name: str) -> bytes:
    """The run directory's learning_curve.png: per sweep point, the mean over seeds of each seed's
    `window_returns`, with a band from the lowest to the highest seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    steps = metrics["env_steps"][0, 0]
    for point, returns in zip(points, window_returns(metrics), strict=True):  # returns: [seeds, updates]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            mean, low, high = (np.nanmean(returns, 0), np.nanmin(returns, 0), np.nanmax(returns, 0))
        (line,) = ax.plot(steps, mean, label=point_label(point) or f"mean of {num_seeds} seeds")
        ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.2)
    ax.set_xlabel("environment steps (per run)")
    # Two short lines, so the label fits the figure's height.
    ax.set_ylabel(f"episode return\n(per seed: episodes ending in the last {FINAL_FRACTION:.0%} of updates)")
    ax.set_title(f"{algorithm} on {env_name}: mean over {num_seeds} seeds, band min to max")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120)
    plt.close(fig)
    return buffer.getvalue()
