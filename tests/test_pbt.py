"""--pbt, population-based training in the compiled chunk program (onefile_harness/pbt.py).

The exploit/explore decisions against a plain NumPy reference on hand-made populations; a member's
whole state after exploit equals its source's but its key; with nothing replaced a PBT run equals
the plain run; a resumed PBT run equals the one that never stopped; every file trains a population
from its command line, and its run directory's record of the population is consistent with itself;
bad --pbt input exits 2 with one line, before anything is written.
"""

import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import serialization
from specs import SPECS
from test_resume import interrupt_at_chunk

from conftest import ROOT, load_algorithm, run_main
from conftest import run_dir_of as results_dir
from onefile_harness import pbt, stats

# A population run of every file, and resuming one, compile programs of their own: ppo.py's run in
# the fast loop, the others with the slow tests (conftest reads this).
SLOW_EXCEPT_PPO = {"test_every_file_trains_a_population", "test_a_resumed_population_equals_the_one_that_never_stopped"}
# PBT copies whole Runners and rewrites HParams, whatever they hold: a file made from another (conftest.BUILT_FROM,
# e.g. rainbow.py from c51.py) is left to that one's population run (each costs 15-30 s of compile in CI).
SKIP_BUILT_FROM = SLOW_EXCEPT_PPO
# The harness's own checks and its resume of a population, the same for any file: on ppo.py, and dqn.py for a replay
# buffer (skipped at collection, so no other file's population run is made for them).
ONLY_FOR = {
    "test_a_resumed_population_equals_the_one_that_never_stopped": ("ppo", "dqn"),
    "test_resume_and_eval_only_refuse_pbt_options": ("ppo",),
}


def settings(
    fraction, perturb="multiply", bounds=((1e-4, 1e-2), (0.0, 0.3)), choices=((1e-3, 3e-3), (0.1,)), members=8
):
    return pbt.Settings(
        interval=2,
        fraction=fraction,
        fields=("lr", "clip_eps"),
        bounds=bounds,
        perturb=perturb,
        choices=choices,
        fitness="return",
        num_members=members,
        seed=0,
    )


def reference_choose(fitness, values, pick, draws, s: pbt.Settings):
    """The step in plain NumPy, one member at a time."""
    members, fields = values.shape
    replaced = int(s.fraction * members)
    score = [-math.inf if math.isnan(f) else f for f in fitness]
    order = sorted(range(members), key=lambda i: (score[i], i))
    weakest, fittest = order[:replaced], order[members - replaced :]
    source, new = list(range(members)), values.copy()
    for i in weakest:
        j = fittest[min(int(pick[i] * replaced), replaced - 1)]
        if score[j] <= score[i]:
            continue  # only a strictly fitter member is copied
        source[i] = j
        for f in range(fields):
            if s.perturb == "multiply":
                factor = np.float32(0.8) if draws[i, f] < 0.5 else np.float32(1.2)
                low, high = (np.float32(b) for b in s.bounds[f])
                new[i, f] = min(max(values[j, f] * factor, low), high)
            else:
                options = s.choices[f]
                new[i, f] = np.float32(options[min(int(draws[i, f] * len(options)), len(options) - 1)])
    return np.array(source), new


# (fitness, fraction, perturb): NaN is a member that finished no episode
POPULATIONS = {
    "distinct": ([3.0, 1.0, 7.0, 2.0, 9.0, 4.0, 0.5, 6.0], 0.25, "multiply"),
    "ties-and-nan": ([1.0, np.nan, 1.0, 5.0, np.nan, 5.0, 2.0, 0.0], 0.5, "multiply"),
    "resample": ([3.0, 1.0, 7.0, 2.0, 9.0, 4.0, 0.5, 6.0], 0.5, "resample"),
    "all-nan": ([np.nan] * 8, 0.5, "multiply"),
    "fraction-0": ([3.0, 1.0, 7.0, 2.0, 9.0, 4.0, 0.5, 6.0], 0.0, "multiply"),
}


