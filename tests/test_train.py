"""What every algorithm's `train` must satisfy, on the small configs of its spec (tests/specs/<name>.py):
one key alone equals that key inside a vmapped batch, the same key twice is identical, a sweep
point equals the run whose Config has that value, and running in chunks of `train.update` (as the
run harness does) equals one call. Algorithm-specific checks live in tests/test_<name>_train.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import jaxprs_in_params
from specs import COMMON_METRICS, SPECS

from conftest import ALGORITHM_NAMES, SPECIFIED, _shared, load_algorithm
from onefile_harness.chunks import chunk_updates

# These compile programs of their own for every file; the fast loop runs them on ppo.py only
# (conftest reads this), the slow tests on every file.
SLOW_EXCEPT_PPO = {
    "test_sweep_point_equals_run_with_that_config",
    "test_every_sweepable_field_is_read_from_the_run_hyperparameters",
    "test_a_diverging_point_is_reported_not_finite",
    "test_chunked_run_matches_train",
}
# The harness's chunks call any file's train.update alike: a file made from another (conftest.BUILT_FROM) is left to
# that one's chunked run.
SKIP_BUILT_FROM = {"test_chunked_run_matches_train"}

# Tolerance for runs that must agree up to float reassociation (batched vs unbatched XLA code), unless a
# file's spec gives its own (train_tolerance: sac.py's and ppo_continuous.py's Pendulum runs).
RTOL, ATOL = 1e-5, 1e-6


def tolerance(name) -> tuple:
    return SPECS[name].train_tolerance or (RTOL, ATOL)


def test_every_algorithm_file_has_a_spec_and_every_spec_a_file():
    """What the shared tests run per algorithm is its spec: a file without one would go untested."""
    for name in ALGORITHM_NAMES:
        assert name in SPECS, f"algorithms/{name}.py has no spec: add tests/specs/{name}.py"
    for name, spec in SPECS.items():
        assert name in ALGORITHM_NAMES, f"tests/specs/{name}.py is the spec of no file: algorithms/{name}.py is missing"
        assert spec.built_from in (None, *SPECS), f"tests/specs/{name}.py: built_from={spec.built_from!r} has no spec"


@pytest.fixture(scope="module", params=SPECIFIED)
def name(request):
    return request.param


def assert_close(got, want, path="", rtol=RTOL, atol=ATOL):
    """Float leaves agree to rtol/ATOL; integer and bool leaves (counts, keys, flags) exactly."""

    def check(key, g, w):
        g, w, where = np.asarray(g), np.asarray(w), path + jax.tree_util.keystr(key)
        if g.dtype.kind == "f":
            np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=where)
        else:
            np.testing.assert_array_equal(g, w, err_msg=where)

    jax.tree_util.tree_map_with_path(check, got, want)


def row(tree, i):
    return jax.tree.map(lambda x: x[i], tree)


def test_vmapped_run_matches_single_runs(name, single, batched):
    runner, metrics = batched
    rtol, atol = tolerance(name)
    for i in (0, 1):
        single_runner, single_metrics = single[i]
        assert set(metrics) == set(single_metrics)
        assert_close(row(metrics, i), single_metrics, rtol=rtol, atol=atol)
        # params, optimizer, env and any buffer or target net
        assert_close(row(runner, i), single_runner, rtol=rtol, atol=atol)
        # Episode bookkeeping is step counting: identical, not merely close. (Returns are sums of
        # float rewards, which batched code may round differently: assert_close above checks them.)
        for metric in ("episode_length", "episodes_finished"):
            np.testing.assert_array_equal(row(metrics, i)[metric], single_metrics[metric], err_msg=metric)


def test_same_key_same_result(single):
    (runner_a, metrics_a), _, (runner_b, metrics_b) = single
    for metric in metrics_a:
        np.testing.assert_array_equal(metrics_a[metric], metrics_b[metric], err_msg=metric)
    jax.tree.map(np.testing.assert_array_equal, runner_a, runner_b)


def qr_operand_shapes(jaxpr) -> list:
    """The operand shapes of every QR decomposition in a jaxpr, its loops' and calls' bodies included."""
    shapes = [eqn.invars[0].aval.shape for eqn in jaxpr.eqns if eqn.primitive.name in ("qr", "geqrf")]
    return shapes + [
        shape for eqn in jaxpr.eqns for sub in jaxprs_in_params(eqn.params) for shape in qr_operand_shapes(sub)
    ]


def test_vmapped_init_decomposes_one_matrix_at_a_time(train, keys):
    """Vmapped, flax's orthogonal init is a batched QR, which jaxlib splits over XLA's CPU thread pool while holding
    one of its threads: two at once deadlocked pqn_vdn.py's default-size `jax.jit(jax.vmap(train))` on 2 cores (in 4
    of 7 processes). `train.init` maps its seeds one at a time, so every QR it makes is of one matrix."""
    shapes = qr_operand_shapes(jax.make_jaxpr(jax.vmap(jax.vmap(train.init)))(jnp.stack([keys, keys])).jaxpr)
    assert all(len(shape) == 2 for shape in shapes), shapes


# A value for every sweepable field that differs from the small configs' and acts within their few
# updates (a gradient-norm clip that binds, exploration that changes actions, ...).
ALTERNATIVE = {
    "gamma": 0.9,
    "gae_lambda": 0.5,
    "q_lambda": 0.3,
    "clip_eps": 1e-3,
    "ent_coef": 0.1,
    "vf_coef": 1.5,
    "max_grad_norm": 1e-3,
    "tau": 0.5,
    "eps_start": 0.5,
    "eps_end": 0.3,
    "eps_fraction": 0.9,
    "reward_scale": 1.0,
    "alpha": 0.2,
    "target_entropy_scale": 0.5,
    "exploration_noise": 0.5,
    "policy_noise": 0.5,
    "noise_clip": 0.1,
    "gamma_int": 0.9,
    "ext_coef": 1.0,
    "int_coef": 0.5,
    "rnd_lr": 3e-3,
    "update_proportion": 0.5,
    "kappa": 0.5,
    "beta_start": 0.9,
    "priority_eps": 0.5,
}


def sweep_points(module, config, other_lr, diverge):
    """Sweep points of a program built for lr=other_lr: [0] its own values, [1] lr=config.lr
    (the run of `config`), then one point per other sweepable field with ALTERNATIVE's value, then
    lr=config.lr with every other field at ALTERNATIVE's value (ALTERNATIVE_POINT: the run of
    `alternative_config`), and last the spec's diverging values (DIVERGING_POINT: its `diverge` flags)."""
    base = module.hparams_from(dataclasses.replace(config, lr=other_lr))
    fields = [name for name in module.HParams._fields if name != "lr"]
    for name in fields:
        assert ALTERNATIVE[name] != getattr(config, name), name
    points = [base, base._replace(lr=jnp.float32(config.lr))]
    points += [base._replace(**{name: jnp.float32(ALTERNATIVE[name])}) for name in fields]
    points += [base._replace(lr=jnp.float32(config.lr), **{name: jnp.float32(ALTERNATIVE[name]) for name in fields})]
    flags = dict(zip(diverge[::2], diverge[1::2], strict=True))
    points += [base._replace(**{flag[2:].replace("-", "_"): jnp.float32(value) for flag, value in flags.items()})]
    return fields, jax.tree.map(lambda *x: jnp.stack(x), *points)


