"""--pbt: population-based training (Jaderberg et al. 2017) inside the compiled chunk program.

The command's runs (its seeds times its sweep points) are the population. With --pbt the chunk of
updates the harness compiles is one PBT interval long and ends, in the same program, with the
exploit/explore step: members are ranked by fitness; each member of the weakest `fraction` draws
one of the fittest `fraction` and, where that one is strictly fitter, copies its whole training
state (every field of the file's runner: parameters, optimiser state, target networks,
normalisers, replay buffer, environments, HParams) but its own random key; then the perturbed
HParams fields of the member that copied are multiplied by 0.8 or 1.2 (clipped to their bounds)
or redrawn from the sweep's values. It is all array ops on the run axis, so it runs sharded like
the updates, exploiting across every device. The step's randomness comes from the seed and the
step's index alone, so a resumed run repeats it bit for bit.
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import suites
from .protocol import Algorithm, UsageError, flag

FACTORS = (0.8, 1.2)  # what `multiply` scales a perturbed value by, each with probability 1/2
STREAM = 0x50B7  # folded into the seed's key: PBT's draws are apart from the runs' own


class Settings(NamedTuple):
    """The population-based training of one command (config.json's "pbt")."""

    interval: int  # updates between exploit/explore steps: the length of a compiled chunk
    fraction: float  # the weakest share of members that may copy one of the fittest share
    fields: tuple  # the HParams fields explore changes
    bounds: tuple  # per field, (low, high) that `multiply` clips to
    perturb: str  # multiply (by 0.8 or 1.2) or resample (a value from the field's start values)
    choices: tuple  # per field, the start values (those of the sweep points) `resample` draws from
    fitness: str  # return (mean return of the episodes each member finished in the interval) or greedy
    num_members: int  # the population: seeds x sweep points (the padding for the devices is not in it)
    seed: int

    def as_json(self) -> dict:
        return {name: list(map(list, v)) if name in ("bounds", "choices") else v for name, v in self._asdict().items()}

    @classmethod
    def from_json(cls, saved: dict) -> "Settings":
        tuples = {name: tuple(map(tuple, saved[name])) for name in ("bounds", "choices")}
        return cls(**{**saved, "fields": tuple(saved["fields"]), **tuples})


def is_learning_rate(field: str) -> bool:
    return field == "lr" or field.endswith("_lr")


def settings_from(algo: Algorithm, config, args, given: set, points: list) -> Settings | None:
    """The --pbt options checked against the run; None without --pbt. Every bad value is a
    UsageError naming its option, raised before anything compiles."""
    if not args.pbt:
        options = sorted(name for name in given if name.startswith("pbt_"))
        if options:
            raise UsageError(f"--{flag(options[0])} needs --pbt")
        return None
    members = len(points) * config.num_seeds
    interval, fraction = schedule(config, args, members)
    fields = perturbed_fields(algo, args.pbt_fields)
    starts = {field: sorted({point.get(field, getattr(config, field)) for point in points}) for field in fields}
    if args.pbt_perturb == "resample":
        for field in fields:
            if len(starts[field]) < 2:
                raise UsageError(
                    f"--pbt-perturb resample: {flag(field)} has one start value; sweep it (--sweep {field}=V1,V2,...) "
                    "to give resample the values to draw from"
                )
    bounds = field_bounds(algo, config, args.pbt_bounds, starts, args.pbt_perturb == "multiply")
    return Settings(
        interval=interval,
        fraction=fraction,
        fields=fields,
        bounds=tuple(bounds[field] for field in fields),
        perturb=args.pbt_perturb,
        choices=tuple(tuple(starts[field]) for field in fields),
        fitness=args.pbt_fitness,
        num_members=members,
        seed=config.seed,
    )


def schedule(config, args, members: int) -> tuple[int, float]:
    """(--pbt-interval, --pbt-fraction) checked against the run's length and the population's size."""
    if members < 2:
        raise UsageError("--pbt: a population of 1 run; give --num-seeds 2 or more, or a --sweep")
    interval = args.pbt_interval or max(1, config.num_updates // 20)
    if not 1 <= interval < config.num_updates:
        raise UsageError(
            f"--pbt-interval {interval}: must be 1 to {config.num_updates - 1} updates (the run has "
            f"{config.num_updates}), so that members are compared before the run ends"
        )
    fraction = args.pbt_fraction
    if not 0 <= fraction <= 0.5 or (fraction > 0 and int(fraction * members) == 0):
        raise UsageError(
            f"--pbt-fraction {fraction:g}: must be 0 to 0.5, and at least 1/{members} to replace a member "
            f"of this population of {members}"
        )
    return interval, fraction


def perturbed_fields(algo: Algorithm, text: str | None) -> tuple:
    """--pbt-fields FIELD,FIELD as HParams field names; by default the learning rates."""
    if text is None:
        fields = tuple(field for field in algo.sweepable if is_learning_rate(field))
        if not fields:
            raise UsageError(f"--pbt-fields: {algo.name}.py has no learning rate to perturb by default: name fields")
        return fields
    fields = tuple(name.strip().lstrip("-").replace("-", "_") for name in text.split(","))
    for field in fields:
        if field not in algo.sweepable:
            raise UsageError(
                f"--pbt-fields {text}: {field!r} is not a field PBT can change; choose from "
                + ", ".join(map(flag, algo.sweepable))
            )
    if len(set(fields)) != len(fields):
        raise UsageError(f"--pbt-fields {text}: a field is named twice")
    return fields


def field_bounds(algo: Algorithm, config, specs: list, starts: dict, needed: bool) -> dict:
    """{field: (low, high)} from --pbt-bounds FIELD=LOW,HIGH; a learning rate not given has a tenth
    of its lowest start value to ten times its highest. Both ends must be values the file accepts
    and the start values must lie between them."""
    bounds = {field: (min(v) / 10, max(v) * 10) for field, v in starts.items() if is_learning_rate(field)}
    for spec in specs:
        name, _, values = spec.partition("=")
        field = name.strip().lstrip("-").replace("-", "_")
        if field not in starts:
            raise UsageError(f"--pbt-bounds {spec}: {field!r} is not among the perturbed fields ({', '.join(starts)})")
        try:
            low, high = (float(v) for v in values.split(","))
        except ValueError:
            raise UsageError(f"--pbt-bounds {spec}: expected FIELD=LOW,HIGH with two numbers") from None
        if not low < high:
            raise UsageError(f"--pbt-bounds {spec}: LOW must be below HIGH")
        if not low <= starts[field][0] <= starts[field][-1] <= high:
            raise UsageError(f"--pbt-bounds {spec}: excludes the start value(s) {', '.join(map(str, starts[field]))}")
        for value in (low, high):
            try:
                algo.validate_hparams({name: getattr(config, name) for name in algo.sweepable} | {field: value})
            except algo.ConfigError as error:
                raise UsageError(f"--pbt-bounds {spec}: {error}") from None
        bounds[field] = (low, high)
    missing = [field for field in starts if field not in bounds]
    if needed and missing:
        raise UsageError(f"--pbt-fields: give the range of {flag(missing[0])}: --pbt-bounds {missing[0]}=LOW,HIGH")
    return {field: bounds.get(field, (-math.inf, math.inf)) for field in starts}


# --------------------------------------------------------------------------------------
# The exploit/explore step, inside the compiled chunk
# --------------------------------------------------------------------------------------
def choose(fitness, values, pick, perturb, settings: Settings):
    """The step's decisions for a population of P members. fitness [P] (NaN: no episode finished,
    never fitter than anyone), values [P, F] of the perturbed fields, pick [P] and perturb [P, F]
    uniform draws in [0, 1). Returns (source [P]: the member each copies, itself where it copies
    none; the perturbed fields' values [P, F] after the step)."""
    members = fitness.shape[0]
    replaced = int(settings.fraction * members)
    score = jnp.where(jnp.isnan(fitness), -jnp.inf, fitness)
    order = jnp.argsort(score, stable=True)  # weakest first, ties in member order
    weakest, fittest = order[:replaced], order[members - replaced :]
    drawn = fittest[jnp.minimum((pick[weakest] * replaced).astype(jnp.int32), replaced - 1)]
    source = jnp.arange(members).at[weakest].set(jnp.where(score[drawn] > score[weakest], drawn, weakest))
    copied = (source != jnp.arange(members))[:, None]
    return source, jnp.where(copied, explore(values[source], perturb, settings), values)


def explore(values, draws, settings: Settings):
    """New values [P, F] from `values` and uniform `draws` [P, F]."""
    if settings.perturb == "multiply":
        low, high = np.array(settings.bounds, np.float32).T
        factor = jnp.where(draws < 0.5, np.float32(FACTORS[0]), np.float32(FACTORS[1]))
        return jnp.clip(values * factor, low, high)
    width = max(map(len, settings.choices))
    table = np.array([c + (c[-1],) * (width - len(c)) for c in settings.choices], np.float32)  # [F, width]
    counts = np.array([len(c) for c in settings.choices])
    index = jnp.minimum((draws * counts).astype(jnp.int32), counts - 1)
    return jnp.asarray(table)[np.arange(len(counts)), index]


def exploit_explore(runner, fitness, key, settings: Settings, active):
    """The runners [runs, ...] after the step (none changes where `active` is False), and
    copied_from [runs]: the member each copied, -1 where none. Only the rows of members that copy
    are written (at most fraction x members, a number known when compiling), in place in the
    donated runners: a copy of the whole population, replay buffers and all, would cost its time
    and its memory every interval. Runs past `num_members` are the devices' padding: never copied,
    and they copy nothing."""
    members, runs = settings.num_members, fitness.shape[0]
    pick_key, perturb_key = jax.random.split(key)
    values = jnp.stack([getattr(runner.hparams, field) for field in settings.fields], axis=1)
    source, new_values = choose(
        fitness[:members],
        values[:members],
        jax.random.uniform(pick_key, (members,)),
        jax.random.uniform(perturb_key, (members, len(settings.fields))),
        settings,
    )
    copies = active & (source != jnp.arange(members))
    # The members that copy, then unused slots past the last run, which the writes below drop.
    (rows,) = jnp.nonzero(copies, size=int(settings.fraction * members), fill_value=runs)
    member = jnp.minimum(rows, members - 1)  # a valid index to read for every slot
    sources = source[member]
    write = lambda leaf, value: leaf.at[rows].set(value, mode="drop")  # noqa: E731
    moved = jax.tree.map(lambda leaf: write(leaf, leaf[sources]), runner._replace(rng=None))  # its own key stays
    explored = {f: write(getattr(moved.hparams, f), new_values[member, i]) for i, f in enumerate(settings.fields)}
    copied_from = write(jnp.full(runs, -1, jnp.int32), sources.astype(jnp.int32))
    return moved._replace(rng=runner.rng, hparams=moved.hparams._replace(**explored)), copied_from


def interval_fitness(metrics: dict):
    """Per run, the mean return of the episodes it finished in the chunk's updates; NaN for none."""
    returns, counts = metrics["episode_return"], metrics["episodes_finished"]
    count = counts.sum(-1)
    total = jnp.where(counts > 0, returns * counts, 0.0).sum(-1)
    return jnp.where(count > 0, total / jnp.maximum(count, 1), jnp.nan)


def with_exploit(run, settings: Settings, num_updates: int, algo: Algorithm, config):
    """`run(runners, first) -> (runners, metrics)` of one interval, followed in the same program by
    the exploit/explore step (not after the run's last update). Adds to the metrics, per run and
    update, every HParams field in force (pbt_<field>) and pbt_copied_from: the member (index into
    [points x seeds]) the run copied at the end of that update, -1 where none."""
    greedy = jax.vmap(suites.make_evaluate(algo, config)) if settings.fitness == "greedy" else None
    base_key = jax.random.fold_in(jax.random.PRNGKey(settings.seed), STREAM)

    def run_and_exploit(runner, first):
        hparams = runner.hparams
        runner, metrics = run(runner, first)
        key = jax.random.fold_in(base_key, first // settings.interval)
        if greedy is None:
            fitness = interval_fitness(metrics)
        else:
            runs = metrics["episode_return"].shape[0]
            fitness = greedy(algo.saved_params(runner), jax.random.split(jax.random.fold_in(key, 1), runs))
        runner, copied_from = exploit_explore(runner, fitness, key, settings, first + settings.interval < num_updates)
        shape = metrics["episode_return"].shape  # [runs, updates]
        record = {f"pbt_{name}": jnp.broadcast_to(value[:, None], shape) for name, value in hparams._asdict().items()}
        record["pbt_copied_from"] = jnp.full(shape, -1, jnp.int32).at[:, -1].set(copied_from)
        return runner, {**metrics, **record}

    return run_and_exploit


# --------------------------------------------------------------------------------------
# What the run directory shows of it
# --------------------------------------------------------------------------------------
FITTEST_RULE = (
    "the highest final return; among members tied at it, the highest greedy evaluation, then the lowest index"
)


def lineage(copied_from: np.ndarray) -> tuple[np.ndarray, np.ndarray, list]:
    """Follows `copied_from` ([members, updates]: the member each copied at the end of an update, -1 where
    none) in order: per member, the start member its weights descend from at the end, the same during every
    update ([members, updates]), and every copy as (update counted from 1, member, source). The copies of
    one exploit step all read the population before it."""
    ancestor, during, copies = np.arange(copied_from.shape[0]), np.zeros(copied_from.shape, int), []
    for update in range(copied_from.shape[1]):
        during[:, update] = ancestor
        members = np.flatnonzero(copied_from[:, update] >= 0)
        sources = copied_from[members, update]
        copies += [(update + 1, int(m), int(source)) for m, source in zip(members, sources, strict=True)]
        ancestor = ancestor.copy()
        ancestor[members] = ancestor[sources]  # the right side is read before any member is written
    return ancestor, during, copies


def fittest(finals: np.ndarray, evals) -> tuple[int, list]:
    """The fittest member by FITTEST_RULE, and the other members tied with it at the highest final return."""
    finals = np.where(np.isnan(finals), -np.inf, finals)
    tied = np.flatnonzero(finals == finals.max())
    greedy = np.zeros(len(finals)) if evals is None else np.where(np.isnan(evals), -np.inf, evals)
    best = int(tied[np.argmax(greedy[tied])])  # argmax: the first, so the lowest index among equal ones
    return best, [int(member) for member in tied if member != best]


def summarise_pbt(settings: Settings, metrics: dict, eval_returns, points: list, num_seeds: int) -> dict:
    """summary.json's "pbt": the settings, the copies made, every member at the end (the start its weights
    descend from, its final return and hyperparameters), and the fittest member by FITTEST_RULE, with the
    members tied with it; the median member's figures beside it."""
    from .stats import final_returns, nanmean, number

    finals = final_returns(metrics).reshape(-1)
    evals = None if eval_returns is None else np.asarray(eval_returns).reshape(-1)
    ancestor, _, copies = lineage(metrics["pbt_copied_from"].reshape(len(finals), -1))
    best, tied = fittest(finals, evals)

    def start(member) -> dict:  # a member as it started: its sweep point and seed
        return {
            "member": int(member),
            "sweep_point": points[member // num_seeds],
            "seed_index": int(member % num_seeds),
        }

    last = final_hparams(metrics, len(finals))
    updates = metrics["episode_return"].shape[-1]
    median = lambda x: number(np.nanmedian(x)) if np.isfinite(x).any() else None  # noqa: E731
    members = [
        {"index": m, "final_return": number(finals[m]), "descends_from": start(ancestor[m]), "hparams": last[m]}
        for m in range(len(finals))
    ]
    return {
        **settings.as_json(),
        "exploit_steps": (updates - 1) // settings.interval,
        "copies": len(copies),
        "fittest_rule": FITTEST_RULE,
        "best_member": {
            "index": best,
            "sweep_point": points[best // num_seeds],
            "seed_index": best % num_seeds,
            "final_return": number(finals[best]),
            "eval_return": None if evals is None else number(evals[best]),
            "tied_with": tied,
            "descends_from": start(ancestor[best]),
            "hparams": last[best],
        },
        "members": members,
        "median_final_return": median(finals),
        "median_eval_return": None if evals is None else median(evals),
        "mean_final_return": number(nanmean(finals)),
    }


def final_hparams(metrics: dict, members: int) -> list[dict]:
    """Each member's hyperparameters in force at the end, to float32's digits."""
    fields = [name for name in metrics if name.startswith("pbt_") and name != "pbt_copied_from"]
    return [
        {name[len("pbt_") :]: float(f"{metrics[name].reshape(members, -1)[member, -1]:.7g}") for name in fields}
        for member in range(members)
    ]


def trajectories_png(algorithm: str, metrics: dict, settings: Settings, env_name: str, evals, annealed: bool) -> bytes:
    """pbt.png: every member's value of each perturbed field over training and its return (as
    learning_curve.png draws it), coloured at each update by the start member its weights then descend
    from, each copy marked where it happened (x: the member that copied, on its new line), the fittest bold."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .stats import final_returns, window_returns

    steps = metrics["env_steps"][0, 0]
    finals = final_returns(metrics).reshape(-1)
    _, during, copies = lineage(metrics["pbt_copied_from"].reshape(len(finals), -1))
    best, tied = fittest(finals, None if evals is None else np.asarray(evals).reshape(-1))
    colours = {a: plt.get_cmap("tab10")(i % 10) for i, a in enumerate(np.unique(during).tolist())}
    rows = [(field, metrics[f"pbt_{field}"]) for field in settings.fields] + [("return", window_returns(metrics))]
    fig, axes = plt.subplots(len(rows), 1, figsize=(7.5, 2.6 * len(rows) + 0.6), sharex=True, squeeze=False)
    for ax, (label, values) in zip(axes[:, 0], rows, strict=True):
        draw_members(ax, steps, values.reshape(len(finals), -1), during, copies, colours, best)
        if label != "return" and np.all(values > 0):
            ax.set_yscale("log")
        schedule = " (start of its decay)" if annealed and is_learning_rate(label) else ""
        ax.set_ylabel(f"{label} in force{schedule}" if label != "return" else "episode return")
        ax.grid(alpha=0.3)
    handles = [plt.Line2D([], [], color=c, lw=2) for c in colours.values()]
    names = [f"weights from start member {a}" for a in colours]
    handles.append(plt.Line2D([], [], color="black", marker="x", lw=0))
    names.append(f"a copy ({len(copies)} in all)")
    axes[0, 0].legend(handles, names, loc="best", fontsize="x-small")
    axes[-1, 0].set_xlabel("environment steps (per member)")
    ties = f", tied at its final return with {len(tied)} more" if tied else ""
    axes[0, 0].set_title(
        f"{algorithm} on {env_name}: population-based training of {len(finals)} members, exploit every "
        f"{settings.interval} updates\nbold: member {best}, the fittest at the end{ties}",
        fontsize="medium",
    )
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return buffer.getvalue()


def draw_members(ax, steps, values, during, copies, colours: dict, best: int) -> None:
    """One line per member, coloured by the start member its weights descend from; an x where it copied."""
    for member, line in enumerate(values):
        style = dict(lw=2.4, alpha=1.0, zorder=3) if member == best else dict(lw=0.9, alpha=0.6)
        changes = [0, *np.flatnonzero(np.diff(during[member])) + 1, len(line)]
        for start, end in zip(changes[:-1], changes[1:], strict=False):  # one colour per ancestor
            span = slice(max(start - 1, 0), end)  # joined to the previous segment
            ax.plot(steps[span], line[span], color=colours[during[member, start]], **style)
    for update, member, _ in copies:  # the value a member continues from, just after it copied
        if update < values.shape[1]:
            ax.plot(steps[update], values[member, update], "x", color="black", ms=4, alpha=0.7, zorder=4)


def check_runner(algo: Algorithm, config, train) -> None:
    """The runner fields the step needs, looked up without making a runner."""
    hparams = algo.HParams(*(np.float32(getattr(config, name)) for name in algo.sweepable))
    runner = jax.eval_shape(train.init, jax.random.PRNGKey(0), hparams)
    if not all(hasattr(runner, name) for name in ("rng", "hparams")):
        raise UsageError(f"--pbt: {algo.name}.py's runner lacks a field rng or hparams (onefile_harness/protocol.py)")
