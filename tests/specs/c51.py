"""c51.py's spec (tests/specs/__init__.py): dqn.py's runs, with small distributional heads."""

from specs import Spec, dqn

SPEC = Spec(
    train_config=dict(**dqn.SPEC.train_config, num_atoms=11, v_min=-10.0, v_max=10.0),
    train_updates=5,
    other_lr=1e-3,
    metrics={"q_mean", "epsilon", "gradient_steps", "target_updates"},
    # dqn.py's small run and buffer checks; the distributional heads' own options.
    small=dqn.SPEC.small,
    steps_per_update=200,
    bad_inputs={
        "buffer-smaller-than-num-envs": (["--num-envs", "16", "--buffer-size", "8"], "--buffer-size"),
        "one-atom": (["--num-atoms", "1"], "--num-atoms"),
        "v-min-not-below-v-max": (["--v-min", "5", "--v-max", "5"], "--v-min"),
    },
    # The default reached SOLVED on 24 of 24 seeds (results/seeds_cpu.md); its test learns Catch (specs/dqn.py).
    learning_flags=dqn.catch_run(80_000),
    target=dqn.CATCH_TARGET,
    reach=3,
    greedy_target=dqn.CATCH_GREEDY_TARGET,  # the greedy policy (no exploration) as well
    learning_checks=dqn.learning_checks,
    built_from="dqn",
)