ALTERNATIVE_POINT, DIVERGING_POINT = -2, -1


def alternative_config(module, config):
    """`config` with every sweepable field but lr at ALTERNATIVE's value."""
    return dataclasses.replace(config, **{name: ALTERNATIVE[name] for name in module.HParams._fields if name != "lr"})


@pytest.fixture(scope="module")
def swept(name, config, keys):
    """jax.vmap over the sweep points of `sweep_points` in one program, all from keys[0]."""

    def make():
        module, other_lr = load_algorithm(name), SPECS[name].other_lr
        fields, hparams = sweep_points(module, config, other_lr, SPECS[name].diverge)
        other = dataclasses.replace(config, lr=other_lr)
        out = jax.jit(jax.vmap(module.make_train(other), in_axes=(None, 0)))(keys[0], hparams)
        return fields, jax.device_get(hparams), jax.device_get(out)

    return _shared(("swept", name), make)


def test_sweep_point_equals_run_with_that_config(name, config, single, swept):
    """The lr point of a program built for another lr is the run whose Config has that lr."""
    _, hparams, (runner, metrics) = swept
    single_runner, single_metrics = single[0]  # make_train(config)(keys[0])
    rtol, atol = tolerance(name)
    assert_close(row(metrics, 1), single_metrics, rtol=rtol, atol=atol)
    assert_close(row(runner.params, 1), single_runner.params, rtol=rtol, atol=atol)
    np.testing.assert_allclose(runner.hparams.lr[:2], [SPECS[name].other_lr, config.lr], rtol=1e-7)
    # The learning rate really is a run-time input: the two points train differently.
    assert not np.allclose(metrics["loss"][0], metrics["loss"][1], rtol=1e-3, equal_nan=True)