@pytest.mark.parametrize("case", sorted(POPULATIONS))
@pytest.mark.parametrize("draw_seed", [0, 1, 2])
def test_exploit_and_explore_match_numpy(case, draw_seed):
    fitness, fraction, perturb = POPULATIONS[case]
    s = settings(fraction, perturb)
    rng = np.random.default_rng(draw_seed)
    # lr values, one of them at its upper bound (multiply must clip it), and clip_eps values
    values = np.stack([[1e-3, 2e-3, 1e-2, 5e-4, 3e-3, 1e-3, 8e-3, 4e-3], np.linspace(0.1, 0.3, 8)], 1)
    values = values.astype(np.float32)
    pick, draws = rng.uniform(size=8).astype(np.float32), rng.uniform(size=(8, 2)).astype(np.float32)
    source, new = jax.device_get(jax.jit(pbt.choose, static_argnums=4)(np.array(fitness), values, pick, draws, s))
    want_source, want_new = reference_choose(fitness, values, pick, draws, s)
    np.testing.assert_array_equal(source, want_source)
    np.testing.assert_array_equal(new, want_new)
    copied = source != np.arange(8)
    assert copied.sum() <= int(fraction * 8)
    assert not np.isnan(np.array(fitness)[source[copied]]).any()  # no finished episode: never copied
    assert (np.array(fitness)[source[copied]] > np.nan_to_num(np.array(fitness)[copied], nan=-np.inf)).all()
    if case in ("all-nan", "fraction-0"):
        assert not copied.any()


def test_the_weakest_copy_the_fittest():
    """The hand-made case spelled out: members 6 and 1 (fitness 0.5 and 1) copy 4 or 2 (9 and 7)."""
    fitness, fraction, _ = POPULATIONS["distinct"]
    values = np.full((8, 2), 1e-3, np.float32)
    source, new = jax.device_get(
        pbt.choose(np.array(fitness), values, np.full(8, 0.9, np.float32), np.zeros((8, 2)), settings(fraction))
    )
    np.testing.assert_array_equal(source, [0, 4, 2, 3, 4, 5, 4, 7])  # pick 0.9: the fittest of the two
    np.testing.assert_array_equal(new[[1, 6]], np.float32(1e-3) * np.float32(0.8))  # draws 0: x 0.8
    np.testing.assert_array_equal(new[[0, 2, 3, 4, 5, 7]], values[[0, 2, 3, 4, 5, 7]])


@pytest.fixture(scope="module")
def ppo_runners():
    """Five ppo.py runners of a small config (the fifth: padding for the devices), each with its own lr."""
    ppo = load_algorithm("ppo")
    config = ppo.Config(total_timesteps=2048, num_envs=4, num_steps=32)
    hparams = ppo.hparams_from(config)._replace(lr=jnp.array([1e-3, 2e-3, 3e-3, 4e-3, 5e-3]))
    hparams = jax.tree.map(lambda x: jnp.broadcast_to(x, (5,)), hparams)
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    return jax.device_get(jax.jit(jax.vmap(ppo.make_train(config).init))(keys, hparams))


@pytest.mark.parametrize("active", [True, False])
def test_a_member_after_exploit_equals_its_source_but_its_key(ppo_runners, active):
    s = pbt.Settings(
        interval=2,
        fraction=0.5,
        fields=("lr",),
        bounds=((1e-4, 1e-1),),
        perturb="multiply",
        choices=((1e-3,),),
        fitness="return",
        num_members=4,
        seed=0,
    )
    fitness = jnp.array([0.0, 3.0, 1.0, 2.0, 99.0])  # the padding's 99 must never be copied
    after, copied_from = jax.device_get(
        jax.jit(pbt.exploit_explore, static_argnums=3)(ppo_runners, fitness, jax.random.PRNGKey(1), s, active)
    )
    expected = [0, 1, 2, 3, 4]
    if active:
        assert set(copied_from[[0, 2]]) <= {1, 3} and (copied_from[[1, 3, 4]] == -1).all()
        expected = [copied_from[0], 1, copied_from[2], 3, 4]
    else:
        assert (copied_from == -1).all()
    for run, source in enumerate(expected):
        for field in ppo_runners._fields:
            if field in ("rng", "hparams"):
                continue
            jax.tree.map(
                lambda a, b, run=run, source=source: np.testing.assert_array_equal(a[run], b[source]),
                getattr(after, field),
                getattr(ppo_runners, field),
            )
        np.testing.assert_array_equal(after.rng[run], ppo_runners.rng[run])  # its own key
        for name, value in after.hparams._asdict().items():
            start = getattr(ppo_runners.hparams, name)[source]
            if name == "lr" and source != run:
                assert value[run] in (np.float32(start * np.float32(0.8)), np.float32(start * np.float32(1.2)))
            else:
                assert value[run] == start, name


