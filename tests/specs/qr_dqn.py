"""qr_dqn.py's spec (tests/specs/__init__.py): dqn.py's runs, with a small quantile head."""

from specs import Spec, dqn

SPEC = Spec(
    train_config=dict(**dqn.SPEC.train_config, num_quantiles=8),
    train_updates=5,
    other_lr=1e-3,
    metrics={"q_mean", "epsilon", "gradient_steps", "target_updates"},
    small=dqn.SPEC.small,
    steps_per_update=200,
    bad_inputs={
        "buffer-smaller-than-num-envs": (["--num-envs", "16", "--buffer-size", "8"], "--buffer-size"),
        "no-quantiles": (["--num-quantiles", "0"], "--num-quantiles"),
        "kappa-zero": (["--kappa", "0"], "--kappa"),
        "sweep-kappa-zero": (["--sweep", "kappa=1,0"], "kappa"),
    },
    # The default reached SOLVED on 24 of 24 seeds (results/seeds_cpu.md); its test learns Catch (specs/dqn.py).
    learning_flags=dqn.catch_run(30_000),
    target=dqn.CATCH_TARGET,
    reach=3,
    greedy_target=dqn.CATCH_GREEDY_TARGET,  # the greedy policy (no exploration) as well
    learning_checks=dqn.learning_checks,
    built_from="dqn",
)