def test_every_sweepable_field_is_read_from_the_run_hyperparameters(name, swept):
    """Changing one field's value in the sweep changes that run: the program reads it from its
    HParams, not from the Config it was built with (which would leave the run equal to point 0)."""
    fields, _, (runner, metrics) = swept
    base = jax.tree.leaves(row(runner.params, 0))
    for index, field in enumerate(fields, start=2):  # the points after [1], up to ALTERNATIVE_POINT
        changed = jax.tree.leaves(row(runner.params, index))
        assert any(not np.array_equal(a, b) for a, b in zip(base, changed, strict=True)), (
            f"sweeping {field} did not change the run: is it read from the Config instead of HParams?"
        )


def test_a_diverging_point_is_reported_not_finite(name, swept):
    """The point with the spec's diverging values (its `diverge` flags: a learning rate of 1e30, ...) reports
    `finite` False from the update where NaN or inf appears on, the points beside it in the same program stay finite:
    what the command line's exit 3 reads (tests/test_cli.py runs that exit on ppo.py; the harness's handling is the
    same for every file)."""
    _, _, (_, metrics) = swept
    finite = metrics["finite"]
    assert finite[:DIVERGING_POINT].all()
    first = int(np.argmin(finite[DIVERGING_POINT]))
    assert not finite[DIVERGING_POINT, first:].any(), finite[DIVERGING_POINT]


@pytest.mark.slow
def test_a_sweep_point_equals_the_run_with_those_values_in_its_config(name, config, keys, swept):
    """The point with every sweepable field changed (lr to the Config's, the others to ALTERNATIVE's)
    of a program built for other values equals the run whose Config has those values. One program
    checks every field: one read from the Config rather than the run's HParams, or mapped to the
    wrong HParams field, would make the two differ (the test above shows each field acts)."""
    module, other_lr = load_algorithm(name), SPECS[name].other_lr
    rtol, atol = tolerance(name)
    if SPECS[name].sweep_check:
        changes, rtol = SPECS[name].sweep_check
        config = dataclasses.replace(config, **changes)
        _, hparams = sweep_points(module, config, other_lr, SPECS[name].diverge)
        program = jax.jit(jax.vmap(module.make_train(dataclasses.replace(config, lr=other_lr)), in_axes=(None, 0)))
        runner, metrics = jax.device_get(program(keys[0], hparams))
    else:
        _, _, (runner, metrics) = swept
    want_runner, want_metrics = jax.device_get(jax.jit(module.make_train(alternative_config(module, config)))(keys[0]))
    assert_close(row(metrics, ALTERNATIVE_POINT), want_metrics, rtol=rtol, atol=atol)
    assert_close(row(runner.params, ALTERNATIVE_POINT), want_runner.params, rtol=rtol, atol=atol)