def population_flags(name: str) -> list:
    """A population of 4 (2 seeds x 2 learning rates), half replaced every 2 updates. Episodes of
    the continuous-action files' small runs do not end within an interval: there fitness is greedy."""
    flags = [*SPECS[name].small, "--sweep", "lr=1e-3,3e-3", "--pbt", "--pbt-interval", "2"]
    flags += ["--pbt-fraction", "0.5", "--quiet"]
    if name in ("ppo_continuous", "sac", "td3"):
        flags += ["--pbt-fitness", "greedy"]
    if name == "ppo":
        flags += ["--pbt-fields", "lr,clip-eps", "--pbt-bounds", "clip-eps=0.1,0.3"]
    return flags


def load_run(run_dir: pathlib.Path):
    with np.load(run_dir / "metrics.npz") as npz:
        metrics = {key: npz[key] for key in npz.files}
    params = serialization.msgpack_restore((run_dir / "params.msgpack").read_bytes())
    return metrics, params, json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module", params=[n for n in SPECS if (ROOT / "algorithms" / f"{n}.py").exists()])
def name(request):
    return request.param


@pytest.fixture(scope="module")
def population_run(name, tmp_path_factory):
    code = run_main_quiet(load_algorithm(name), [*population_flags(name), "--runs-dir", tmp_path_factory.mktemp("pbt")])
    assert code[0] == 0, code[2]
    return results_dir(code[1])


def run_main_quiet(module, argv):
    """(exit code, stdout, stderr) of the file's command line, without pytest's capsys (module fixtures)."""
    import contextlib
    import io

    from conftest import command_line

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = command_line(module, argv)
        except SystemExit as exit:  # argparse's own checks (a choice not offered)
            code = exit.code
    return code, out.getvalue(), err.getvalue()


