"""iqn.py's spec (tests/specs/__init__.py): dqn.py's runs, with few quantile samples."""

from specs import Spec, dqn

SPEC = Spec(
    train_config=dict(**dqn.SPEC.train_config, num_taus=4, num_target_taus=5, num_action_taus=3, embedding_dim=8),
    train_updates=5,
    other_lr=3e-4,
    metrics={"q_mean", "epsilon", "gradient_steps", "target_updates"},
    small=dqn.SPEC.small,
    steps_per_update=200,
    bad_inputs={
        "buffer-smaller-than-num-envs": (["--num-envs", "16", "--buffer-size", "8"], "--buffer-size"),
        "no-target-taus": (["--num-target-taus", "0"], "--num-target-taus"),
        "embedding-dim-zero": (["--embedding-dim", "0"], "--embedding-dim"),
        "sweep-kappa-nan": (["--sweep", "kappa=1,nan"], "kappa"),
    },
    # The default reached SOLVED on 21 of 24 seeds (results/seeds_cpu.md); its test learns Catch (specs/dqn.py).
    learning_flags=dqn.catch_run(30_000),
    target=dqn.CATCH_TARGET,
    reach=3,
    greedy_target=dqn.CATCH_GREEDY_TARGET,  # the greedy policy (no exploration) as well
    learning_checks=dqn.learning_checks,
    built_from="dqn",
)