def test_chunked_run_matches_train(name, train, config, keys, single):
    """train.init and the run harness's chunks of train.update == train, in chunks of one update
    fewer than the run: the second chunk runs past the config's end, where the updates are skipped
    and leave the runner alone. (Where a chunk divides the run, it is train's own scan.)"""
    chunk = config.num_updates - 1
    run = jax.jit(chunk_updates(train, chunk, config.num_updates))
    runner = jax.jit(train.init)(keys[0])
    parts = []
    for first in range(0, config.num_updates, chunk):
        runner, metrics = run(runner, jnp.int32(first))
        parts.append(jax.device_get(metrics))
    assert len(parts) == 2 and config.num_updates % chunk
    metrics = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    single_runner, single_metrics = single[0]
    rtol, atol = tolerance(name)
    assert_close({k: v[: config.num_updates] for k, v in metrics.items()}, single_metrics, rtol=rtol, atol=atol)
    assert_close(jax.device_get(runner), single_runner, rtol=rtol, atol=atol)
    assert not metrics["finite"][config.num_updates :].any()  # skipped updates report nothing


def test_metric_shapes_and_bookkeeping(name, config, single, batched):
    _, metrics = single[0]
    _, all_metrics = batched
    U = config.num_updates
    assert set(metrics) == COMMON_METRICS | SPECS[name].metrics
    for metric in metrics:
        assert np.shape(metrics[metric]) == (U,), metric
        assert np.shape(all_metrics[metric]) == (len(all_metrics["loss"]), U), metric
    # env_steps: cumulative over all envs of a run.
    np.testing.assert_array_equal(metrics["env_steps"], np.arange(1, U + 1) * config.num_envs * config.num_steps)

    finished = all_metrics["episodes_finished"]
    assert np.issubdtype(finished.dtype, np.integer) and (finished >= 0).all()
    assert finished.any(), "no episode ended in the small run: the NaN check below would mean nothing"
    # NaN exactly where no episode ended: never a stale or zero-filled value.
    for metric in ("episode_return", "episode_length"):
        np.testing.assert_array_equal(np.isnan(all_metrics[metric]), finished == 0, err_msg=metric)
    assert metrics["finite"].dtype == bool and all_metrics["finite"].all()
    for metric in set(metrics) - {"finite"}:
        assert np.isfinite(np.nan_to_num(all_metrics[metric], nan=0.0)).all(), metric


def test_episode_accounting_adds_up(config, batched):
    """Every env step belongs to a finished episode (logged) or to the episode still running (in
    the runner)."""
    runner, metrics = batched
    finished = metrics["episodes_finished"]
    lengths = np.where(finished > 0, metrics["episode_length"], 0.0) * finished
    total = lengths.sum(-1) + runner.episodes.episode_length.sum(-1)
    np.testing.assert_allclose(total, config.num_updates * config.num_envs * config.num_steps, rtol=1e-6)
    valid = finished > 0
    assert (metrics["episode_length"][valid] >= 1).all()
    if config.env_name.startswith("CartPole"):  # pays 1 per step: a return is its length
        np.testing.assert_array_equal(metrics["episode_return"], metrics["episode_length"])
        np.testing.assert_array_equal(runner.episodes.episode_return, runner.episodes.episode_length)
        assert (metrics["episode_length"][valid] <= 500).all()


def test_different_keys_start_and_train_differently(train, keys, single):
    init = jax.jit(train.init)
    params = [jax.device_get(init(key).params) for key in keys[:2]]
    jax.tree.map(np.testing.assert_array_equal, params[0], jax.device_get(init(keys[0]).params))
    # Every leaf drawn at random (not a constant such as a zero bias or a unit LayerNorm scale)
    # differs between keys; vmapped seeds are not one copy broadcast.
    pairs = zip(jax.tree.leaves(params[0]), jax.tree.leaves(params[1]), strict=True)
    drawn = [(a, b) for a, b in pairs if np.ptp(a) > 0]
    assert drawn
    for a, b in drawn:
        assert not np.array_equal(a, b)
    # That a vmapped seed starts (and ends) where its key alone does: test_vmapped_run_matches_single_runs.
    (_, metrics_a), (_, metrics_b), _ = single
    assert not np.array_equal(metrics_a["loss"], metrics_b["loss"])