def test_every_file_trains_a_population(name, population_run):
    """The run directory's record: HParams in force at every update, who copied whom, each copy's
    values explored from its source's, and summary.json's fittest member as the metrics say."""
    metrics, _, summary = load_run(population_run)
    config = json.loads((population_run / "config.json").read_text())
    s = pbt.Settings.from_json(config["pbt"])
    updates = SPECS[name].small_updates
    copied = metrics["pbt_copied_from"].reshape(4, updates)
    assert (copied[:, ::2] == -1).all()  # copies happen at interval ends only (updates 2, 4, ...)
    assert (copied[:, -1] == -1).all()  # no step after the last update
    fields = [key[len("pbt_") :] for key in metrics if key.startswith("pbt_") and key != "pbt_copied_from"]
    assert set(fields) == set(load_algorithm(name).HParams._fields)
    values = {field: metrics[f"pbt_{field}"].reshape(4, updates) for field in fields}
    np.testing.assert_allclose(values["lr"][:, 0], [1e-3, 1e-3, 3e-3, 3e-3], rtol=1e-6)  # the sweep's start
    for member, update in np.argwhere(copied >= 0):
        source = copied[member, update]
        for field in fields:
            before, after = values[field][source, update], values[field][member, update + 1]
            if field in s.fields:
                low, high = s.bounds[s.fields.index(field)]
                want = [np.clip(before * np.float32(f), np.float32(low), np.float32(high)) for f in pbt.FACTORS]
                assert after in want, (field, member, update)
            else:
                assert after == before, (field, member, update)
    for member, update in np.argwhere(copied[:, :-1] < 0):
        for field in fields:
            assert values[field][member, update + 1] == values[field][member, update]
    assert summary["pbt"]["copies"] == int((copied >= 0).sum()) and summary["pbt"]["exploit_steps"] == updates // 2 - 1
    best = summary["pbt"]["best_member"]
    assert best["hparams"]["lr"] == pytest.approx(values["lr"][best["index"], -1], rel=1e-6)
    assert (population_run / "pbt.png").stat().st_size > 0
    assert summary["pbt"]["copies"] > 0, summary["pbt"]  # else this test checks little
    # load_run: a member's Config holds the HParams it ended with; its parameters are its own.
    params = serialization.msgpack_restore((population_run / "params.msgpack").read_bytes())
    module = load_algorithm(name)
    member_config, member_params = module.load_run(population_run, seed=1, point=1)  # member 3: [2 points x 2 seeds]
    for field in fields:
        assert getattr(member_config, field) == values[field][3, -1], field
    first = jax.tree.leaves(params)[0]
    np.testing.assert_array_equal(jax.tree.leaves(member_params)[0], first[1, 1])
    # Lineage: each member's weights descend from the start its copies lead back to.
    for member in summary["pbt"]["members"]:
        want = reference_ancestor(copied, member["index"], updates)
        assert member["descends_from"]["member"] == want, (member, copied)
        assert member["descends_from"]["seed_index"] == want % 2  # members: [2 points x 2 seeds]
        assert member["hparams"]["lr"] == pytest.approx(values["lr"][member["index"], -1], rel=1e-6)
    # The fittest member by the stated rule: the highest final return, then greedy evaluation, then index.
    finals = np.nan_to_num(stats.final_returns(metrics).reshape(-1), nan=-np.inf)
    evals = np.nan_to_num(metrics["eval_return"].reshape(-1), nan=-np.inf)
    order = sorted(range(4), key=lambda m: (-finals[m], -evals[m], m))
    assert best["index"] == order[0] and best["tied_with"] == sorted(
        m for m in order[1:] if finals[m] == finals[order[0]]
    )
    assert best["descends_from"] == summary["pbt"]["members"][best["index"]]["descends_from"]


def reference_ancestor(copied: np.ndarray, member: int, before: int) -> int:
    """The start member whose weights `member` holds after update `before`: back through its last copy
    before then, to the source as it was at that copy (whose own copy at that update came after)."""
    copies = [u for u in range(before) if copied[member, u] >= 0]
    return member if not copies else reference_ancestor(copied, int(copied[member, copies[-1]]), copies[-1])


def test_lineage_follows_the_copies_in_order():
    """Copies of one exploit step read the population before it: at update 2 member 1 copies member 0,
    which copies member 3 at the same step, so member 1 holds member 0's own weights."""
    copied = np.full((4, 6), -1)
    copied[0, 1], copied[1, 1] = 3, 0
    copied[2, 3] = 0  # member 0 holds member 3's weights by now
    copied[3, 5] = 1
    ancestor, during, copies = pbt.lineage(copied)
    assert ancestor.tolist() == [3, 0, 3, 0] == [reference_ancestor(copied, m, 6) for m in range(4)]
    assert copies == [(2, 0, 3), (2, 1, 0), (4, 2, 0), (6, 3, 1)]
    want = [[reference_ancestor(copied, m, u) for u in range(6)] for m in range(4)]  # during update u
    assert during.tolist() == want


def test_the_fittest_member_is_chosen_by_its_rule_and_its_ties_named():
    finals = np.array([500.0, 480.0, 500.0, np.nan, 500.0])
    assert pbt.fittest(finals, np.array([490.0, 500.0, 500.0, 500.0, 500.0])) == (2, [0, 4])
    assert pbt.fittest(finals, None) == (0, [2, 4])  # no evaluation: the lowest index
    assert pbt.fittest(np.array([np.nan, 1.0]), None) == (1, [])


def test_with_nothing_replaced_pbt_equals_the_plain_run(tmp_path, capsys):
    ppo = load_algorithm("ppo")
    small = [*SPECS["ppo"].small, "--quiet"]
    code, out, err = run_main(ppo, [*small, "--runs-dir", tmp_path / "plain"], capsys)
    assert code == 0, err
    plain = results_dir(out)
    code, out, err = run_main(ppo, [*small, "--pbt", "--pbt-fraction", "0", "--runs-dir", tmp_path / "pbt"], capsys)
    assert code == 0, err
    (metrics, params, _), (want, want_params, _) = load_run(results_dir(out)), load_run(plain)
    assert (metrics["pbt_copied_from"] == -1).all()
    for key in set(want) - {"wall_seconds"}:
        np.testing.assert_array_equal(metrics[key], want[key], err_msg=key)
    jax.tree.map(np.testing.assert_array_equal, params, want_params)


def test_a_resumed_population_equals_the_one_that_never_stopped(name, population_run, tmp_path, capsys, monkeypatch):
    module = load_algorithm(name)
    with monkeypatch.context() as patch:
        interrupt_at_chunk(patch, 3)
        code, out, err = run_main(module, [*population_flags(name), "--runs-dir", tmp_path], capsys)
    assert code == 130, err
    stopped = results_dir(out)
    code, out, err = run_main(module, ["--resume", stopped, "--quiet"], capsys)
    assert code == 0, err
    (metrics, params, summary), (want, want_params, want_summary) = load_run(stopped), load_run(population_run)
    assert metrics.keys() == want.keys()
    for key in set(want) - {"wall_seconds"}:
        np.testing.assert_array_equal(metrics[key], want[key], err_msg=key)
    jax.tree.map(np.testing.assert_array_equal, params, want_params)
    assert summary["pbt"] == want_summary["pbt"]


@pytest.mark.parametrize("argv", [["--resume", "--pbt-interval=4"], ["--eval-only", "--pbt"]])
def test_resume_and_eval_only_refuse_pbt_options(name, population_run, argv, capsys):
    code, out, err = run_main(load_algorithm("ppo"), [argv[0], population_run, *argv[1:]], capsys)
    assert (
        code == 2
        and out == ""
        and len(err.strip().splitlines()) == 1
        and f"{argv[-1].split('=')[0]} cannot change" in err
    ), err


BAD_INPUT = {
    "population-of-1": (["--num-seeds", "1", "--pbt"], "--pbt"),
    "option-without-pbt": (["--pbt-interval", "4"], "--pbt-interval"),
    "not-sweepable": (["--pbt", "--pbt-fields", "num-envs"], "--pbt-fields"),
    "bounds-exclude-start": (["--pbt", "--pbt-bounds", "lr=1e-2,1e-1"], "--pbt-bounds"),
    "bounds-of-unperturbed": (["--pbt", "--pbt-bounds", "gamma=0.9,1"], "--pbt-bounds"),
    "bounds-invalid": (["--pbt", "--pbt-fields", "gamma", "--pbt-bounds", "gamma=0.5,1.5"], "--pbt-bounds"),
    "bounds-missing": (["--pbt", "--pbt-fields", "gamma"], "--pbt-bounds gamma=LOW,HIGH"),
    "bounds-reversed": (["--pbt", "--pbt-bounds", "lr=1e-2,1e-4"], "--pbt-bounds"),
    "interval-of-the-run": (["--pbt", "--pbt-interval", "16"], "--pbt-interval"),
    "fraction-above-half": (["--pbt", "--pbt-fraction", "0.75"], "--pbt-fraction"),
    "fraction-replacing-none": (["--num-seeds", "2", "--pbt", "--pbt-fraction", "0.25"], "--pbt-fraction"),
    "resample-unswept": (["--pbt", "--pbt-perturb", "resample"], "--pbt-perturb"),
    "unknown-fitness": (["--pbt", "--pbt-fitness", "best"], "--pbt-fitness"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_pbt_input_exits_2_with_one_line(case, tmp_path):
    flags, option = BAD_INPUT[case]
    argv = [*SPECS["ppo"].small, "--num-seeds", "4", *flags, "--runs-dir", tmp_path]  # a population of 4
    code, out, err = run_main_quiet(load_algorithm("ppo"), argv)
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1 and option in lines[0], err
    assert not any(tmp_path.iterdir())  # nothing written
